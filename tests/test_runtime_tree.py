"""Tree SPD (width W > 1) in the distributed runtime (gloo, CPU, one process per stage).

Distributed greedy tokens == single-process engine tokens == AR for W in 2, 4 and n in 2, 3, with
candidate oracles that always / never / sometimes hold the target's token, the PDM and the hybrid;
the counts (acceptance per position and by fill, mean width, stage tokens, cycles) equal the
engine's; seeded sampling equals the engine's; EOS, short budgets and an abandoned stream leave
no message unmatched; W > 1 is refused, before any process starts, where it cannot run.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_config
from spd.baselines.ar import ar_generate
from spd.checkpoint import load_pdm, save_pdm
from spd.cli import app
from spd.drafters import Candidate, CandidateOracle, PDMDrafter
from spd.engine import generate
from spd.pdm import PDM
from spd.retrieval import Gate, HybridDrafter
from spd.runtime import LayoutError, plan, start
from spd.runtime.protocol import Command, Op, command_size
from spd.sampling import SamplingParams
from spd.target import Target, split_layers
from spd.tree import TreeConfig, TreePipeline, TreeShape

PROMPTS = [[3, 17, 5, 9, 22, 3, 17, 5], [40, 2, 2, 2, 2, 2, 2, 2, 2, 7, 11, 60]]
NEW = 12
# (n, W, draft rank, head): every layout path runs a tree level somewhere
RUNS = [(2, 2, "separate", "last"), (2, 4, "with-first-stage", "control"), (3, 2, "with-first-stage", "last"),
        (3, 4, "separate", "control")]


@pytest.fixture(scope="module")
def checkpoint(saved_llama6):
    return saved_llama6


def same_counts(a, b, what) -> None:
    """The distributed run's statistics are the engine's (without lookahead, cycle for cycle)."""
    for name in ("new_tokens", "cycles", "accepted", "rejected", "verified_candidates", "stage_tokens",
                 "verified_by_fill", "accepted_by_fill", "drafts_by_source", "tree_width", "cycles_by_width"):
        assert getattr(a, name) == getattr(b, name), (what, name, getattr(a, name), getattr(b, name))
    assert a.mean_width == b.mean_width and a.per_draft_acceptance == b.per_draft_acceptance, what


@pytest.mark.parametrize("n,width,draft_rank,head", RUNS)
def test_distributed_tree_equals_engine_equals_ar(checkpoint, n, width, draft_rank, head):
    model, folder = checkpoint
    full = Target.from_hf(model)
    stages = split_layers(full.num_layers, n)
    pdm_dir = folder / f"pdm{n}"
    if not pdm_dir.exists():
        save_pdm(PDM.create(full, [len(s) for s in stages], num_layers=1, seed=1), pdm_dir)
    local_pdm = load_pdm(pdm_dir, full)
    tree, vocab = TreeConfig(width), full.vocab_size

    def drafters(reference):
        """The same drafter twice (fresh, equally seeded): for the distributed run and the engine."""
        for mode, seed, best in (("always", 1, True), ("always", 1, False), ("never", 2, False),
                                 ("sometimes", 3, False)):
            yield (f"{mode}{'-best' if best else ''}", CandidateOracle(reference, vocab, mode, seed, best),
                   CandidateOracle(reference, vocab, mode, seed, best))
        yield "pdm", session.drafter("pdm"), PDMDrafter(local_pdm)
        yield "hybrid", session.default_drafter(), HybridDrafter(local_pdm, Gate())   # the run's default

    spec = plan(str(folder / "model"), stages=n, draft_rank=draft_rank, pdm=str(pdm_dir), timeout=20, threads=1,
                head=head, prefill_chunk=4, tree_width=width)
    assert spec.command_size == 5 + 1 + n * (1 + 2 * width)
    with start(spec) as session:
        for prompt in PROMPTS:
            reference, _ = ar_generate(full, prompt, max_new_tokens=NEW, eos_token_ids=())
            for kind, ours_drafter, engine_drafter in drafters(reference):
                ours = session.generate(prompt, ours_drafter, max_new_tokens=NEW, eos_token_ids=())
                theirs = generate(full, engine_drafter, prompt, stages, max_new_tokens=NEW, eos_token_ids=(),
                                  tree=tree)
                assert ours.tokens == theirs.tokens == reference, (kind, prompt)
                same_counts(ours.stats, theirs.stats, kind)
                s = ours.stats
                assert s.breakdown["cycles"] == s.cycles and len(s.breakdown["stage_ms"]) == n
                if kind == "always-best":   # the true branch always survives: the oracle chain
                    assert (s.cycles, s.rejected) == (NEW + n - 2, 0)
                if kind == "never":         # every position restarts the pipeline, W candidates wide
                    assert (s.cycles, s.accepted, s.mean_width) == (n * (NEW - 1), 0, width)
                if kind == "sometimes":
                    assert s.accepted > 0 and s.rejected > 0, "the oracle should mix both outcomes"

        prompt = PROMPTS[0]
        reference, _ = ar_generate(full, prompt, max_new_tokens=NEW, eos_token_ids=())
        eos = reference[6]   # reached while later levels are still in flight
        cut = reference[: reference.index(eos) + 1]
        for mode in ("always", "sometimes"):
            drafter = CandidateOracle(reference, vocab, mode, seed=4)
            assert session.generate(prompt, drafter, max_new_tokens=NEW, eos_token_ids=[eos]).tokens == cut
        for budget in range(1, n + 2):   # stops before the pipeline is full
            short = session.generate(prompt, CandidateOracle(reference, vocab, "sometimes", seed=5),
                                     max_new_tokens=budget, eos_token_ids=())
            assert short.tokens == reference[:budget]
        abandoned = session.stream(prompt, CandidateOracle(reference, vocab, "sometimes", seed=6),
                                   max_new_tokens=NEW, eos_token_ids=())
        assert [next(abandoned) for _ in range(n + 2)] == reference[: n + 2]
        abandoned.close()   # mid-tree: the next sequence must not notice
        again = session.generate(prompt, CandidateOracle(reference, vocab, "never", seed=2), max_new_tokens=NEW,
                                 eos_token_ids=())
        assert again.tokens == reference

        if (n, width) in ((2, 4), (3, 2)):   # seeded sampling: the engine's tokens and counts
            sampled = SamplingParams(temperature=0.9, top_k=20, seed=7)
            for prompt in PROMPTS:
                for kind, engine_drafter in (("pdm", PDMDrafter(local_pdm)), ("hybrid", HybridDrafter(local_pdm, Gate()))):
                    ours = session.generate(prompt, session.drafter(kind), sampled, max_new_tokens=NEW,
                                            eos_token_ids=())
                    theirs = generate(full, engine_drafter, prompt, stages, sampled, max_new_tokens=NEW,
                                      eos_token_ids=(), tree=tree)
                    assert ours.tokens == theirs.tokens, (kind, prompt)
                    same_counts(ours.stats, theirs.stats, kind)


def test_tree_shape_and_commands_round_trip():
    """The command of a tree cycle: its shape survives encoding; W = 1 keeps the chain's 5 ints."""
    pipe = TreePipeline([7, 8, 9], 3, TreeConfig(2), node_rows=100)
    pipe.grow([[Candidate(4, -0.1), Candidate(5, -0.2)]], fill=1)
    pipe.grow([[Candidate(6, -0.1)], [Candidate(7, -0.05), Candidate(8, -1.0)]], fill=2)
    root, (a, b), (c, d) = pipe.root, pipe.levels[1], pipe.levels[2]
    assert (c.token, c.parent, d.token, d.parent) == (6, a, 7, b)   # the best two by path score
    shape = pipe.shape(pipe.work(), accepted=-1)
    assert shape.stages == (((c.uid, a.uid), (d.uid, b.uid)), ((a.uid, root.uid), (b.uid, root.uid)),
                            ((root.uid, -1),))
    command = Command(Op.STEP, newest=4, first=2, crop=-1, tree=tuple(shape.encode(2)))
    size = command_size(3, 2)
    assert size == 5 + 1 + 3 * 5
    decoded = Command.decode(command.encode("cpu", size))
    assert decoded == command and TreeShape.decode(decoded.tree, 3, 2) == shape
    stop = Command.decode(Command(Op.STOP).encode("cpu", size))   # every command of a tree run is that long
    assert stop.op == Op.STOP and stop.tree == (-1,) * (size - 5)
    chain = Command(Op.STEP, newest=12, first=10, crop=11)
    assert command_size(3, 1) == 5 and chain.encode("cpu", command_size(3, 1)).tolist() == [1, 12, 10, 11, 0]

    # the root verifies: token 5 (b) kept; a and its subtree (c) leave every stage's tail
    for k in range(3):
        pipe.ran(k, [root])
    pipe.ran(0, [a, b])
    pipe.ran(1, [a, b])
    pipe.ran(0, [c, d])
    logits = torch.zeros(10)
    logits[5] = 1.0
    kept, token, _ = pipe.settle(logits, SamplingParams(), torch.Generator())
    assert (kept, token) == (b, 5) and pipe.levels == [[b], [d]]
    assert pipe.pruned == [[0, 2, 4], [0, 2], None]   # stage 0 keeps b, d; stage 1 keeps b
    assert pipe.tails[0].nodes == [b, d] and b.parent is None


def test_tree_width_refused_before_any_process_starts(checkpoint, tmp_path):
    _, folder = checkpoint
    model = str(folder / "model")
    with pytest.raises(LayoutError, match="--lookahead on needs --tree-width 1.*--lookahead off"):
        plan(model, stages=2, tree_width=2, lookahead="on")
    with pytest.raises(LayoutError, match="--lookahead auto needs --tree-width 1"):
        plan(model, stages=2, tree_width=4, lookahead="auto")
    with pytest.raises(LayoutError, match="--tree-width must be at least 1"):
        plan(model, stages=2, tree_width=0)
    assert plan(model, stages=2, tree_width=1, lookahead="on").command_size == 5
    recurrent = tmp_path / "recurrent"
    recurrent.mkdir()
    tiny_config("qwen3_5_text", num_layers=4).save_pretrained(recurrent)   # config.json only: no weights
    with pytest.raises(LayoutError, match="--tree-width 2 needs attention-only layers.*linear_attention.*"
                                          "use --tree-width 1"):
        plan(str(recurrent), stages=2, tree_width=2)
    assert plan(str(recurrent), stages=2, drafter="retrieval").tree_width == 1


def test_cli_generate_distributed_tree_width(checkpoint):
    """`spd generate --distributed --tree-width W` decodes AR's tokens; a clash is one error line."""
    _, folder = checkpoint
    runner = CliRunner()
    base = ["generate", "--model", str(folder / "model"), "--prompt-ids", "3,17,5,9", "--stages", "2",
            "--max-new-tokens", "8", "--distributed", "--threads", "1", "--drafter", "pdm"]   # a random PDM
    result = runner.invoke(app, [*base, "--tree-width", "3", "--compare-ar", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["match"] is True and len(data["token_ids"]) == 8
    assert data["stats"]["tree_width"] == 3 and data["stats"]["mean_width"] > 1
    result = runner.invoke(app, [*base, "--tree-width", "2", "--lookahead", "auto"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "--lookahead auto needs --tree-width 1" in errors[0]
