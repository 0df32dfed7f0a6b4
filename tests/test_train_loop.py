"""The training loop end to end: overfitting one sequence, exact resume, errors, the CLI."""

import json
import os
import signal
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_model, tiny_target, tiny_tokenizer
from spd import engine
from spd.baselines.ar import ar_generate
from spd.checkpoint import load_pdm
from spd.cli import app
from spd.drafters import PDMDrafter
from spd.sampling import SamplingParams
from spd.target import split_layers
from spd.train import TrainConfig, pdm_layout, structural_mask, train
from spd.train.features import target_pass
from spd.train.loop import evaluate_checkpoint
from spd.train.objective import DraftForward
from spd.train.session import StopSignal
from spd.vocab import count_tokens, save_vocab, top_ids
from test_train_data import CHAT

PROMPT = [3, 17, 5, 9]


def greedy_sequence(target, new_tokens=60):
    continuation, _ = ar_generate(target, PROMPT, SamplingParams(), new_tokens, ())
    return PROMPT + continuation


def write_ids(path, seqs):
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return path


def agreement_by_fill(target, pdm, seq):
    """Training-forward top-1 agreement with the target on `seq`, for each fill 1..n."""
    layout, n = pdm_layout(pdm), pdm.config.n_stages
    snaps, last = target_pass(target, torch.tensor([seq]), pdm.anchors)
    features = torch.stack([snaps[a] for a in pdm.anchors], dim=2)
    rows = slice(len(PROMPT) - 1, len(seq) - 1)  # the rows that predict generated tokens
    want = target.logits(last[0]).argmax(-1)[rows]
    out = {}
    with torch.no_grad():
        for f in range(1, n + 1):
            mask = structural_mask(layout, len(seq), torch.full((len(seq),), f))
            got = pdm.draft_ids[DraftForward(pdm, layout, target)(features, mask).argmax(-1)][rows]
            out[f] = float((got == want).float().mean())
    return out


@pytest.mark.parametrize("n,split,vocab", [(2, None, False), (3, (1, 2, 1), True)])
def test_overfit_one_sequence_then_the_engine_accepts_its_drafts(tmp_path, n, split, vocab):
    target = tiny_target(num_layers=4)
    with torch.no_grad():  # sharper still: a random target's near-ties would make top-1 a coin flip
        target.lm_head.weight.mul_(4.0)
    seq = greedy_sequence(target)
    draft_vocab = None
    if vocab:  # the sequence's tokens plus some others: 40 of the 64 ids
        counts = count_tokens([(seq, [1] * len(seq))], target.vocab_size) + 1
        draft_vocab = str(save_vocab(tmp_path / "vocab.json", top_ids(counts, 40), counts))
    data = tmp_path / "one.jsonl"  # the generated tokens are scored (the prompt is never drafted)
    data.write_text(json.dumps({"input_ids": seq, "loss_mask": [t >= len(PROMPT) for t in range(len(seq))]}))
    cfg = TrainConfig(model="tiny", data=(str(data),), out=str(tmp_path / "pdm"), stages=n, split=split,
                      draft_vocab=draft_vocab, max_steps=300, lr=3e-3, eval_fraction=0, batch_tokens=128,
                      progress=False, log_every=50)
    summary = train(cfg, target=target)
    assert summary.step == 300 and summary.train_agreement >= 0.95
    pdm = load_pdm(tmp_path / "pdm", target)
    assert pdm.config.draft_vocab_size == (40 if vocab else None)
    assert min(agreement_by_fill(target, pdm, seq).values()) >= 0.95
    stages = split_layers(target.num_layers, n, list(split) if split else None)
    out = engine.generate(target, PDMDrafter(pdm), PROMPT, stages, SamplingParams(), len(seq) - len(PROMPT), ())
    assert out.tokens == seq[len(PROMPT):]
    assert out.stats.per_draft_acceptance >= 0.9, out.stats


def resume_config(tmp_path, out, **kw):
    target = tiny_target(num_layers=4, seed=1)
    seqs = [greedy_sequence(tiny_target(num_layers=4, seed=1), k)[: 6 + k] for k in range(4, 20, 3)]
    data = tmp_path / "data.jsonl"
    if not data.exists():  # written once: the token store is keyed by the file's mtime
        write_ids(data, seqs + [s[::-1] for s in seqs])
    cfg = TrainConfig(model="tiny", data=(str(data),), out=str(tmp_path / out), stages=3, max_steps=100,
                      grad_accum=2, batch_tokens=48, max_len=24, eval_fraction=0.2, eval_every=20,
                      save_every=30, lr=2e-3, progress=False, **kw)
    return cfg, target


def test_resume_continues_exactly(tmp_path):
    cfg, target = resume_config(tmp_path, "straight")
    straight = train(cfg, target=target)
    assert straight.step == 100 and straight.eval["tokens"] > 0
    cfg, target = resume_config(tmp_path, "paused", stop_after=50)
    assert train(cfg, target=target).step == 50
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg, target=target)
    with pytest.raises(ValueError, match="stages=3, now stages=2"):
        train(TrainConfig(**{**cfg.__dict__, "resume": True, "stages": 2}), target=target)
    cfg, target = resume_config(tmp_path, "paused", resume=True)
    resumed = train(cfg, target=target)
    assert resumed.step == 100
    assert resumed.tokens == straight.tokens  # the summary counts both parts of the run
    a, b = load_file(str(tmp_path / "straight/pdm.safetensors")), load_file(str(tmp_path / "paused/pdm.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)
    assert json.loads((tmp_path / "paused/pdm_config.json").read_text())["extra"]["training"]["step"] == 100
    # the held-out figures of a finished PDM, measured again from its folder alone (the split, anchors
    # and body come from the checkpoint, not from the config's stages=2)
    cfg, target = resume_config(tmp_path, "scratch")
    again = evaluate_checkpoint(replace(cfg, stages=2), tmp_path / "straight", target=target)
    assert again["tokens"] == straight.eval["tokens"]
    for key in ("loss", "agreement_full", "agreement_partial"):
        assert again[key] == pytest.approx(straight.eval[key], abs=1e-5), key
    written = {p.relative_to(tmp_path / "scratch").parts[0] for p in (tmp_path / "scratch").rglob("*")}
    assert written == {"cache"}  # scoring writes only the feature cache it was not given


def test_evaluate_checkpoint_with_draft_vocabulary(tmp_path):
    """A PDM with a draft vocabulary is scored on its own ids (they travel in the checkpoint)."""
    cfg, target = resume_config(tmp_path, "with-vocab")
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"ids": list(range(0, target.vocab_size, 2)), "vocab_size": target.vocab_size}))
    trained = train(replace(cfg, draft_vocab=str(vocab), max_steps=20), target=target)
    cfg, target = resume_config(tmp_path, "scratch")
    again = evaluate_checkpoint(cfg, tmp_path / "with-vocab", target=target)
    assert again["tokens"] == trained.eval["tokens"]
    for key in ("loss", "agreement_full", "agreement_partial"):
        assert again[key] == pytest.approx(trained.eval[key], abs=1e-5), key


def test_config_errors(tmp_path):
    target = tiny_target(num_layers=4)
    data = str(write_ids(tmp_path / "d.jsonl", [[1, 2, 3]]))
    base = dict(model="tiny", data=(data,), out=str(tmp_path / "o"), progress=False, max_steps=1)
    with pytest.raises(ValueError, match="at least 2"):
        train(TrainConfig(**base, max_len=1), target=target)
    with pytest.raises(FileNotFoundError, match="holds no training state"):
        train(TrainConfig(**base, resume=True), target=target)
    with pytest.raises(ValueError, match="5 stages but the model has only 4 layers"):
        train(TrainConfig(**base, stages=5), target=target)


def test_stop_signal_is_caught_and_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


# ----- the CLI ------------------------------------------------------------------------------

runner = CliRunner()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat")
    tok = tiny_tokenizer()
    tiny_model("llama", num_layers=4, vocab=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def cli(*args):
    result = runner.invoke(app, [*map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def test_cli_vocab_train_generate(chat_model, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(6)))
    code, out, err = cli("vocab", "--model", chat_model, "--data", data, "--out", tmp_path / "v.json", "--size", 8, "--json")
    assert code == 0, err
    assert json.loads(out)["size"] == 8 and json.loads(out)["coverage"] == 1.0
    code, _, err = cli("train", "--model", chat_model, "--data", data, "--out", tmp_path / "pdm", "--stages", 2,
                       "--draft-vocab", tmp_path / "v.json", "--max-steps", 4, "--eval-fraction", 0.2,
                       "--stop-after", 2, "--no-progress", "--threads", 1)
    assert code == 0, err
    assert "done: step 2/4" in err and "continue with --resume" in err
    code, _, err = cli("train", "--out", tmp_path / "pdm", "--resume", "--no-progress")  # saved settings
    assert code == 0, err
    assert "done: step 4/4" in err and "agreement" in err
    code, _, err = cli("train", "--out", tmp_path / "pdm", "--resume", "--stages", 3, "--no-progress")
    assert code == 2 and "stages=2, now stages=3" in err
    code, out, err = cli("generate", "--model", chat_model, "--pdm", tmp_path / "pdm", "--prompt-ids", "1,5,9",
                         "--max-new-tokens", 6, "--compare-ar")
    assert code == 0, err
    assert "tokens identical" in err


def test_cli_eagle_head_on_chosen_feature_layers(chat_model, tmp_path):
    """--feature-layers picks the hidden states an EAGLE-style head fuses (e.g. those a shared
    cache holds); the head's config keeps them and --resume keeps the run's."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(6)))
    common = ("--eval-fraction", 0.2, "--no-progress", "--threads", 1)
    code, _, err = cli("train", "--method", "eagle", "--model", chat_model, "--data", data, "--out", tmp_path / "eagle",
                       "--feature-layers", "1,3", "--max-steps", 4, "--stop-after", 2, *common)
    assert code == 0, err
    assert json.loads((tmp_path / "eagle/head_config.json").read_text())["config"]["feature_layers"] == [1, 3]
    code, _, err = cli("train", "--out", tmp_path / "eagle", "--resume", "--feature-layers", "2,4", "--no-progress")
    assert code == 2 and "feature_layers=[1, 3], now feature_layers=[2, 4]" in err, err


@pytest.mark.parametrize("args, message", [
    (["--data", "MISSING.jsonl"], "does not exist"),
    (["--max-len", "1"], "at least 2"),
    (["--data", "EMPTY"], "no sequence with a scored token"),
    (["--data", "CHAT", "--model", "NOTEMPLATE"], "chat template"),
    (["--anchors", "0,x"], "comma-separated integers"),
    (["--draft-vocab", "nope.json"], "spd vocab"),
    (["--model", ""], "--model required"),
    (["--feature-layers", "1,2"], "--feature-layers is for --method eagle"),
    (["--method", "eagle", "--feature-layers", "1,9"], "must be layer-output hidden-state indices in [1, 4]"),
])
def test_cli_errors(chat_model, tmp_path, args, message):
    empty, chat = tmp_path / "empty.jsonl", tmp_path / "chat.jsonl"
    empty.write_text(json.dumps({"input_ids": [1]}) + "\n")
    chat.write_text(json.dumps({"messages": CHAT}) + "\n")
    plain = tmp_path / "plain"
    tiny_model("llama", num_layers=2, vocab=40).save_pretrained(plain)
    tiny_tokenizer(chat_template=None).save_pretrained(plain)
    names = {"EMPTY": empty, "CHAT": chat, "NOTEMPLATE": plain}
    args = [str(names.get(a, a)) for a in args]
    base = {"--model": str(chat_model), "--data": str(chat), "--out": str(tmp_path / "o")}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    code, _, err = cli("train", *[x for kv in base.items() for x in kv], "--max-steps", 1, "--no-progress")
    assert code == 2 and message in err, err
