"""Stage split, KV cache append/crop, anchors, unsupported models."""

import pytest
import torch
from transformers import GPT2Config

from conftest import tiny_target
from spd.cache import KVCache
from spd.pdm import PDM, default_anchors
from spd.target import UnsupportedModelError, check_supported, split_layers, stage_boundaries


def test_split_layers_even_uneven_and_errors():
    assert split_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert [len(s) for s in split_layers(30, 4)] == [8, 8, 7, 7]
    assert split_layers(30, 4, [7, 8, 8, 7])[1] == range(7, 15)
    assert stage_boundaries(split_layers(30, 4)) == [0, 8, 16, 23, 30]
    with pytest.raises(ValueError, match="at least 1 stage"):
        split_layers(4, 0)
    with pytest.raises(ValueError, match="only 4 layers"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="sum to 7"):
        split_layers(8, 2, [3, 4])
    with pytest.raises(ValueError, match="3 per-stage counts"):
        split_layers(8, 2, [3, 4, 1])
    with pytest.raises(ValueError, match="at least one layer"):
        split_layers(8, 2, [8, 0])


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, mistral, mixtral.*qwen3_5_text"):
        check_supported(GPT2Config())


def test_kv_cache_append_per_layer_and_crop():
    cache = KVCache([0, 1])
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(1, 2, 3, 4)
    keys, values = cache.update(k, k + 1, 0)
    assert keys.shape == (1, 2, 3, 4) and cache.length(0) == 3 and cache.length(1) == 0
    for step in range(300):  # grows past the initial capacity, keeps old rows
        keys, _ = cache.update(k[:, :, :1] + step, k[:, :, :1], 0)
    assert cache.length(0) == 303 and torch.equal(keys[:, :, :3], k)
    assert torch.equal(keys[:, :, 3 + 299], k[:, :, 0] + 299)
    cache.update(k, k, 1)
    cache.crop(2)
    assert (cache.length(0), cache.length(1)) == (2, 2)
    keys, _ = cache.update(k[:, :, :1] * 0, k[:, :, :1], 1)
    assert keys.shape[2] == 3 and torch.equal(keys[:, :, :2], k[:, :, :2])
    with pytest.raises(KeyError, match="layer 5"):
        cache.update(k, k, 5)
    with pytest.raises(ValueError):
        cache.crop(-1)


def test_stage_runs_compose_to_the_full_forward_and_record_anchors():
    target = tiny_target("qwen3", num_layers=6)
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    full_cache, split_cache = KVCache(range(6)), KVCache(range(6))
    full, snaps = target.prefill(ids, full_cache, record={0, 2, 6})
    assert set(snaps) == {0, 2, 6} and torch.allclose(snaps[6][-1], full[0, -1])
    # token by token through stages [0,2) [2,5) [5,6) equals the whole prompt at once
    positions = torch.arange(6)
    for p in range(6):
        h = target.embed(ids[p:p + 1])
        for stage in split_layers(6, 3, [2, 3, 1]):
            h, s = target.run_layers(h, positions[p:p + 1], stage, split_cache, record={2, 6})
            if 2 in s:
                assert torch.allclose(s[2][0], snaps[2][p], atol=1e-5)
    assert torch.allclose(h[0, -1], full[0, -1], atol=1e-5)


def test_default_anchors_follow_the_spec_rule():
    assert default_anchors([8, 8, 8, 8]) == [0, 8, 24, 31, 32]        # {0, s, 3s, 6s, L-1}
    assert default_anchors([15, 15]) == [0, 15, 30]                  # at most n+1 anchors
    assert default_anchors([8, 8, 7, 7]) == [0, 8, 23, 29, 30]       # s*d = boundary after d stages
    target = tiny_target("llama", num_layers=4)
    pdm = PDM.create(target, [1, 1, 1, 1], anchors=[0, 1, 3])
    assert [pdm.type_of_depth(d) for d in range(5)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="at most 3"):
        PDM.create(target, [2, 2], anchors=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="start at 0"):
        PDM.create(target, [2, 2], anchors=[1, 2])
