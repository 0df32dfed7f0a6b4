"""Head training: it learns (loss falls, agreement rises), the unrolled EAGLE steps see what chain
drafting sees at inference, and a trained head decodes losslessly from its checkpoint."""

import json

import pytest
import torch

from conftest import tiny_model
from spd.baselines.ar import ar_generate
from spd.baselines.eagle import EagleHead, eagle_generate
from spd.baselines.load import load_head
from spd.baselines.ppsd import PPSDDrafter
from spd.baselines.train_heads import train_head, unroll
from spd.cache import KVCache
from spd.engine import generate
from spd.target import Target, attention_mask, split_layers
from spd.train.loop import TrainConfig, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads")
    model = tiny_model("llama", num_layers=4, vocab=32, seed=4)
    target = Target.from_hf(model)
    gen = torch.Generator().manual_seed(0)
    with open(folder / "data.jsonl", "w") as fh:   # the target's own greedy text: learnable
        for _ in range(48):
            prompt = torch.randint(0, 32, (3,), generator=gen).tolist()
            tokens, _ = ar_generate(target, prompt, max_new_tokens=29, eos_token_ids=())
            fh.write(json.dumps({"input_ids": prompt + tokens}) + "\n")
    return folder, target


def config(folder, name, **kw):
    base = dict(model="unused", data=(str(folder / "data.jsonl"),), out=str(folder / name), stages=2,
                max_steps=40, lr=3e-3, batch_tokens=256, max_len=64, eval_fraction=0.1, log_every=5,
                warmup_steps=2, progress=False, cache=str(folder / f"cache-{name}"))
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("method", ["ppsd", "eagle"])
def test_head_training_learns_and_decodes_losslessly(setup, method):
    folder, target = setup
    kw = {"init_from": "none"} if method == "ppsd" else {}
    summary = train_head(config(folder, method, **kw), method, target, None, ttt_steps=2)
    log = [json.loads(line) for line in (folder / method / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]
    assert summary.eval["agreement_full"] > 0.3 and summary.step == 40
    if method == "eagle":
        assert len(summary.eval["agreement_by_step"]) == 2
    head = load_head(folder / method, target, method)
    prompt = [5, 1, 9]
    reference, _ = ar_generate(target, prompt, max_new_tokens=24, eos_token_ids=())
    if method == "eagle":
        tokens, stats = eagle_generate(target, head, prompt, 3, max_new_tokens=24, eos_token_ids=())
        accepted = stats.per_draft_acceptance
    else:
        result = generate(target, PPSDDrafter(head), prompt, split_layers(4, 2), max_new_tokens=24, eos_token_ids=())
        tokens, accepted = result.tokens, result.stats.per_draft_acceptance
    assert tokens == reference
    assert accepted > 0.3   # trained on the target's own text: drafts are mostly right


def test_head_training_resumes_exactly(setup):
    """20 steps, a stop, --resume for the rest == 40 steps straight (same batches, same weights)."""
    folder, target = setup
    straight = train_head(config(folder, "eagle-straight"), "eagle", target, None)
    paused = config(folder, "eagle-paused", stop_after=20)
    assert train_head(paused, "eagle", target, None).step == 20
    with pytest.raises(FileExistsError, match="--resume"):
        train_head(paused, "eagle", target, None)
    with pytest.raises(ValueError, match="trains an eagle head, not ppsd"):
        train_head(config(folder, "eagle-paused", resume=True), "ppsd", target, None)
    with pytest.raises(ValueError, match="trains an eagle head, not a PDM; pass --method eagle"):
        train(config(folder, "eagle-paused", resume=True), target=target)
    with pytest.raises(ValueError, match="ttt_steps=2, now ttt_steps=3"):   # the run would not continue exactly
        train_head(config(folder, "eagle-paused", resume=True), "eagle", target, None, ttt_steps=3)
    resumed = train_head(config(folder, "eagle-paused", resume=True), "eagle", target, None)
    assert resumed.step == straight.step == 40 and resumed.tokens == straight.tokens
    a = load_head(folder / "eagle-straight", target, "eagle").state_dict()
    b = load_head(folder / "eagle-paused", target, "eagle").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)


def test_unrolled_steps_match_chain_drafting_at_inference():
    """Step j of source t in the training layout == the j-th chain row drafting computes after
    true rows 0..t (teacher-forced ids), for every t and j."""
    target = Target.from_hf(tiny_model("qwen2", num_layers=4, vocab=32, seed=1))
    head = EagleHead.create(target, seed=2).eval()
    S, steps = 9, 3
    ids = torch.randint(0, 32, (1, S), generator=torch.Generator().manual_seed(3))
    g = torch.randn(1, S - 1, target.hidden_size)
    with torch.no_grad():
        outs = unroll(head, ids, g, steps)
        for t in range(S - 1):
            cache = KVCache([0])
            pos = torch.arange(t + 1)
            out = head(ids[:, 1:t + 2], g[:, :t + 1], pos, attention_mask(pos, t + 1, g.dtype), cache)
            assert torch.allclose(out[0, t], outs[0][0, t], atol=1e-5)
            for j in range(2, steps + 1):
                if t + j >= S:
                    break
                out = head(ids[:, t + j:t + j + 1], out[:, -1:], torch.tensor([t + j - 1]), None, cache)
                assert torch.allclose(out[0, 0], outs[j - 1][0, t], atol=1e-5), (t, j)
