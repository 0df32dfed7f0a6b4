"""Per-layer KV cache that one layer at a time appends to and that crops to a position.

In SPD the layers of one model hold different numbers of positions at the same moment (deeper
stages lag behind), so every layer keeps its own length. The cache implements the one method a
transformers attention module calls, `update(keys, values, layer_idx, **kwargs)`, so the
target's own decoder layers (and the PDM's) write into it through their public forward.

Buffers grow by doubling, so appending a token is a copy of one row, not a re-concatenation.

Recurrent layers (Gated DeltaNet, short convolutions, Mamba2) have no keys to cut: they carry a
state. The cache implements the public state methods their modules call (`get_conv_state`,
`update_conv_state`, `get_recurrent_state`, `update_recurrent_state`, `is_recording_past`) and
keeps, per recurrent layer, the states after its `keep` most recent forward calls, each tagged
with the number of positions it covers; `crop(position)` goes back to the state that covers
exactly `position` positions. In SPD a layer of stage k is at most n-k-1 calls ahead of the
position a rejection rolls back to, so it needs n-k states (`Target.new_cache(stages)`).
This module knows nothing about stages, drafts or models.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class RecurrentState:
    """A recurrent layer's state after its first `length` positions."""

    length: int
    conv: torch.Tensor | None = None        # (1, channels, kernel) last inputs of the convolution
    recurrent: torch.Tensor | None = None   # e.g. (1, heads, d_k, d_v) delta-rule / SSM state

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent) if t is not None)


class KVCache:
    """Keys and values for a set of layers, indexed by the layers' global `layer_idx`."""

    def __init__(self, layer_indices, initial_capacity: int = 256, recurrent=(), keep=None):
        """`recurrent`: layers with a recurrent state; `keep`: states kept per recurrent layer
        (an int or {layer: int}); default len(layers) + 1, enough for any n <= L stages."""
        self.layer_indices = list(layer_indices)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._length = {i: 0 for i in self.layer_indices}
        self._initial_capacity = initial_capacity
        default = len(self.layer_indices) + 1
        self._keep = {i: (keep if isinstance(keep, int) else (keep or {}).get(i, default))
                      for i in recurrent}
        self._states: dict[int, deque[RecurrentState]] = {i: deque(maxlen=self._keep[i]) for i in recurrent}
        self._pending: dict[int, torch.Tensor | None] = {}

    def length(self, layer_idx: int) -> int:
        """Number of positions layer `layer_idx` holds (positions 0..length-1)."""
        if layer_idx in self._states:
            states = self._states[layer_idx]
            return states[-1].length if states else 0
        return self._length[layer_idx]

    # -- recurrent layers: the state methods transformers' linear-attention / SSM modules call --

    def is_recording_past(self, layer_idx: int) -> bool:
        # True makes the modules hand every new convolution input to update_conv_state instead
        # of updating our stored state in place (which would overwrite a kept snapshot)
        return True

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        states = self._states[layer_idx]
        return states[-1].conv if states else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        states = self._states[layer_idx]
        if not states or states[-1].recurrent is None:
            self._pending[layer_idx] = None
            return None
        # a copy: Mamba2's single-token kernel updates the state it is given in place
        self._pending[layer_idx] = states[-1].recurrent.clone()
        return self._pending[layer_idx]

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        """New (1, C, q) convolution inputs -> (1, C, kept + q) with the kept left context; this
        call's new state (the last `kernel` inputs, zero-padded) becomes the layer's latest."""
        states = self._states[layer_idx]
        previous = states[-1] if states else None
        full = conv_states if previous is None else torch.cat([previous.conv, conv_states], dim=-1)
        kernel = conv_kernel_size or full.shape[-1]
        kept = full[..., -kernel:]
        if kept.shape[-1] < kernel:
            kept = torch.nn.functional.pad(kept, (kernel - kept.shape[-1], 0))
        length = (previous.length if previous else 0) + conv_states.shape[-1]
        states.append(RecurrentState(length, kept, self._pending.pop(layer_idx, None)))
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._states[layer_idx][-1].recurrent = recurrent_states
        return recurrent_states

    def state_bytes(self, layer_idx: int) -> int:
        """Bytes of one kept state of a recurrent layer (0 before its first call, or no state)."""
        states = self._states.get(layer_idx)
        return states[-1].nbytes() if states else 0

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
        for layer_idx, states in self._states.items():   # check first: a refused crop changes nothing
            have = [s.length for s in states]
            if position > 0 and position < (have[-1] if have else 0) and position not in have:
                raise RuntimeError(
                    f"recurrent layer {layer_idx} cannot go back to position {position}: it keeps the "
                    f"states after {have or 'no'} positions (keep={self._keep[layer_idx]}); a cache "
                    f"for n stages needs n - k states in stage k (Target.new_cache(stages))")
        for layer_idx, length in self._length.items():
            self._length[layer_idx] = min(length, position)
        for states in self._states.values():
            while states and states[-1].length > position:
                states.pop()

    def select(self, start: int, keep: list[int], layers=None) -> None:
        """Keep, after slot `start`, only the entries at start + keep[i] (in that order), in
        `layers` (default all): a token tree pruned its branches. Slots before `start` never move."""
        layers = self.layer_indices if layers is None else layers
        index = None
        for layer_idx in layers:
            if layer_idx in self._states:
                raise RuntimeError(f"recurrent layer {layer_idx} cannot drop tree branches (it keeps a state)")
            if layer_idx not in self._keys:
                continue
            if index is None:
                index = torch.tensor(keep, device=self._keys[layer_idx].device) + start
            end = start + len(keep)
            for table in (self._keys, self._values):
                table[layer_idx][:, :, start:end] = table[layer_idx][:, :, index]  # gathers first: no overlap
            self._length[layer_idx] = end

    def reset(self) -> None:
        for layer_idx in self._length:
            self._length[layer_idx] = 0
        for states in self._states.values():
            states.clear()
