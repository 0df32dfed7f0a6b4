"""PDM checkpoints round-trip and refuse the wrong target or split with a clear error."""

import pytest
import torch

from conftest import tiny_target
from spd.checkpoint import CheckpointMismatchError, load_pdm, read_config, save_pdm
from spd.pdm import PDM


def test_save_load_round_trip(tmp_path):
    target = tiny_target("llama", num_layers=4)
    pdm = PDM.create(target, [2, 2], num_layers=2, draft_ids=[1, 3, 5, 7], seed=4)
    save_pdm(pdm, tmp_path / "ckpt")
    loaded = load_pdm(tmp_path / "ckpt", target, [2, 2])
    for (name, a), (_, b) in zip(pdm.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert read_config(tmp_path / "ckpt") == pdm.config
    small = save_pdm(pdm, tmp_path / "bf16", dtype=torch.bfloat16)
    assert load_pdm(small, target).lm_head.weight.dtype == torch.float32  # cast to the target's


def test_mismatched_target_and_split_are_named(tmp_path):
    target = tiny_target("llama", num_layers=4)
    save_pdm(PDM.create(target, [2, 2]), tmp_path)
    with pytest.raises(CheckpointMismatchError, match="hidden_size=32.*hidden_size=48"):
        load_pdm(tmp_path, tiny_target("llama", num_layers=4, hidden=48))
    with pytest.raises(CheckpointMismatchError, match="num_layers=4.*num_layers=6"):
        load_pdm(tmp_path, tiny_target("llama", num_layers=6))
    with pytest.raises(CheckpointMismatchError, match="architecture='LlamaForCausalLM'.*'Qwen2ForCausalLM'"):
        load_pdm(tmp_path, tiny_target("qwen2", num_layers=4))
    with pytest.raises(CheckpointMismatchError, match="--stages 2 --split 2,2"):
        load_pdm(tmp_path, target, [1, 1, 2])
    with pytest.raises(FileNotFoundError, match="not a PDM checkpoint"):
        load_pdm(tmp_path / "missing", target)
