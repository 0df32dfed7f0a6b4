"""scripts/make_chat_data.py with a tiny random chat model: a crashed run resumed writes the
same file as an uninterrupted one, and the resume guards refuse what would break that."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from test_default_target import EVAL
from test_train_data import tiny_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_chat_data.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_chat_data", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A word-level chat tokenizer with no pad token and a random model that samples uniformly
    (zeroed head), so some questions end with <|im_end|> and pass the filters."""
    folder = tmp_path_factory.mktemp("chat_model")
    tok = tiny_tokenizer()
    model = tiny_model("llama", num_layers=2, vocab=len(tok))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    for name, prompts in EVAL.items():
        (root / name).mkdir()
        (root / name / "question.jsonl").write_text(
            "".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    return root


def _args(model, eval_dir, out, n, *extra):
    return ["--model", str(model), "--eval-dir", str(eval_dir), "--output", str(out),
            "--num-conversations", str(n), "--batch-size", "16", "--q-max-new-tokens", "12",
            "--a-max-new-tokens", "12", "--min-words", "2", "--dtype", "float32", "--threads", "1",
            "--seed", "3", *extra]


def test_crashed_run_resumes_to_the_same_file(chat_model, eval_dir, tmp_path, monkeypatch):
    script = _load_script()
    whole = tmp_path / "whole.jsonl"
    assert script.main(_args(chat_model, eval_dir, whole, 6)) == 0
    lines = whole.read_text().splitlines()
    meta = json.loads(whole.with_suffix(".meta.json").read_text())
    assert len(lines) == 6 and meta["progress"]["rounds"] >= 2, meta["progress"]
    assert meta["device"] == "cpu"
    for line in lines:
        user, assistant = json.loads(line)["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant" and user["content"]

    # Crash in the second round after its lines are written but before its progress is:
    # the resume must cut those lines back and redo the round from its own seed.
    crashed = tmp_path / "crashed.jsonl"
    real_write, calls = script._write_meta, []

    def write_then_crash(path, meta):
        calls.append(1)
        if len(calls) == 3:  # 1: start, 2: after round 0, 3: after round 1
            raise KeyboardInterrupt
        real_write(path, meta)

    monkeypatch.setattr(script, "_write_meta", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        script.main(_args(chat_model, eval_dir, crashed, 6))
    monkeypatch.setattr(script, "_write_meta", real_write)
    assert len(crashed.read_text().splitlines()) > json.loads(
        crashed.with_suffix(".meta.json").read_text())["progress"]["lines"]  # the torn round

    with pytest.raises(SystemExit, match="--resume"):
        script.main(_args(chat_model, eval_dir, crashed, 6))
    assert script.main(_args(chat_model, eval_dir, crashed, 6, "--resume")) == 0
    assert crashed.read_text() == whole.read_text()


def test_resume_refuses_other_parameters_or_device(chat_model, eval_dir, tmp_path):
    script = _load_script()
    out = tmp_path / "chat.jsonl"
    assert script.main(_args(chat_model, eval_dir, out, 1)) == 0
    with pytest.raises(SystemExit, match="different data parameters"):
        script.main(_args(chat_model, eval_dir, out, 2, "--resume", "--a-temperature", "0.9"))
    meta_path = out.with_suffix(".meta.json")
    meta = json.loads(meta_path.read_text())
    meta["device"] = "cuda"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="made on 'cuda'"):
        script.main(_args(chat_model, eval_dir, out, 2, "--resume"))
    del meta["device"]  # a file made before --device existed was made on the CPU
    meta_path.write_text(json.dumps(meta))
    assert script.main(_args(chat_model, eval_dir, out, 2, "--resume")) == 0
    assert len(out.read_text().splitlines()) == 2
