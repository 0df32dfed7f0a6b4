"""Distributed SPD (gloo, CPU, one process per stage) == single-process engine == AR, token for token.

n=2 and n=3, draft rank separate and co-located with stage 0, final norm + lm_head on the last
stage's rank or on rank 0; oracle (all accepted), adversarial (all rejected), PDM, hybrid (the
run's default drafter), retrieval and seeded-sampling runs; EOS while drafts are still in flight;
budgets shorter than the pipeline; a prompt longer than several prefill chunks (pipelined
prefill). Each rank must hold exactly its own parameters.
"""

import pytest
import torch

from spd.baselines.ar import ar_generate
from spd.checkpoint import load_pdm, save_pdm
from spd.drafters import AdversarialDrafter, OracleDrafter, PDMDrafter
from spd.engine import generate
from spd.pdm import PDM
from spd.retrieval import Gate, HybridDrafter, RetrievalDrafter
from spd.runtime import plan, start
from spd.runtime.faults import read_status
from spd.runtime.weights import parameter_count
from spd.sampling import SamplingParams
from spd.target import Target, split_layers

PROMPTS = [[3, 17, 5, 9, 22], [40, 2, 2, 2, 2, 2, 2, 2, 2, 7, 11, 60],
           [(7 * i + 3) % 61 for i in range(37)]]   # 37 positions: 10 prefill chunks of 4 (the last short)
NEW = 16
LAYOUTS = [(2, "separate", "off", "control"), (2, "with-first-stage", "on", "last"), (3, "separate", "auto", "last"),
           (3, "with-first-stage", "on", "last"), (2, "with-first-stage", "auto", "control")]


@pytest.fixture(scope="module")
def checkpoint(saved_llama6):
    return saved_llama6


def params_of(module) -> int:
    return sum(p.numel() for p in module.parameters())


def check_parameters_per_rank(session, full: Target, stages) -> None:
    layout = session.layout
    head = params_of(full.embed_tokens) + params_of(full.norm) + params_of(full.lm_head)
    own = sum(params_of(full.layers[i]) for i in stages[0]) if layout.colocated else 0
    assert parameter_count(session.target) == head + own
    assert sorted(session.target.layers) == (list(stages[0]) if layout.colocated else [])
    for k, stage in enumerate(stages):
        rank = layout.stage_rank(k)
        if rank != 0:
            status = read_status(session.store, rank)
            assert status["layers"] == list(stage)
            head = params_of(full.norm) + params_of(full.lm_head) if layout.head_on_last and k == len(stages) - 1 else 0
            assert status["params"] == sum(params_of(full.layers[i]) for i in stage) + head


@pytest.mark.parametrize("n,draft_rank,lookahead,head", LAYOUTS)
def test_distributed_equals_engine_equals_ar(checkpoint, n, draft_rank, lookahead, head):
    model, folder = checkpoint
    full = Target.from_hf(model)
    stages = split_layers(full.num_layers, n)
    pdm_dir = folder / f"pdm{n}"
    save_pdm(PDM.create(full, [len(s) for s in stages], num_layers=1, seed=1), pdm_dir)
    local_pdm = load_pdm(pdm_dir, full)

    def drafters(reference):
        """The same drafter twice: for the distributed run and for the engine."""
        yield "oracle", OracleDrafter(reference), OracleDrafter(reference)
        yield "adversarial", AdversarialDrafter(reference, full.vocab_size), AdversarialDrafter(reference, full.vocab_size)
        yield "pdm", session.drafter("pdm"), PDMDrafter(local_pdm)
        yield "hybrid", session.default_drafter(), HybridDrafter(local_pdm, Gate())   # the run's default
        yield "retrieval", session.drafter("retrieval"), RetrievalDrafter()

    spec = plan(str(folder / "model"), stages=n, draft_rank=draft_rank, pdm=str(pdm_dir), timeout=20, threads=1,
                lookahead=lookahead, head=head, prefill_chunk=4)
    with start(spec) as session:
        check_parameters_per_rank(session, full, stages)
        for prompt in PROMPTS:
            reference, _ = ar_generate(full, prompt, max_new_tokens=NEW, eos_token_ids=())
            for kind, ours_drafter, engine_drafter in drafters(reference):
                ours = session.generate(prompt, ours_drafter, max_new_tokens=NEW, eos_token_ids=())
                theirs = generate(full, engine_drafter, prompt, stages, max_new_tokens=NEW, eos_token_ids=())
                assert ours.tokens == theirs.tokens == reference, (kind, prompt)
                a, b = ours.stats, theirs.stats
                assert (a.accepted, a.rejected) == (b.accepted, b.rejected), kind
                assert a.drafts_by_source == b.drafts_by_source, kind
                if lookahead == "on":   # every rejection but one at the last token wastes the cycle issued ahead
                    assert b.cycles + b.rejected - 1 <= a.cycles <= b.cycles + b.rejected, kind
                    if kind == "oracle":   # nothing is issued ahead of the last token
                        assert a.cycles == b.cycles, kind
                elif lookahead == "off":
                    assert a.cycles == b.cycles, kind
                else:   # auto: ahead only while it pays, by measured times
                    assert b.cycles <= a.cycles <= b.cycles + b.rejected, kind
                assert a.breakdown["cycles"] == a.cycles and len(a.breakdown["stage_ms"]) == n
                if kind == "adversarial":
                    assert a.accepted == 0 and a.cycles >= n * (NEW - 1)

        prompt = PROMPTS[0]
        reference, _ = ar_generate(full, prompt, max_new_tokens=NEW, eos_token_ids=())
        eos = reference[6]   # reached while n-1 later drafts are in flight
        cut = reference[: reference.index(eos) + 1]
        for drafter in (OracleDrafter(reference), AdversarialDrafter(reference, full.vocab_size)):
            assert session.generate(prompt, drafter, max_new_tokens=NEW, eos_token_ids=[eos]).tokens == cut
        for budget in range(1, n + 1):   # stops before the pipeline is full
            short = session.generate(prompt, OracleDrafter(reference), max_new_tokens=budget, eos_token_ids=())
            assert short.tokens == reference[:budget]

        abandoned = session.stream(prompt, OracleDrafter(reference), max_new_tokens=NEW, eos_token_ids=())
        assert [next(abandoned) for _ in range(n + 3)] == reference[: n + 3]
        abandoned.close()   # mid-pipeline (and mid-lookahead): the next sequence must not notice
        assert session.generate(prompt, OracleDrafter(reference), max_new_tokens=NEW, eos_token_ids=()).tokens == reference

        sampled = SamplingParams(temperature=0.9, top_k=20, seed=7)
        for prompt in (PROMPTS[0], PROMPTS[2]):   # the sampled first token comes from a pipelined prefill
            for kind, engine_drafter in (("pdm", PDMDrafter(local_pdm)), ("hybrid", HybridDrafter(local_pdm, Gate()))):
                ours = session.generate(prompt, session.drafter(kind), sampled, max_new_tokens=NEW, eos_token_ids=())
                theirs = generate(full, engine_drafter, prompt, stages, sampled, max_new_tokens=NEW, eos_token_ids=())
                assert ours.tokens == theirs.tokens, kind


def test_colocated_single_stage_is_one_process(checkpoint):
    """n=1 with the draft rank on stage 0: world size 1, no messages, same tokens."""
    model, folder = checkpoint
    full = Target.from_hf(model)
    spec = plan(str(folder / "model"), stages=1, draft_rank="with-first-stage", timeout=10, threads=1)
    reference, _ = ar_generate(full, PROMPTS[1], max_new_tokens=NEW, eos_token_ids=())
    with start(spec) as session:
        assert session.workers == {}
        result = session.generate(PROMPTS[1], OracleDrafter(reference), max_new_tokens=NEW, eos_token_ids=())
    assert result.tokens == reference and result.stats.cycles == NEW - 1
    assert torch.distributed.is_initialized() is False
