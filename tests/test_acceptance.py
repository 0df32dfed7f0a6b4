"""replay() reproduces the engine's greedy counts from one full forward of the known output."""

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
                replayed.mean_width, replayed.verified_by_fill, replayed.accepted_by_fill) == \
               (real.cycles, real.accepted, real.rejected, real.new_tokens, real.stage_tokens,
                real.mean_width, real.verified_by_fill, real.accepted_by_fill)
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
