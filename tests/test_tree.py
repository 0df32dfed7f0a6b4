"""Tree SPD: greedy == AR for every width, pruning compacts the caches, sampling stays the target's."""

import pytest
import torch

import spd.tree
from conftest import chi_square_p, count_draws, tiny_model
from spd.baselines.ar import ar_generate
from spd.cache import KVCache
from spd.drafters import CandidateOracle, OracleDrafter, PDMDrafter
from spd.engine import generate
from spd.pdm import PDM
from spd.retrieval import HybridDrafter, RetrievalDrafter
from spd.sampling import SamplingParams, probs, verify_multi
from spd.target import Target, split_layers
from spd.tree import TreeConfig
from test_sampling import LENGTH, PARAMS, PROMPT, exact_distribution, setup  # noqa: F401 (fixture)

PROMPTS = [[3, 17, 5, 9, 22, 3, 17, 5], [40, 2, 2, 2, 2, 2, 2, 2, 2, 7, 11, 60]]
NEW = 20


def tree_drafters(target, stages, reference):
    pdm = PDM.create(target, [len(s) for s in stages], num_layers=1, seed=1).eval()
    vocab = target.vocab_size
    return {"always-best": CandidateOracle(reference, vocab, "always", best_first=True),
            "always": CandidateOracle(reference, vocab, "always", seed=1),
            "never": CandidateOracle(reference, vocab, "never", seed=2),
            "sometimes": CandidateOracle(reference, vocab, "sometimes", seed=3),
            "pdm": PDMDrafter(pdm), "hybrid": HybridDrafter(pdm), "retrieval": RetrievalDrafter()}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])   # gemma2: sliding windows of 4
def test_greedy_tree_spd_equals_ar(family):
    target = Target.from_hf(tiny_model(family, num_layers=4, seed=3))
    for prompt in PROMPTS:
        reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
        for n in (2, 3, 4):
            stages = split_layers(4, n)
            for width in (1, 2, 4):
                for kind, drafter in tree_drafters(target, stages, reference).items():
                    if width == 1 and isinstance(drafter, CandidateOracle):
                        continue
                    result = generate(target, drafter, prompt, stages, max_new_tokens=NEW, eos_token_ids=(),
                                      tree=TreeConfig(width))
                    assert result.tokens == reference, (family, prompt, n, width, kind)
                    s = result.stats
                    assert s.accepted + s.rejected == NEW - 1 and 1 <= s.mean_width <= width
                    # every cycle counted once, by a width that ran (the bench prices cycles by it)
                    assert sum(s.cycles_by_width.values()) == s.cycles and max(s.cycles_by_width) <= width
                    assert width > 1 or s.cycles_by_width == {1: s.cycles}
                    if kind == "always-best":   # the true branch always survives: the oracle chain
                        assert (s.cycles, s.rejected) == (NEW + n - 2, 0)
                    if kind == "never":         # every position restarts the pipeline
                        assert (s.cycles, s.accepted) == (n * (NEW - 1), 0)
                        assert s.mean_width == width or width == 1


def test_tree_eos_and_short_budgets():
    target = Target.from_hf(tiny_model("llama", num_layers=4, seed=5))
    prompt = PROMPTS[0]
    reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
    eos = reference[6]
    cut = reference[: reference.index(eos) + 1]
    stages = split_layers(4, 4)
    for mode in ("always", "sometimes"):
        drafter = CandidateOracle(reference, target.vocab_size, mode, seed=4)
        result = generate(target, drafter, prompt, stages, max_new_tokens=NEW, eos_token_ids=[eos],
                          tree=TreeConfig(3))
        assert result.tokens == cut
        for budget in range(1, 5):
            short = generate(target, drafter, prompt, stages, max_new_tokens=budget, eos_token_ids=(),
                             tree=TreeConfig(3))
            assert short.tokens == reference[:budget]


def test_cache_select_keeps_the_prefix_and_the_chosen_tail_entries():
    cache = KVCache([0, 1])
    keys = torch.arange(6.0).view(1, 1, 6, 1)
    for layer in (0, 1):
        cache.update(keys, keys + 10, layer)
    cache.select(3, [0, 2], layers=[0])
    assert cache.length(0) == 5 and cache.length(1) == 6
    k, v = cache.update(torch.full((1, 1, 1, 1), 9.0), torch.zeros(1, 1, 1, 1), 0)
    assert k.flatten().tolist() == [0, 1, 2, 3, 5, 9]
    assert v.flatten().tolist()[:5] == [10, 11, 12, 13, 15]


def test_tree_widths_refused_where_they_cannot_run():
    recurrent = Target.from_hf(tiny_model("qwen3_5_text", num_layers=4))
    with pytest.raises(ValueError, match="recurrent"):
        generate(recurrent, OracleDrafter([]), [1, 2], split_layers(4, 2), max_new_tokens=4, tree=TreeConfig(2))
    with pytest.raises(ValueError, match="tree width"):
        TreeConfig(0)


def test_verify_multi_law_is_p_for_any_candidates():
    """The recursive rule's output law is p, for point masses and for tokens drawn from their q."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    q1 = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    params = SamplingParams(temperature=1.0)
    logits = torch.log(p)
    drafts = torch.Generator().manual_seed(1)
    for kinds in ([1, 3], [q1, 4, q1]):   # an int: a point mass there; a tensor: a fresh draw from it
        law, gen = torch.zeros(5), torch.Generator().manual_seed(0)
        draws = 20_000
        for _ in range(draws):
            candidates = [(k, None) if isinstance(k, int) else (int(torch.multinomial(k, 1, generator=drafts)), k)
                          for k in kinds]
            index, token = verify_multi(candidates, logits, params, gen)
            law[token] += 1
            assert index is None or candidates[index][0] == token
        assert torch.allclose(law / draws, probs(logits, params), atol=0.015), law / draws


def draw_tree(target, pdm, count, width=3):
    return count_draws(lambda i: tuple(generate(target, HybridDrafter(pdm), PROMPT + [1, 5], split_layers(2, 2),
                                                SamplingParams(**PARAMS, seed=i), max_new_tokens=LENGTH,
                                                eos_token_ids=(), tree=TreeConfig(width)).tokens), count)


def test_tree_sampling_matches_target_distribution(setup):  # noqa: F811
    model, target, pdm = setup
    table = exact_distribution(model, SamplingParams(**PARAMS), PROMPT + [1, 5])
    total = 6_000
    pvalue, impossible = chi_square_p(draw_tree(target, pdm, total), table, total)
    assert impossible == 0
    assert pvalue > 1e-3, f"tree SPD's samples do not follow the target's distribution (p={pvalue:.2e})"


def test_the_tree_chi_square_fails_without_residuals(setup, monkeypatch):  # noqa: F811
    """A broken multi-draft rule: each candidate accepted with p(x) of the untouched p."""
    model, target, pdm = setup
    params = SamplingParams(**PARAMS)
    table = exact_distribution(model, params, PROMPT + [1, 5])

    def broken(candidates, logits, params, gen):
        p = probs(logits, params)
        for i, (x, _) in enumerate(candidates):
            if float(torch.rand((), generator=gen)) < float(p[x]):
                return i, x
        return None, int(torch.multinomial(p, 1, generator=gen))

    monkeypatch.setattr(spd.tree, "verify_multi", broken)
    total = 3_000
    pvalue, impossible = chi_square_p(draw_tree(target, pdm, total), table, total)
    assert pvalue < 1e-3 or impossible > 0
