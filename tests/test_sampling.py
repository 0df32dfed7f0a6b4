"""Sampling is lossless: SPD's continuations follow the target's own distribution (chi-square).

The same test, with verification switched off (every draft accepted), must reject: that proves
the test can fail.
"""

import itertools
from collections import Counter

import pytest
import torch

import spd.tree
from conftest import chi_square_p, count_draws, tiny_model
from spd.drafters import PDMDrafter
from spd.engine import generate
from spd.pdm import PDM
from spd.retrieval import Gate, HybridDrafter
from spd.sampling import SamplingParams, probs, verify_sample
from spd.sampling import draw as draw_index
from spd.target import Target, split_layers

VOCAB, PROMPT, LENGTH = 8, [1, 5, 2], 3
PARAMS = dict(temperature=0.9, top_k=6)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", num_layers=2, vocab=VOCAB, hidden=16, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=32, seed=7)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # back to moderately flat distributions: every path matters
    target = Target.from_hf(model)
    # a PDM over a 6-token draft vocabulary: q is zero on two ids, so recovery sampling is exercised
    pdm = PDM.create(target, [1, 1], num_layers=1, draft_ids=[0, 1, 2, 3, 5, 6], seed=3).eval()
    return model, target, pdm


def exact_distribution(model, params, prompt=PROMPT):
    """P(x1, x2, x3 | prompt) enumerated from the target's processed distributions."""
    table = {}
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    with torch.no_grad():   # every sequence in one batch (same length: no padding)
        logits = model(torch.tensor([prompt + list(seq) for seq in seqs])).logits
    for row, seq in enumerate(seqs):
        p = 1.0
        for i, token in enumerate(seq):
            p *= float(probs(logits[row, len(prompt) - 1 + i], params)[token])
        table[seq] = p
    return table


def draw(target, pdm, params, count):
    return count_draws(lambda i: tuple(generate(target, PDMDrafter(pdm), PROMPT, split_layers(2, 2),
                                                SamplingParams(**PARAMS, seed=i), max_new_tokens=LENGTH,
                                                eos_token_ids=()).tokens), count)


def test_spd_sampling_matches_target_distribution(setup):
    model, target, pdm = setup
    params = SamplingParams(**PARAMS)
    table = exact_distribution(model, params)
    total = 20_000
    counts = draw(target, pdm, params, total)
    pvalue, impossible = chi_square_p(counts, table, total)
    assert impossible == 0, "SPD produced a continuation the target gives probability 0"
    assert pvalue > 1e-3, f"SPD's samples do not follow the target's distribution (p={pvalue:.2e})"


def test_the_chi_square_test_fails_without_verification(setup, monkeypatch):
    model, target, pdm = setup
    params = SamplingParams(**PARAMS)
    table = exact_distribution(model, params)
    # the engine verifies through spd.tree (the chain is its width-1 case): accept every draft
    monkeypatch.setattr(spd.tree, "verify_multi", lambda candidates, logits, params, gen: (0, candidates[0][0]))
    total = 4_000
    counts = draw(target, pdm, params, total)
    pvalue, impossible = chi_square_p(counts, table, total)
    assert pvalue < 1e-3 or impossible > 0


def test_verify_sample_preserves_p_exactly_in_expectation():
    """Accept-or-recover with any q yields p: check the closed form of the output law."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.1, 0.1, 0.7])
    law = torch.zeros(4)
    for x in range(4):  # P(out=y) = sum_x q(x) [accept x -> y=x] + [reject x -> residual]
        accept = min(1.0, float(p[x] / q[x])) if q[x] > 0 else 0.0
        residual = torch.clamp(p - q, min=0)
        law[x] += q[x] * accept
        law += q[x] * (1 - accept) * residual / residual.sum()
    assert torch.allclose(law, p, atol=1e-6)
    draws = [verify_sample(3, p, q, gen) for _ in range(200)]
    assert all(not accepted and token != 3 for accepted, token in draws)  # p(3) = 0: never kept


def test_draw_follows_the_weights_and_never_draws_a_zero():
    """The inverse-CDF draw has law weight / total (unnormalised weights, zeros between and at
    both ends); drawing the index one to the left (a wrong bin edge) must fail the test."""
    weights = torch.tensor([0.0, 2.0, 0.0, 0.0, 5.0, 1.0, 0.0, 2.0, 0.0])
    table = {i: float(w / weights.sum()) for i, w in enumerate(weights)}

    def observe(drawn):
        gen = torch.Generator().manual_seed(11)
        return Counter(drawn(weights, gen) for _ in range(4000))

    p, impossible = chi_square_p(observe(draw_index), table, 4000)
    assert p > 1e-3 and impossible == 0
    shifted = lambda w, gen: max(0, draw_index(w, gen) - 1)   # noqa: E731
    p, impossible = chi_square_p(observe(shifted), table, 4000)
    assert p < 1e-6 or impossible > 0


def test_probs_filters():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    assert probs(logits, SamplingParams()).tolist() == [1.0, 0.0, 0.0, 0.0]
    top2 = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and top2.sum() == pytest.approx(1)
    nucleus = probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert nucleus.tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token alone holds > 0.5
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.6),
                                    SamplingParams(temperature=1.0, top_k=4, top_p=0.8)])
def test_probs_of_a_batch_is_each_rows_probs(params):
    """Rows differ in scale so a shared max, k-th value or normaliser would change them."""
    rows = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor([[0.5], [3.0], [9.0]])
    assert torch.allclose(probs(rows, params), torch.stack([probs(row, params) for row in rows]))


HYBRID_PROMPT = [1, 5, 2, 1, 5]   # the suffix 1,5 occurred before: retrieval has a match at once
MIXED = Gate(min_len=1, max_len=2, threshold=[0.3, 0.6])   # retrieval and PDM drafts both verified


class SampledAgreementGate(HybridDrafter):
    """A broken hybrid: it samples the PDM's draft first and, when that sample equals the retrieved
    token, reports the draft as retrieval's point mass. The choice peeks at the drafted token, so
    the q it reports is not the law the draft was drawn from."""

    def draft(self, state, params, gen):
        self.index.sync(state.tokens, state.first_inflight)
        retrieved, _ = self.index.lookup()
        token, q = self.pdm_drafter.draft(state, params, gen)
        self.last_source = "retrieval" if token == retrieved else "pdm"
        return (token, None) if token == retrieved else (token, q)


def draw_hybrid(target, make, count):
    """Counts of the continuations, and how many drafts of each source were verified."""
    def one(i):
        result = generate(target, make(), HYBRID_PROMPT, split_layers(2, 2), SamplingParams(**PARAMS, seed=i),
                          max_new_tokens=LENGTH, eos_token_ids=())
        verified = sorted((name, v) for name, (v, _) in result.stats.drafts_by_source.items())
        return tuple(result.tokens), tuple(verified)

    counts, sources = Counter(), Counter()
    for (tokens, verified), times in count_draws(one, count).items():
        counts[tokens] += times
        for name, v in verified:
            sources[name] += v * times
    return counts, sources


def test_hybrid_sampling_matches_target_distribution(setup):
    model, target, pdm = setup
    table = exact_distribution(model, SamplingParams(**PARAMS), HYBRID_PROMPT)
    total = 5_000
    counts, sources = draw_hybrid(target, lambda: HybridDrafter(pdm, MIXED), total)
    assert sources["retrieval"] > total // 4 and sources["pdm"] > total // 4   # both kinds verified
    pvalue, impossible = chi_square_p(counts, table, total)
    assert impossible == 0
    assert pvalue > 1e-3, f"the hybrid's samples do not follow the target's distribution (p={pvalue:.2e})"


def test_the_chi_square_test_fails_for_a_gate_that_peeks_at_the_draft(setup):
    model, target, pdm = setup
    table = exact_distribution(model, SamplingParams(**PARAMS), HYBRID_PROMPT)
    total = 2_000
    counts, _ = draw_hybrid(target, lambda: SampledAgreementGate(pdm, MIXED), total)
    pvalue, impossible = chi_square_p(counts, table, total)
    assert pvalue < 1e-3 or impossible > 0
