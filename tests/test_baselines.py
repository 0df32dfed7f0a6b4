"""EAGLE-style chain drafting and PPSD are lossless (greedy == AR) and draft what they should."""

import pytest
import torch

import spd.baselines.eagle as eagle
from conftest import tiny_model
from spd.baselines.ar import ar_generate
from spd.baselines.eagle import EagleHead, default_feature_layers, eagle_generate
from spd.baselines.heads import HeadCheckpointError, save_head
from spd.baselines.load import load_head
from spd.baselines.ppsd import PPSDDrafter, PPSDHead
from spd.engine import generate
from spd.target import Target, attention_mask, split_layers

PROMPTS = [[3, 17, 5, 9, 22], [1], [40, 2, 2, 2, 2, 2, 2, 7, 11, 60]]
NEW = 20


def small_vocab_target(family, seed):
    # a 6-token vocabulary makes random heads right often enough to mix accepts and rejects
    return Target.from_hf(tiny_model(family, num_layers=6, vocab=6, seed=seed))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_eagle_greedy_equals_ar(family):
    for vocab, seed in ((64, 3), (6, 4)):
        target = Target.from_hf(tiny_model(family, num_layers=6, vocab=vocab, seed=seed))
        head = EagleHead.create(target, seed=1).eval()
        mixed = 0
        for prompt in PROMPTS:
            prompt = [t % vocab for t in prompt]
            reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
            for k in (1, 3, 5):
                tokens, s = eagle_generate(target, head, prompt, k, max_new_tokens=NEW, eos_token_ids=())
                assert tokens == reference, (family, vocab, k, prompt)
                assert s.new_tokens == NEW and s.rounds >= (NEW - 1) / (k + 1)
                assert s.new_tokens - 1 == s.rounds + s.accepted   # each round: accepted + 1 own
                assert s.accepted == sum(s.accepted_by_position) and s.verified == sum(s.verified_by_position)
                mixed += 0 < s.accepted < s.verified
        assert vocab == 64 or mixed >= 1


def test_eagle_eos_and_budgets():
    target = small_vocab_target("llama", 5)
    head = EagleHead.create(target, seed=2).eval()
    prompt = [1, 2, 3]
    reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
    eos = reference[5]
    cut = reference[: reference.index(eos) + 1]
    for k in (2, 4):
        assert eagle_generate(target, head, prompt, k, max_new_tokens=NEW, eos_token_ids=[eos])[0] == cut
        for budget in range(1, k + 3):
            tokens, stats = eagle_generate(target, head, prompt, k, max_new_tokens=budget, eos_token_ids=())
            assert tokens == reference[:budget] and stats.new_tokens == budget


def test_eagle_draft_cache_matches_recompute(monkeypatch):
    """Each round's drafts equal a from-scratch (no cache) run of the head on true features."""
    target = small_vocab_target("qwen2", 6)
    head = EagleHead.create(target, seed=3).eval()
    real = eagle.draft_chain
    checked = []

    def checking(head, cache, tokens, features, c, k, params, gen, follow=None):
        drafts, qs = real(head, cache, tokens, features, c, k, params, gen, follow)
        positions = torch.arange(c)
        out = head(torch.tensor(tokens[1:c + 1])[None], head.fused(features[:c])[None], positions,
                   attention_mask(positions, c, features.dtype))
        expect = []
        for j in range(k):  # chain: the head's own output a feeds the next row
            expect.append(int(head.logits(out[0, -1]).argmax()))
            next_ids = torch.tensor(tokens[1:c + 1] + expect)[None]
            feature = torch.cat([head.fused(features[:c]), out[0, c - 1:]], 0)[None]
            pos = torch.arange(c + j + 1)
            out = head(next_ids, feature, pos, attention_mask(pos, c + j + 1, features.dtype))
        assert drafts == expect
        checked.append(c)
        return drafts, qs

    monkeypatch.setattr(eagle, "draft_chain", checking)
    eagle_generate(target, head, [4, 1, 0, 3], 3, max_new_tokens=16, eos_token_ids=())
    assert len(checked) > 3


def test_eagle_oracle_head_accepts_everything(monkeypatch):
    """A head that always drafts the target's continuation: every draft accepted, k+1 per round."""
    target = small_vocab_target("llama", 7)
    prompt = [2, 0, 5]
    reference, _ = ar_generate(target, prompt, max_new_tokens=25, eos_token_ids=())
    head = EagleHead.create(target).eval()

    def oracle(head, cache, tokens, features, c, k, params, gen, follow=None):
        index = c - len(prompt) + 1
        return reference[index:index + k], [None] * k

    monkeypatch.setattr(eagle, "draft_chain", oracle)
    tokens, s = eagle_generate(target, head, prompt, 4, max_new_tokens=25, eos_token_ids=())
    assert tokens == reference
    # 24 tokens after prefill: 4 rounds of 4 drafts + bonus, then 3 drafts + bonus (budget)
    assert s.rounds == 5 and s.accepted == s.verified == 19
    assert s.mean_accepted_length == pytest.approx(24 / 5)


def test_default_feature_layers():
    assert default_feature_layers(30) == [2, 15, 27]
    assert default_feature_layers(4) == [1, 2]
    assert default_feature_layers(2) == [1, 2]


@pytest.mark.parametrize("family, n", [("llama", 2), ("qwen3", 3), ("mistral", 1), ("qwen2", 6)])
def test_ppsd_greedy_equals_ar(family, n):
    target = small_vocab_target(family, n)
    stages = split_layers(6, n)
    mixed = 0
    for init in (True, False):
        head = PPSDHead.create(target, [len(s) for s in stages], init_from_target=init, seed=2).eval()
        for prompt in PROMPTS:
            prompt = [t % 6 for t in prompt]
            reference, _ = ar_generate(target, prompt, max_new_tokens=NEW, eos_token_ids=())
            result = generate(target, PPSDDrafter(head), prompt, stages, max_new_tokens=NEW, eos_token_ids=())
            assert result.tokens == reference, (family, n, init, prompt)
            s = result.stats
            assert s.accepted + s.rejected == NEW - 1 == sum(s.verified_by_fill)
            assert s.accepted == sum(s.accepted_by_fill)
            mixed += s.accepted > 0 and s.rejected > 0
    assert n == 1 or mixed >= 1


def test_ppsd_draft_matches_recompute():
    """The head's cached drafts equal a full no-cache forward over h_s of positions 0..newest."""
    target = small_vocab_target("llama", 8)
    stages = split_layers(6, 3)
    head = PPSDHead.create(target, [2, 2, 2], init_from_target=False, seed=5).eval()
    checks = []

    class Checking(PPSDDrafter):
        def draft(self, state, params, gen):
            token, q = super().draft(state, params, gen)
            rows = state.features[:state.newest + 1, 0][None]
            pos = torch.arange(state.newest + 1)
            full = head(rows, pos, attention_mask(pos, len(pos), rows.dtype))
            assert token == int(head.lm_head(full[0, -1]).argmax())
            checks.append(state.newest)
            return token, q

    result = generate(target, Checking(head), [3, 1, 4], stages, max_new_tokens=20, eos_token_ids=())
    assert result.stats.rejected > 0 and len(checks) == result.stats.cycles


def test_untrained_ppsd_head_is_the_targets_early_exit():
    """Initialised from target layer s, the head's logits are the target's after s+1 layers."""
    model = tiny_model("llama", num_layers=4, seed=9)
    target = Target.from_hf(model)
    head = PPSDHead.create(target, [2, 2]).eval()
    ids = torch.tensor([[5, 9, 2, 33]])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        pos = torch.arange(4)
        ours = head.lm_head(head(hs[2], pos, attention_mask(pos, 4, hs[2].dtype)))
        theirs = model.lm_head(model.model.norm(hs[3]))
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_head_checkpoint_round_trip_and_mismatch(tmp_path):
    target = Target.from_hf(tiny_model("llama", num_layers=4))
    draft_ids = list(range(0, 64, 2))
    for head in (EagleHead.create(target, draft_ids=draft_ids, seed=4),
                 PPSDHead.create(target, [1, 3], num_layers=2, draft_ids=draft_ids)):
        folder = save_head(head, tmp_path / head.METHOD)
        loaded = load_head(folder, target, head.METHOD)
        assert type(loaded) is type(head) and loaded.config == head.config
        for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
            assert torch.equal(a, b), name
    # shipped form: bf16, and the frozen lm_head rows left to the target
    head = PPSDHead.create(target, [1, 3], draft_ids=draft_ids)
    folder = save_head(head, tmp_path / "slim", dtype=torch.bfloat16, target=target)
    loaded = load_head(folder, target, "ppsd")
    assert torch.equal(loaded.lm_head.proj.weight, head.lm_head.proj.weight)   # restored exactly
    assert torch.equal(loaded.layers[0].mlp.up_proj.weight, head.layers[0].mlp.up_proj.weight.bfloat16().float())
    with torch.no_grad():
        head.lm_head.proj.weight[0, 0] += 1.0   # trained rows are kept
    save_head(head, tmp_path / "trained", target=target)
    assert torch.equal(load_head(tmp_path / "trained", target).lm_head.proj.weight, head.lm_head.proj.weight)
    assert (tmp_path / "trained" / "head.safetensors").stat().st_size > (folder / "head.safetensors").stat().st_size
    with pytest.raises(HeadCheckpointError, match="'ppsd' head"):
        load_head(tmp_path / "eagle", target, "ppsd")
    other = Target.from_hf(tiny_model("llama", num_layers=6))
    with pytest.raises(HeadCheckpointError, match="num_layers=4"):
        load_head(tmp_path / "eagle", other)
