"""The target model as spd sees it: public transformers modules, a stage split, and stage runs.

`Target` holds the embedding, the decoder layers (by global index), the rotary embedding, the
final norm and the lm_head of a Hugging Face causal LM, and runs any contiguous range of layers
on new positions while recording the hidden states at chosen *anchor* indices (h=0 embedding,
h=i output of layer i, all before the final norm). `split_layers` cuts L layers into n stages.

This module knows nothing about drafting, verification or processes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

# model_type -> what we rely on. All of these expose model.model.{embed_tokens, layers, norm,
# rotary_emb} and decoder layers whose attention calls `cache.update(k, v, layer_idx)`.
FAMILIES = {
    "llama": "Llama 2/3, SmolLM2, TinyLlama, ...",
    "mistral": "Mistral (sliding window honoured in the mask)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (q/k norms live inside the attention module)",
}


class UnsupportedModelError(ValueError):
    pass


def split_layers(num_layers: int, n_stages: int, counts: list[int] | None = None) -> list[range]:
    """Cut layers 0..L-1 into n contiguous stages: the most even split, or per-stage counts."""
    if n_stages < 1:
        raise ValueError(f"need at least 1 stage, got n={n_stages}")
    if n_stages > num_layers:
        raise ValueError(f"n={n_stages} stages but the model has only {num_layers} layers; "
                         f"use at most {num_layers} stages")
    if counts is None:  # as even as possible; earlier stages take the extra layers (30, 4 -> 8,8,7,7)
        base, extra = divmod(num_layers, n_stages)
        counts = [base + (k < extra) for k in range(n_stages)]
    counts = list(counts)
    if len(counts) != n_stages:
        raise ValueError(f"{len(counts)} per-stage counts given ({counts}) for n={n_stages} stages")
    if any(c < 1 for c in counts):
        raise ValueError(f"every stage needs at least one layer, got counts {counts}")
    if sum(counts) != num_layers:
        raise ValueError(f"per-stage counts {counts} sum to {sum(counts)}, "
                         f"but the model has {num_layers} layers")
    starts = [sum(counts[:k]) for k in range(n_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def stage_boundaries(stages: list[range]) -> list[int]:
    """Hidden-state index reached after d stages, d = 0..n: [0, end of stage 0, ..., L]."""
    return [0] + [s.stop for s in stages]


def attention_mask(q_positions: torch.Tensor, kv_len: int, dtype, window: int | None = None):
    """Additive (1, 1, q, kv) mask for queries at `q_positions` over keys at 0..kv_len-1.

    None when a single query may see every key (the fast path of single-token decoding).
    """
    if len(q_positions) == 1 and (window is None or kv_len <= window):
        return None
    keys = torch.arange(kv_len, device=q_positions.device)
    allowed = keys[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= (q_positions[:, None] - keys[None, :]) < window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_positions.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@dataclass
class Target:
    """A causal LM reduced to the parts SPD needs. Absent parts are None (a stage process)."""

    config: object
    embed_tokens: nn.Module | None
    layers: dict[int, nn.Module]          # global layer index -> decoder layer
    rotary_emb: nn.Module
    norm: nn.Module | None
    lm_head: nn.Module | None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""                # e.g. LlamaForCausalLM (what PDM checkpoints record)
    layer_type: type | None = None        # decoder layer class, for a Target holding no layers

    @classmethod
    def from_hf(cls, model) -> "Target":
        """Wrap a loaded transformers *ForCausalLM of a supported family."""
        check_supported(model.config)
        body = model.model
        return cls(config=model.config, embed_tokens=body.embed_tokens,
                   layers=dict(enumerate(body.layers)), rotary_emb=body.rotary_emb,
                   norm=body.norm, lm_head=model.lm_head, eos_token_ids=eos_ids_of(model),
                   architecture=type(model).__name__)

    @property
    def layer_class(self) -> type:
        """The decoder layer class (the PDM body is built from it)."""
        return type(next(iter(self.layers.values()))) if self.layers else self.layer_type

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return next(self.rotary_emb.buffers()).device

    @property
    def dtype(self) -> torch.dtype:
        module = self.embed_tokens or next(iter(self.layers.values()))
        return next(module.parameters()).dtype

    def layer_window(self, layer_idx: int) -> int | None:
        """Sliding-window size of one layer, or None for full attention."""
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if window is None or (types is not None and types[layer_idx] != "sliding_attention"):
            return None
        if self.config.model_type == "qwen2" and not getattr(self.config, "use_sliding_window", False):
            return None
        return window

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(q,) ids -> (1, q, H) embeddings (hidden state index 0)."""
        return self.embed_tokens(token_ids[None])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states (..., H) of finished tokens -> (..., V) float32 logits."""
        return self.lm_head(self.norm(hidden)).float()

    def prefill(self, prompt_ids: torch.Tensor, cache, record=()):
        """Run the prompt through every layer: (last position's (1, 1, H) pre-norm hidden,
        {anchor: (P, H)} for the anchors in `record`, 0 included)."""
        hidden = self.embed(prompt_ids)
        snapshots = {0: hidden[0]} if 0 in record else {}
        positions = torch.arange(len(prompt_ids), device=prompt_ids.device)
        hidden, deeper = self.run_layers(hidden, positions, range(self.num_layers), cache, record)
        snapshots.update(deeper)
        return hidden[:, -1:], snapshots

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, layers: range, cache,
                   record=()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run `layers` on (1, q, H) hidden states of new positions, appending to `cache`.

        Every earlier position must already be in each layer's cache (true in SPD: older tokens
        are deeper). Returns the output and {anchor index: (q, H)} for indices in `record`
        that lie in (layers.start, layers.stop].
        """
        assert hidden.dim() == 3 and hidden.shape[:2] == (1, len(positions)), hidden.shape
        position_ids = positions[None]
        rope = self.rotary_emb(hidden, position_ids=position_ids)
        snapshots = {}
        masks = {}
        for layer_idx in layers:
            kv_len = cache.length(layer_idx) + len(positions)
            window = self.layer_window(layer_idx)
            if window not in masks:
                masks[window] = attention_mask(positions, kv_len, hidden.dtype, window)
            hidden = self.layers[layer_idx](hidden, attention_mask=masks[window], position_ids=position_ids,
                                            cache=cache, position_embeddings=rope)
            if layer_idx + 1 in record:
                snapshots[layer_idx + 1] = hidden[0]
        return hidden, snapshots


def eos_ids_of(model) -> tuple[int, ...]:
    """EOS ids from the model's generation config (falling back to its config)."""
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by spd; supported families: "
            f"{', '.join(sorted(FAMILIES))}. (spd needs a decoder-only causal LM whose model.model "
            f"has embed_tokens, layers, norm and rotary_emb.)")


def load_target(name_or_path: str, dtype=torch.float32, device="cpu"):
    """Load a transformers causal LM by folder or hub id; returns (Target, tokenizer or None)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .default_target import resolve_model_path

    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:  # a folder with weights only
        log.info("no tokenizer in %s (%s); token ids only", path, err)
        tokenizer = None
    return Target.from_hf(model), tokenizer
