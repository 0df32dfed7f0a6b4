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
