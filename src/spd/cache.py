"""Per-layer KV cache that one layer at a time appends to and that crops to a position.

In SPD the layers of one model hold different numbers of positions at the same moment (deeper
stages lag behind), so every layer keeps its own length. The cache implements the one method a
transformers attention module calls, `update(keys, values, layer_idx, **kwargs)`, so the
target's own decoder layers (and the PDM's) write into it through their public forward.

Buffers grow by doubling, so appending a token is a copy of one row, not a re-concatenation.
This module knows nothing about stages, drafts or models.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for a set of layers, indexed by the layers' global `layer_idx`."""

    def __init__(self, layer_indices, initial_capacity: int = 256):
        self.layer_indices = list(layer_indices)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._length = {i: 0 for i in self.layer_indices}
        self._initial_capacity = initial_capacity

    def length(self, layer_idx: int) -> int:
        """Number of positions layer `layer_idx` holds (positions 0..length-1)."""
        return self._length[layer_idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Append (1, kv_heads, q, head_dim) keys/values to one layer; return all of that layer's."""
        assert key_states.shape[0] == 1, "spd decodes one sequence (batch 1)"
        if layer_idx not in self._length:
            raise KeyError(f"layer {layer_idx} is not held by this cache (holds {self.layer_indices})")
        start, added = self._length[layer_idx], key_states.shape[2]
        end = start + added
        keys = self._keys.get(layer_idx)
        if keys is None or keys.shape[2] < end:
            self._grow(layer_idx, key_states, value_states, end)
        self._keys[layer_idx][:, :, start:end] = key_states
        self._values[layer_idx][:, :, start:end] = value_states
        self._length[layer_idx] = end
        return self._keys[layer_idx][:, :, :end], self._values[layer_idx][:, :, :end]

    def _grow(self, layer_idx, key_states, value_states, needed: int) -> None:
        old_keys = self._keys.get(layer_idx)
        capacity = max(self._initial_capacity, needed, 2 * (0 if old_keys is None else old_keys.shape[2]))
        shape = (1, key_states.shape[1], capacity)
        new_keys = key_states.new_empty(*shape, key_states.shape[3])
        new_values = value_states.new_empty(*shape, value_states.shape[3])
        if old_keys is not None:
            kept = self._length[layer_idx]
            new_keys[:, :, :kept] = old_keys[:, :, :kept]
            new_values[:, :, :kept] = self._values[layer_idx][:, :, :kept]
        self._keys[layer_idx], self._values[layer_idx] = new_keys, new_values

    def crop(self, position: int) -> None:
        """Forget every position >= `position` in every layer (a rejected draft and what followed)."""
        if position < 0:
            raise ValueError(f"crop position must be >= 0, got {position}")
        for layer_idx, length in self._length.items():
            self._length[layer_idx] = min(length, position)

    def reset(self) -> None:
        for layer_idx in self._length:
            self._length[layer_idx] = 0
