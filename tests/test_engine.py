"""Greedy SPD == AR == transformers generate(), across families, stage counts and drafters."""

import pytest
import torch

from conftest import tiny_model
from spd.baselines.ar import ar_generate
from spd.drafters import AdversarialDrafter, OracleDrafter, PDMDrafter
from spd.engine import generate, stream
from spd.pdm import PDM
from spd.target import Target, split_layers

PROMPTS = [[3, 17, 5, 9, 22], [1], [40, 2, 2, 2, 2, 2, 2, 2, 2, 7, 11, 60]]
NEW = 24


def hf_greedy(model, prompt, new=NEW):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def drafters(target, stage_layers, reference):
    pdm = PDM.create(target, stage_layers, num_layers=2, seed=1).eval()
    return {"pdm": PDMDrafter(pdm), "oracle": OracleDrafter(reference),
            "adversarial": AdversarialDrafter(reference, target.vocab_size)}


SPLITS = {  # 6-layer targets: n in {1, 2, 3, 4, L} plus uneven splits
    "n1": None, "n2": None, "n3": None, "n4": [2, 2, 1, 1], "nL": None, "uneven": [3, 1, 2],
}
N_OF = {"n1": 1, "n2": 2, "n3": 3, "n4": 4, "nL": 6, "uneven": 3}


# The schedule (every split, every drafter, cycle counts) is the same for every family: llama runs by
# default; the other families' greedy equality at n = 2, 3, 4 is test_families.py's (every family).
SLOW_FAMILY = pytest.mark.slow


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=SLOW_FAMILY),
                                    pytest.param("qwen3", marks=SLOW_FAMILY), pytest.param("mistral", marks=SLOW_FAMILY)])
def test_greedy_spd_equals_ar_equals_generate(family):
    model = tiny_model(family, num_layers=6, seed=3)
    target = Target.from_hf(model)
    for prompt in PROMPTS:
        reference = hf_greedy(model, prompt)
        ar, ar_stats = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
        assert ar == reference
        assert ar_stats.forwards == NEW - 1
        for name, counts in SPLITS.items():
            stages = split_layers(6, N_OF[name], counts)
            n = len(stages)
            for kind, drafter in drafters(target, [len(s) for s in stages], reference).items():
                result = generate(target, drafter, prompt, stages, max_new_tokens=NEW, eos_token_ids=())
                assert result.tokens == reference, (family, name, kind, prompt)
                s = result.stats
                assert s.new_tokens == NEW and s.accepted + s.rejected == NEW - 1
                if kind == "oracle":  # pipeline fills once (n-1 cycles), then one token per cycle
                    assert (s.cycles, s.rejected) == (NEW + n - 2, 0)
                    assert s.equivalent_accept_length == pytest.approx(n * NEW / (NEW + n - 2))
                if kind == "adversarial":  # every draft rejected: n cycles per token
                    assert (s.cycles, s.accepted) == (n * (NEW - 1), 0)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_eos_mid_pipeline_and_short_budgets(n):
    model = tiny_model("llama", num_layers=4, seed=5)
    target = Target.from_hf(model)
    prompt = PROMPTS[0]
    reference = hf_greedy(model, prompt)
    eos = reference[6]
    cut = reference[: reference.index(eos) + 1]
    stages = split_layers(4, n)
    for drafter in drafters(target, [len(s) for s in stages], reference).values():
        # EOS reached while n-1 later drafts are still in flight: decoding stops right there
        result = generate(target, drafter, prompt, stages, max_new_tokens=NEW, eos_token_ids=[eos])
        assert result.tokens == cut
        ar, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=[eos])
        assert ar == cut
        for budget in range(1, n + 1):  # max_new_tokens < n: stops before the pipeline fills
            short = generate(target, drafter, prompt, stages, max_new_tokens=budget, eos_token_ids=())
            assert short.tokens == reference[:budget]
    first_eos = generate(target, OracleDrafter(reference), prompt, stages, max_new_tokens=NEW,
                         eos_token_ids=[reference[0]])
    assert first_eos.tokens == reference[:1] and first_eos.stats.cycles == 0


def test_stream_yields_tokens_as_they_are_verified():
    target = Target.from_hf(tiny_model("qwen2", num_layers=4))
    prompt = PROMPTS[0]
    reference, _ = ar_generate(target, prompt, max_new_tokens=10, eos_token_ids=())
    gen = stream(target, OracleDrafter(reference), prompt, split_layers(4, 2), max_new_tokens=10)
    assert next(gen) == reference[0]
    assert list(gen) == reference[1:]
    seen = []
    generate(target, OracleDrafter(reference), prompt, split_layers(4, 2), max_new_tokens=10,
             eos_token_ids=(), on_token=seen.append)
    assert seen == reference


def test_pdm_draft_vocab_maps_back_to_full_ids():
    target = Target.from_hf(tiny_model("llama", num_layers=4))
    prompt = PROMPTS[0]
    reference, _ = ar_generate(target, prompt, max_new_tokens=16, eos_token_ids=())
    draft_ids = sorted(set(reference) | {0, 1, 2})
    pdm = PDM.create(target, [2, 2], draft_ids=draft_ids).eval()
    drafted = []

    class Spy(PDMDrafter):
        def draft(self, state, params, gen):
            token, q = super().draft(state, params, gen)
            drafted.append(token)
            return token, q

    result = generate(target, Spy(pdm), prompt, split_layers(4, 2), max_new_tokens=16, eos_token_ids=())
    assert result.tokens == reference
    assert drafted and set(drafted) <= set(draft_ids)
