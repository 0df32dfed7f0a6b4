"""Sampling is lossless for the baselines: EAGLE-style chains and trees and PPSD follow the target
(chi-square).

The same tests with verification switched off (every draft accepted) or, for the tree, a wrong
multi-draft rule must reject: that proves they can fail. The harness is test_sampling.py's.
"""

import itertools

import pytest
import torch

import spd.baselines.eagle as eagle
import spd.baselines.eagle_tree as eagle_tree
import spd.tree
from conftest import chi_square_p, count_draws, tiny_model
from spd.baselines.eagle import EagleHead, eagle_generate
from spd.baselines.eagle_tree import TreeOptions, eagle_tree_generate
from spd.baselines.ppsd import PPSDDrafter, PPSDHead
from spd.engine import generate
from spd.sampling import SamplingParams, probs
from spd.target import Target, split_layers

VOCAB, PROMPT = 6, [1, 5, 2]
PARAMS = dict(temperature=0.9, top_k=5)
DRAFT_IDS = [0, 1, 2, 4]      # q is zero on two ids: recovery sampling is exercised


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", num_layers=2, vocab=VOCAB, hidden=16, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=32, seed=7)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # moderately flat distributions: every path matters
    return model, Target.from_hf(model)


def exact_distribution(model, params, length):
    """P(x_1..x_length | prompt) enumerated from the target's processed distributions."""
    table = {}
    seqs = list(itertools.product(range(VOCAB), repeat=length))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + list(s) for s in seqs])).logits
    for row, seq in enumerate(seqs):
        p = 1.0
        for i, token in enumerate(seq):
            p *= float(probs(logits[row, len(PROMPT) - 1 + i], params)[token])
        table[seq] = p
    return table


def draw(run, count, params=PARAMS):
    return count_draws(lambda i: tuple(run(SamplingParams(**params, seed=i))), count)


# EAGLE: 4 new tokens = prefill's + one round of k=2 drafts (both, one or none accepted) + more
EAGLE_LENGTH, EAGLE_K = 4, 2
PPSD_LENGTH = 3


def eagle_run(target):
    head = EagleHead.create(target, draft_ids=DRAFT_IDS, seed=3).eval()
    return lambda params: eagle_generate(target, head, PROMPT, EAGLE_K, params, EAGLE_LENGTH, ())[0]


# tree: 4 new tokens = prefill's + rounds of up to 5 nodes, 3 children per node, 2 deep
TREE = TreeOptions(5, depth=2, top_k=3)


def tree_run(target):
    head = EagleHead.create(target, draft_ids=DRAFT_IDS, seed=3).eval()
    return lambda params: eagle_tree_generate(target, head, PROMPT, TREE, params, EAGLE_LENGTH, ())[0]


def ppsd_run(target):
    head = PPSDHead.create(target, [1, 1], draft_ids=DRAFT_IDS, init_from_target=False, seed=3).eval()
    return lambda params: generate(target, PPSDDrafter(head), PROMPT, split_layers(2, 2), params,
                                   PPSD_LENGTH, ()).tokens


RUNS = {"eagle": (EAGLE_LENGTH, eagle_run), "eagle-tree": (EAGLE_LENGTH, tree_run),
        "eagle-tree-T1": (EAGLE_LENGTH, tree_run), "ppsd": (PPSD_LENGTH, ppsd_run)}
T1 = dict(temperature=1.0)   # plain T=1: no top-k, every id possible


@pytest.mark.parametrize("method", list(RUNS))
def test_baseline_sampling_matches_target_distribution(setup, method):
    model, target = setup
    length, run = RUNS[method][0], RUNS[method][1](target)
    params = T1 if method.endswith("T1") else PARAMS
    table = exact_distribution(model, SamplingParams(**params), length)
    total = 6_000
    pvalue, impossible = chi_square_p(draw(run, total, params), table, total)
    assert impossible == 0, f"{method} produced a continuation the target gives probability 0"
    assert pvalue > 1e-3, f"{method}'s samples do not follow the target's distribution (p={pvalue:.2e})"


def broken_multi(candidates, logits, params, gen):
    """A wrong multi-draft rule: each candidate accepted with p(x) of the untouched p (no residual)."""
    p = probs(logits, params)
    for i, (x, _) in enumerate(candidates):
        if float(torch.rand((), generator=gen)) < float(p[x]):
            return i, x
    return None, int(torch.multinomial(p, 1, generator=gen))


@pytest.mark.parametrize("method", ["eagle", "eagle-tree-T1", "ppsd"])   # the tree: at T=1, where p is flattest
def test_the_chi_square_test_fails_without_verification(setup, method, monkeypatch):
    model, target = setup
    params = T1 if method.endswith("T1") else PARAMS
    always = lambda draft, q, logits, params, gen: (True, draft)  # noqa: E731
    if method == "eagle":
        monkeypatch.setattr(eagle, "verify", always)
        length, run = EAGLE_LENGTH, eagle_run(target)
    elif method.startswith("eagle-tree"):
        monkeypatch.setattr(eagle_tree, "verify_multi", broken_multi)
        length, run = EAGLE_LENGTH, tree_run(target)
    else:
        # the engine verifies through spd.tree (the chain is its width-1 case)
        monkeypatch.setattr(spd.tree, "verify_multi", lambda candidates, logits, params, gen: (0, candidates[0][0]))
        length, run = PPSD_LENGTH, ppsd_run(target)
    table = exact_distribution(model, SamplingParams(**params), length)
    # the broken tree rule only emits tokens p allows: it must fail on the cells, with the same
    # sample count as the passing test (at T=1 no 4-token sequence reaches 5 expected in 3,000)
    total = 6_000 if method.startswith("eagle-tree") else 1_000
    pvalue, impossible = chi_square_p(draw(run, total, params), table, total)
    assert pvalue < 1e-3 or impossible > 0
