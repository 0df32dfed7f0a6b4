"""`spd demo` (SPD next to AR on two prompts) and `spd --version`."""

import json
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from conftest import needs_default_target, tiny_model, tiny_tokenizer
from spd import demo as demo_module
from spd.baselines.ar import ar_generate
from spd.cli import app
from spd.loading import Decoder, encode_prompt
from spd.pdm import PDM
from spd.target import Target, split_layers

runner = CliRunner()


@pytest.fixture
def tiny_demo(monkeypatch):
    """The one-process path on a tiny model: `build_decoder` gives it, the message timing is skipped."""
    tok = tiny_tokenizer()
    target = Target.from_hf(tiny_model("llama", num_layers=4, vocab=len(tok)))
    asked = []

    def tiny_decoder(model, stages=None, split=None, pdm_path=None, **kwargs):
        asked.append((model, stages, pdm_path))
        layers = split_layers(target.num_layers, stages, None)
        return Decoder(target, tok, layers, PDM.create(target, [len(s) for s in layers]).eval())

    monkeypatch.setattr(demo_module, "build_decoder", tiny_decoder)
    monkeypatch.setattr(demo_module, "measure_message_ms", lambda hidden, reps: 0.5)
    return target, tok, asked


def test_demo_one_process_streams_both_prompts_next_to_ar(tiny_demo):
    from spd.shipped import shipped_pdm

    target, tok, asked = tiny_demo
    result = runner.invoke(app, ["demo", "--one-process", "--stages", "4", "--max-new-tokens", "10"])
    assert result.exit_code == 0, result.output
    assert asked == [("default", 4, shipped_pdm("default", 4, None))]  # the shipped n=4 PDM
    answers = [tok.decode(ar_generate(target, encode_prompt(tok, text), max_new_tokens=10)[0],
                          skip_special_tokens=True) for _, text in demo_module.PROMPTS]
    assert result.stdout.split() == " ".join(answers).split()   # both answers streamed, AR's tokens
    for label in ("[open question] > Explain", "[rework text] > Fix the spelling", "one process on",
                  "SPD, one process", "AR, 1 thread tok/s", "SPD / AR one thread", "drafts from pdm",
                  "cost model: 4 devices like 1 core here", "When SPD pays"):
        assert label in result.stderr, label
    assert [line.split()[-2:] for line in result.stderr.splitlines() if "tokens identical to AR" in line] == \
        [["yes", "yes"]]


def test_demo_falls_back_to_one_process_with_fewer_cores_than_stages(tiny_demo, monkeypatch):
    monkeypatch.setattr(demo_module, "usable_cores", lambda: 1)
    result = runner.invoke(app, ["demo", "--stages", "2", "--max-new-tokens", "6", "--json", "--prompt", "hi there"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["mode"] == "one process" and report["spd_processes"] == 1
    assert report["fallback"].startswith("1 core(s) for 2 stages")
    [run] = report["prompts"]
    assert run["label"] == "your prompt" and run["prompt"] == "hi there" and run["identical"] is True
    assert run["spd_processes"] == 1
    assert set(run["ar_tokens_per_second"]) == {"all_cores", "one_thread"}


def test_demo_identical_compares_the_tokens(tiny_demo, monkeypatch):
    """A differing AR continuation is reported as such, and the demo exits 1."""
    def wrong_ar(target, ids, params=None, max_new_tokens=128, eos_token_ids=None):
        tokens, stats = ar_generate(target, ids, max_new_tokens=max_new_tokens)
        return tokens[:-1] + [(tokens[-1] + 1) % target.vocab_size], stats

    monkeypatch.setattr(demo_module, "ar_generate", wrong_ar)
    result = runner.invoke(app, ["demo", "--one-process", "--max-new-tokens", "6", "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["identical"] is False and [r["identical"] for r in report["prompts"]] == [False, False]


@needs_default_target
@pytest.mark.skipif(demo_module.usable_cores() < 2, reason="one process per stage needs 2 cores")
def test_demo_json_one_process_per_stage_on_the_default_target(default_model_dir, default_target, default_ar,
                                                               monkeypatch):
    monkeypatch.setenv("SPD_CACHE_DIR", str(default_model_dir.parent))
    result = runner.invoke(app, ["demo", "--json", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)   # one object
    assert report["mode"] == "one process per stage" and report["spd_processes"] == 2 and report["fallback"] is None
    assert report["split"] == [15, 15] and report["identical"] is True
    _, tok = default_target
    for run, (label, text) in zip(report["prompts"], demo_module.PROMPTS, strict=True):
        assert run["label"] == label and run["identical"] is True and run["spd_processes"] == 2
        assert run["text"] == tok.decode(default_ar(encode_prompt(tok, text), 6), skip_special_tokens=True)
        assert run["spd_tokens_per_second"] > 0 and min(run["ar_tokens_per_second"].values()) > 0
        assert report["plan"]["predicted_vs_ar_one_device"][label] > 0


def test_version_prints_the_installed_package_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"spd {version('spd')}"
