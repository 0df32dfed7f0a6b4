"""replay() reproduces the engine's greedy counts from one full forward of the known output, and at T > 0 the law of its acceptances."""

import pytest

from conftest import tiny_model
from spd.baselines.ar import ar_generate
from spd.bench.acceptance import replay
from spd.drafters import PDMDrafter
from spd.engine import generate
from spd.pdm import PDM
from spd.target import Target, split_layers


@pytest.mark.parametrize("n, family", [(1, "llama"), (2, "qwen3"), (3, "llama"), (4, "qwen2")])
def test_replay_matches_engine(n, family):
    # a small vocabulary makes a random PDM right often enough to mix accepts and rejects
    target = Target.from_hf(tiny_model(family, num_layers=4, vocab=6, seed=n))
    stages = split_layers(4, n)
    pdm = PDM.create(target, [len(s) for s in stages], num_layers=2, seed=11).eval()
    mixed = 0
    for prompt in ([1, 2, 3], [5, 0, 4, 4, 1, 2], [3]):
        continuation, _ = ar_generate(target, prompt, max_new_tokens=40, eos_token_ids=())
        real = generate(target, PDMDrafter(pdm), prompt, stages, max_new_tokens=40, eos_token_ids=()).stats
        replayed = replay(target, PDMDrafter(pdm), prompt, continuation, n)
        assert (replayed.cycles, replayed.accepted, replayed.rejected, replayed.new_tokens, replayed.stage_tokens,
                replayed.mean_width, replayed.verified_by_fill, replayed.accepted_by_fill, replayed.cycles_by_width) == \
               (real.cycles, real.accepted, real.rejected, real.new_tokens, real.stage_tokens,
                real.mean_width, real.verified_by_fill, real.accepted_by_fill, real.cycles_by_width)
        mixed += real.accepted > 0 and real.rejected > 0
    assert mixed >= 1  # the check covered both outcomes


@pytest.mark.parametrize("n, family", [(2, "llama"), (3, "qwen3")])
def test_replay_matches_engine_for_post_step_drafters(n, family):
    # PPSD drafts after the stage step, from the newest token's stage-1 output
    from spd.baselines.ppsd import PPSDDrafter, PPSDHead
    target = Target.from_hf(tiny_model(family, num_layers=4, vocab=6, seed=n))
    stages = split_layers(4, n)
    head = PPSDHead.create(target, [len(s) for s in stages], init_from_target=False, seed=3).eval()
    mixed = 0
    for prompt in ([1, 2, 3], [5, 0, 4, 4, 1, 2]):
        continuation, _ = ar_generate(target, prompt, max_new_tokens=40, eos_token_ids=())
        real = generate(target, PPSDDrafter(head), prompt, stages, max_new_tokens=40, eos_token_ids=()).stats
        replayed = replay(target, PPSDDrafter(head), prompt, continuation, n)
        assert (replayed.cycles, replayed.accepted, replayed.rejected, replayed.verified_by_fill) == \
               (real.cycles, real.accepted, real.rejected, real.verified_by_fill)
        mixed += real.accepted > 0 and real.rejected > 0
    assert mixed >= 1


def test_replay_matches_engine_for_the_adaptive_hybrid():
    """The hybrid that follows each sequence's lead settles its disagreements at the same cycles in
    the replay as in the engine (rejections included), so the counts per source agree."""
    from spd.retrieval import Gate, HybridDrafter
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=6, seed=2))
    stages = split_layers(4, 2)
    pdm = PDM.create(target, [len(s) for s in stages], num_layers=1, seed=5).eval()
    gate = Gate(min_len=1, max_len=3, threshold=[0.3, 0.4, 0.5])
    moved = 0
    for prompt in ([1, 2, 3], [5, 0, 4, 4, 1, 2], [3]):
        continuation, _ = ar_generate(target, prompt, max_new_tokens=60, eos_token_ids=())
        stats = {}
        for adapt in (0.0, 1.0):
            drafter = HybridDrafter(pdm, Gate(**{**gate.__dict__, "adapt": adapt}))
            real = generate(target, drafter, prompt, stages, max_new_tokens=60, eos_token_ids=()).stats
            drafter = HybridDrafter(pdm, Gate(**{**gate.__dict__, "adapt": adapt}))
            replayed = replay(target, drafter, prompt, continuation, 2)
            assert (replayed.cycles, replayed.accepted, replayed.rejected, replayed.drafts_by_source) == \
                   (real.cycles, real.accepted, real.rejected, real.drafts_by_source)
            stats[adapt] = real.drafts_by_source
        moved += stats[0.0] != stats[1.0]
    assert moved >= 1   # the lead changed some decisions


EAGLE_FIELDS = ("rounds", "new_tokens", "verified", "accepted", "draft_forwards", "draft_tokens",
                "verified_by_position", "accepted_by_position", "drafts_by_source", "verify_sizes")


@pytest.mark.parametrize("shape", ["k3", "k5", "k4+retrieval", "tree-b4", "tree-b9-d3-k3"])
def test_eagle_replay_matches_the_baseline(shape):
    from spd.baselines.eagle import EagleHead, eagle_generate
    from spd.baselines.eagle_tree import TreeOptions, eagle_tree_generate
    from spd.bench.acceptance import eagle_replay
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=6, seed=0))
    head = EagleHead.create(target, [1, 2, 4], seed=5).eval()
    mixed = 0
    # the third ends at EOS after a few tokens, the second at a budget the rounds do not divide
    for prompt, max_new, eos in (([1, 2, 3], 40, ()), ([5, 0, 4, 4, 1, 2], 37, ()), ([1, 2, 3], 40, (2,))):
        continuation, _ = ar_generate(target, prompt, max_new_tokens=max_new, eos_token_ids=eos)
        if shape.startswith("tree"):
            b, *rest = [int(x[1:]) for x in shape.removeprefix("tree-").split("-")]
            tree = TreeOptions(b, *rest)
            tokens, real = eagle_tree_generate(target, head, prompt, tree, max_new_tokens=max_new, eos_token_ids=eos)
            replayed = eagle_replay(target, head, prompt, continuation, max_new, tree=tree)
        else:
            k, retrieval = int(shape[1]), (3 if "retrieval" in shape else None)
            tokens, real = eagle_generate(target, head, prompt, k, max_new_tokens=max_new, eos_token_ids=eos,
                                          retrieval_min_len=retrieval)
            replayed = eagle_replay(target, head, prompt, continuation, max_new, k=k, retrieval_min_len=retrieval)
        assert tokens == continuation
        # past an EOS the baseline drafts tokens nobody knows: there only the rounds must agree
        for name in EAGLE_FIELDS if not eos else ("rounds", "new_tokens"):
            assert getattr(replayed, name) == getattr(real, name), name
        mixed += real.accepted > 0 and real.verified > real.accepted
    assert mixed >= 1


def _sampled_counts(shape: str, replayed: bool, seeds: range):
    """(accepted, verified) summed over `seeds` for T = 1 decoding of one method on a tiny model:
    its real decode, or the replay of AR's sample (what `spd bench run --replay` records)."""
    from spd.baselines.eagle import EagleHead, eagle_generate
    from spd.baselines.eagle_tree import TreeOptions, eagle_tree_generate
    from spd.baselines.ppsd import PPSDDrafter, PPSDHead
    from spd.bench.acceptance import eagle_replay
    from spd.retrieval import make_drafter
    from spd.sampling import SamplingParams
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=6, seed=1))
    accepted = verified = 0
    for seed in seeds:
        params, prompt, max_new = SamplingParams(temperature=1.0, seed=seed), [1, 2, 3, seed % 6], 24
        known = ar_generate(target, prompt, params, max_new, eos_token_ids=())[0] if replayed else None
        if shape.startswith(("spd", "ppsd")):
            n = int(shape.split("-n")[1][0])
            stages = split_layers(4, n)
            if shape.startswith("ppsd"):
                head = PPSDHead.create(target, [len(s) for s in stages], init_from_target=False, seed=3).eval()
                make = lambda: PPSDDrafter(head)  # noqa: E731
            else:
                pdm = PDM.create(target, [len(s) for s in stages], num_layers=2, seed=11).eval()
                make = lambda: make_drafter("hybrid" if "retrieval" in shape else "pdm", pdm)  # noqa: E731
            s = (replay(target, make(), prompt, known, n, params=params) if replayed else
                 generate(target, make(), prompt, stages, params, max_new, eos_token_ids=()).stats)
            accepted, verified = accepted + s.accepted, verified + s.accepted + s.rejected
            continue
        head = EagleHead.create(target, [1, 2, 4], seed=5).eval()
        if shape.startswith("eagle-tree"):
            tree = TreeOptions(4)
            s = (eagle_replay(target, head, prompt, known, max_new, tree=tree, params=params) if replayed else
                 eagle_tree_generate(target, head, prompt, tree, params, max_new, eos_token_ids=())[1])
        else:
            k, retrieval = 3, (2 if "retrieval" in shape else None)
            s = (eagle_replay(target, head, prompt, known, max_new, k=k, retrieval_min_len=retrieval, params=params)
                 if replayed else
                 eagle_generate(target, head, prompt, k, params, max_new, (), retrieval_min_len=retrieval)[1])
        accepted, verified = accepted + s.accepted, verified + s.verified
    return accepted, verified


@pytest.mark.parametrize("shape", ["spd-n2", "spd-n3+retrieval", "ppsd-n2", "eagle-k3", "eagle-k3+retrieval",
                                   "eagle-tree-b4"])
def test_sampled_replay_has_the_engines_acceptance(shape):
    # T = 1: the replay of AR's sample draws each acceptance given the known token; over many
    # seeds its acceptance must match the real decode's (a two-proportion z-test). Judging the
    # sampled draft by equality with the known token, or a coin of min(1, p/q), fails it.
    a_real, v_real = _sampled_counts(shape, False, range(40))
    a_rep, v_rep = _sampled_counts(shape, True, range(1000, 1040))
    pooled = (a_real + a_rep) / (v_real + v_rep)
    z = (a_real / v_real - a_rep / v_rep) / (pooled * (1 - pooled) * (1 / v_real + 1 / v_rep)) ** 0.5
    assert 0.05 < a_real / v_real < 0.95, "both outcomes must be common for the test to mean anything"
    assert abs(z) < 4, (a_real / v_real, a_rep / v_rep, z)
