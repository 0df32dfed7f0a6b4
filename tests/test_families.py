"""Every supported family, tiny random configs: greedy SPD == HF generate, logits == HF's, the
baselines stay exact, training features == inference features, refusals name what differs,
recurrent states roll back, and the distributed runtime loads each family's parts exactly."""

import dataclasses

import pytest
import torch
from transformers import GPT2Config

import spd.families as families
from conftest import FAMILY_CONFIGS, tiny_model
from spd.baselines.eagle import EagleHead, eagle_generate
from spd.baselines.ppsd import PPSDDrafter, PPSDHead
from spd.cache import KVCache
from spd.drafters import AdversarialDrafter, OracleDrafter, PDMDrafter
from spd.engine import generate
from spd.pdm import PDM
from spd.target import Target, UnsupportedModelError, check_supported, split_layers
from spd.train.features import target_pass

ALL = sorted(FAMILY_CONFIGS)
PROMPT = [3, 17, 5, 9, 22]
NEW = 12


def hf_generate(model, prompt=PROMPT, new=NEW):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def test_every_family_in_the_table_has_a_tiny_config():
    assert set(families.FAMILIES) == set(FAMILY_CONFIGS) and len(ALL) >= 20


@pytest.mark.parametrize("family", ALL)
def test_greedy_spd_equals_hf_generate(family):
    """n = 2, 3, L with all-accepted, all-rejected and PDM (mixed) drafts; PPSD and EAGLE too."""
    model = tiny_model(family, num_layers=4, seed=3)
    target = Target.from_hf(model)   # includes the load-time logits check
    reference, _ = hf_generate(model)
    for n in (2, 3, 4):
        stages = split_layers(4, n)
        drafters = {"oracle": OracleDrafter(reference), "adversarial": AdversarialDrafter(reference, 64)}
        if family != "falcon_h1":   # no full-attention layer to build a draft body from
            pdm = PDM.create(target, [len(s) for s in stages], num_layers=1, seed=1).eval()
            drafters["pdm"] = PDMDrafter(pdm)
        for kind, drafter in drafters.items():
            result = generate(target, drafter, PROMPT, stages, max_new_tokens=NEW, eos_token_ids=())
            assert result.tokens == reference, (family, n, kind)
            if kind == "adversarial":
                assert result.stats.accepted == 0 and result.stats.rejected == NEW - 1
    if family == "falcon_h1":
        with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
            PDM.create(target, [2, 2])
        return
    ppsd = PPSDDrafter(PPSDHead.create(target, [2, 2], seed=1).eval())
    assert generate(target, ppsd, PROMPT, split_layers(4, 2), max_new_tokens=NEW, eos_token_ids=()).tokens == reference
    tokens, _ = eagle_generate(target, EagleHead.create(target, seed=1).eval(), PROMPT, 3, max_new_tokens=NEW,
                               eos_token_ids=())
    assert tokens == reference


ROPES = {  # scaled RoPE past the original length: "dynamic" is stateful in transformers
    "dynamic": ("llama", dict(max_position_embeddings=8,
                              rope_parameters={"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0})),
    "longrope": ("phi3", dict(max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
        "original_max_position_embeddings": 8})),
}


@pytest.mark.parametrize("family", ALL + [f"rope:{r}" for r in ROPES])
def test_logits_equal_hf_at_every_verified_position(family):
    """Sampling parity: the logits spd verifies with are transformers' own, step for step."""
    family, overrides = ROPES[family[5:]] if family.startswith("rope:") else (family, {})
    model = tiny_model(family, num_layers=4, seed=3, **overrides)
    reference, hf_logits = hf_generate(model, new=16)
    target = Target.from_hf(tiny_model(family, num_layers=4, seed=3, **overrides))
    seen = []
    logits = target.logits
    target.logits = lambda hidden: seen.append(logits(hidden)) or seen[-1]
    for drafter in (OracleDrafter(reference), AdversarialDrafter(reference, 64)):
        seen.clear()
        result = generate(target, drafter, PROMPT, split_layers(4, 4), max_new_tokens=16, eos_token_ids=())
        assert result.tokens == reference
        ours = torch.stack([s.reshape(-1) for s in seen])
        if isinstance(drafter, OracleDrafter):   # one verification per position, in order
            torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=1e-4)


def test_stateful_dynamic_rope_would_diverge():
    """The position-pure rotary is what makes the dynamic case exact: transformers' stateful
    module, driven newest-token-first, gives other logits."""
    family, overrides = ROPES["dynamic"]
    reference, hf_logits = hf_generate(tiny_model(family, num_layers=4, seed=3, **overrides), new=16)
    target = Target.from_hf(tiny_model(family, num_layers=4, seed=3, **overrides))
    target.rotary_emb.dynamic = False   # the module as transformers ships it
    seen = []
    logits = target.logits
    target.logits = lambda hidden: seen.append(logits(hidden)) or seen[-1]
    generate(target, OracleDrafter(reference), PROMPT, split_layers(4, 4), max_new_tokens=16, eos_token_ids=())
    assert (torch.stack([s.reshape(-1) for s in seen]) - hf_logits).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["granite", "gemma3_text", "qwen3_5_text", "falcon_h1", "lfm2"])
def test_training_features_equal_inference_features(family):
    target = Target.from_hf(tiny_model(family, num_layers=4, seed=3))
    ids = torch.tensor(PROMPT + [1, 2, 3])
    _, prefill = target.prefill(ids, target.new_cache(), record={0, 2, 4})
    batch, last = target_pass(target, ids[None], [0, 2, 4])
    for anchor in (0, 2, 4):
        torch.testing.assert_close(batch[anchor][0], prefill[anchor], atol=1e-5, rtol=1e-5)


def test_refusals_name_what_differs(monkeypatch):
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        check_supported(GPT2Config())
    cases = [("granite", dict(embed_multiplier=None), "embedding output"),
             ("cohere", dict(logit_multiplier=None), "logits differ"),
             ("gemma2", dict(softcap=None), "soft-cap")]
    for family, change, message in cases:
        monkeypatch.setitem(families.FAMILIES, family, dataclasses.replace(families.FAMILIES[family], **change))
        with pytest.raises(UnsupportedModelError, match=message):
            Target.from_hf(tiny_model(family))
    config = tiny_model("qwen3_5_text").config
    config.layer_types = ["linear_attention", "mystery_attention", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="mystery_attention"):
        check_supported(config)


def test_recurrent_state_rolls_back_and_measures():
    """crop(position) restores the state after `position` tokens; only `keep` states are kept."""
    target = Target.from_hf(tiny_model("qwen3_5_text", num_layers=4, seed=3))
    ids = torch.tensor(PROMPT + [1, 2, 3, 4])
    cache = target.new_cache(keep=3)

    def step(p):
        return target.run_layers(target.embed(ids[p:p + 1]), torch.tensor([p]), range(4), cache)[0]

    target.run_layers(target.embed(ids[:5]), torch.arange(5), range(4), cache)
    first = [step(p) for p in range(5, 8)]
    cache.crop(6)   # back to the state after 6 positions: positions 6, 7 run again alike
    assert cache.length(0) == cache.length(3) == 6
    torch.testing.assert_close(torch.cat([step(6), step(7)]), torch.cat(first[1:]), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="cannot go back to position 5"):
        cache.crop(5)   # 3 states kept (after 6, 7, 8 positions): 5 was dropped; nothing changes
    assert cache.length(0) == 8
    cache.crop(0)
    assert cache.length(0) == 0
    # conv (1, 2*2*8 + 4*8, 4) + delta-rule (1, 4, 8, 8) float32 per layer and kept state
    assert cache.state_bytes(0) == 0
    target.run_layers(target.embed(ids[:5]), torch.arange(5), range(4), cache)
    assert cache.state_bytes(0) == (64 * 4 + 4 * 8 * 8) * 4 and cache.state_bytes(3) == 0
    plain = KVCache([0])
    with pytest.raises(KeyError):
        plain.get_conv_state(0)


@pytest.mark.parametrize("family", ALL)
def test_distributed_n2_equals_hf(family, tmp_path):
    """--distributed, n=2 (one process per stage, gloo): each rank loads only its parts through
    transformers' conversion (fused experts) with buffers initialised; tokens == HF generate."""
    from spd.runtime import plan, start

    model = tiny_model(family, num_layers=4, seed=3)
    model.save_pretrained(tmp_path / "model")
    reference, _ = hf_generate(model)
    spec = plan(str(tmp_path / "model"), stages=2, draft_rank="with-first-stage", timeout=30, threads=1)
    # no PDM given: the run drafts by retrieval, so even falcon_h1 (no attention-only layer for a
    # PDM body) runs distributed
    assert spec.drafter == "retrieval" and spec.anchors == ()
    with start(spec) as session:
        for drafter in (OracleDrafter(reference), AdversarialDrafter(reference, 64)):
            result = session.generate(PROMPT, drafter, max_new_tokens=NEW, eos_token_ids=())
            assert result.tokens == reference, (family, type(drafter).__name__)
