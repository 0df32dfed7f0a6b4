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

from .families import (  # noqa: F401  (re-exported: spd.target is where most callers look)
    FAMILIES,
    RECURRENT_KINDS,
    Family,
    Rotary,
    UnsupportedModelError,
    check_against_hf,
    check_supported,
    family_of,
    layer_kinds,
)

log = logging.getLogger(__name__)


def split_layers(num_layers: int, n_stages: int, counts: list[int] | None = None) -> list[range]:
    """Cut layers 0..L-1 into n contiguous stages: the most even split, or per-stage counts."""
    if n_stages < 1:
        raise ValueError(f"need at least 1 stage (--stages 1 or more), got n={n_stages}")
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


@dataclass(frozen=True)
class TreeMask:
    """Which keys each query of a token-tree step may see: (kv,) key positions and (q, kv) allowed.

    The cache of a layer holds the verified prefix and then in-flight tree nodes of several
    branches; a query sees the prefix, its own ancestors and itself (spd.tree builds this)."""

    key_positions: torch.Tensor
    allowed: torch.Tensor

    def additive(self, q_positions: torch.Tensor, dtype, window: int | None = None) -> torch.Tensor:
        allowed = self.allowed
        if window is not None:
            allowed = allowed & ((q_positions[:, None] - self.key_positions[None, :]) < window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
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

    def __post_init__(self):
        self.family: Family = family_of(self.config)
        self.kinds = layer_kinds(self.config)
        if not isinstance(self.rotary_emb, Rotary):
            self.rotary_emb = Rotary(self.rotary_emb, self.config, self.family.rope_per_kind)

    @classmethod
    def from_hf(cls, model, check: bool = True) -> "Target":
        """Wrap a loaded transformers *ForCausalLM of a supported family; with `check`, refuse it
        unless spd's forward of a few tokens gives transformers' logits (families.check_against_hf)."""
        check_supported(model.config)
        body = model.model
        family = family_of(model.config)
        target = cls(config=model.config, embed_tokens=body.embed_tokens,
                     layers=dict(enumerate(body.layers)), rotary_emb=body.rotary_emb,
                     norm=getattr(body, family.norm), lm_head=model.lm_head, eos_token_ids=eos_ids_of(model),
                     architecture=type(model).__name__)
        if check:
            check_against_hf(target, model)
        return target

    @property
    def recurrent(self) -> bool:
        """True when some layer keeps a recurrent state (it can only roll back to call boundaries)."""
        return any(kind in RECURRENT_KINDS for kind in self.kinds)

    def new_cache(self, stages: list[range] | None = None, layers=None, keep: int | None = None):
        """A cache for `layers` (default: all). With the stage split, every recurrent layer keeps
        only the states a rejection can roll back to: n - k for a layer of stage k; else `keep`
        states (default L + 1, enough for any split)."""
        from .cache import KVCache

        layers = range(self.num_layers) if layers is None else layers
        if stages is not None:
            keep = {i: len(stages) - k for k, stage in enumerate(stages) for i in stage}
        recurrent = [i for i in layers if self.kinds[i] in RECURRENT_KINDS]
        return KVCache(layers, recurrent=recurrent, keep=keep)

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
        if not window or (types is not None and types[layer_idx] != "sliding_attention"):
            return None
        if self.config.model_type == "qwen2" and not getattr(self.config, "use_sliding_window", False):
            return None
        return window

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(q,) ids -> (1, q, H) embeddings (hidden state index 0); (B, S) ids -> (B, S, H)."""
        hidden = self.embed_tokens(token_ids if token_ids.dim() == 2 else token_ids[None])
        if self.family.embed_multiplier:
            hidden = hidden * getattr(self.config, self.family.embed_multiplier)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states (..., H) of finished tokens -> (..., V) float32 logits."""
        return self.scale_logits(self.lm_head(self.norm(hidden)))

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """lm_head outputs -> the family's logits (scale, divisor, soft-cap), float32."""
        family, config = self.family, self.config
        if family.logit_multiplier:
            logits = logits * getattr(config, family.logit_multiplier)
        if family.logit_divisor:
            logits = logits / getattr(config, family.logit_divisor)
        cap = getattr(config, family.softcap) if family.softcap else None
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def prefill(self, prompt_ids: torch.Tensor, cache, record=()):
        """Run the prompt through every layer: (last position's (1, 1, H) pre-norm hidden,
        {anchor: (P, H)} for the anchors in `record`, 0 included)."""
        hidden = self.embed(prompt_ids)
        snapshots = {0: hidden[0]} if 0 in record else {}
        positions = torch.arange(len(prompt_ids), device=prompt_ids.device)
        hidden, deeper = self.run_layers(hidden, positions, range(self.num_layers), cache, record)
        snapshots.update(deeper)
        return hidden[:, -1:], snapshots

    def run_layers_stepwise(self, hidden: torch.Tensor, positions: torch.Tensor, layers: range, cache,
                            record=()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`run_layers`, one position per call when the model has recurrent layers, so the cache
        keeps a state to crop back to after every position (verifying several drafts at once)."""
        if not self.recurrent or len(positions) == 1:
            return self.run_layers(hidden, positions, layers, cache, record)
        outs, snaps = [], []
        for j in range(len(positions)):
            out, snapshots = self.run_layers(hidden[:, j:j + 1], positions[j:j + 1], layers, cache, record)
            outs.append(out)
            snaps.append(snapshots)
        return torch.cat(outs, 1), {i: torch.cat([s[i] for s in snaps]) for i in snaps[0]}

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, layers: range, cache,
                   record=(), tree: TreeMask | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run `layers` on (1, q, H) hidden states of new positions, appending to `cache`.

        Every earlier position must already be in each layer's cache (true in SPD: older tokens
        are deeper). Returns the output and {anchor index: (q, H)} for indices in `record`
        that lie in (layers.start, layers.stop]. `tree`: the queries are tree nodes (several may
        share a position) and see the keys it allows instead of every earlier position.
        """
        assert hidden.dim() == 3 and hidden.shape[:2] == (1, len(positions)), hidden.shape
        position_ids = positions[None]
        ropes = {}   # per layer kind (gemma3 has one rotary embedding per kind)
        snapshots = {}
        masks = {}
        for layer_idx in layers:
            kind = self.kinds[layer_idx]
            rope_key = kind if self.family.rope_per_kind else None
            if rope_key not in ropes:
                ropes[rope_key] = self.rotary_emb(hidden, position_ids, layer_type=kind)
            window = self.layer_window(layer_idx)
            if kind in ("linear_attention", "conv"):  # recurrent: no attention mask
                mask = None
            else:
                key = (window, cache.length(layer_idx))
                if key not in masks and tree is not None:
                    assert len(tree.key_positions) == cache.length(layer_idx) + len(positions)
                    masks[key] = tree.additive(positions, hidden.dtype, window)
                elif key not in masks:
                    masks[key] = attention_mask(positions, cache.length(layer_idx) + len(positions),
                                                hidden.dtype, window)
                mask = masks[key]
            out = self.layers[layer_idx](hidden, attention_mask=mask, position_ids=position_ids,
                                         cache=cache, position_embeddings=ropes[rope_key])
            hidden = out[0] if isinstance(out, tuple) else out   # falcon_h1 layers return a tuple
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
