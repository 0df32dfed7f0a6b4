"""The Pipeline Draft Module (PDM): drafts the next token from multi-depth target features.

Anchors are hidden-state indices (0 = embedding, i = output of target layer i, pre-norm). A token
at depth d (stages passed) has the anchors up to index boundary[d]; its aggregation *type* is the
largest i with anchors[i] <= boundary[d], and its input row is projections[i] applied to the
concatenation of its hidden states at anchors[0..i]. The rows pass through N_s decoder layers of
the target's own architecture, the target's (frozen, shared) final norm and a draft lm_head,
optionally over a draft vocabulary subset whose ids map back to the full vocabulary.

This module knows the PDM's maths and its cache; the engine decides which rows to run when.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .families import UnsupportedModelError, family_of, layer_kinds
from .target import Target, attention_mask, split_layers, stage_boundaries


def default_anchors(stage_layers: list[int]) -> list[int]:
    """SPEC rule {0, s, 3s, 6s, L-1} with s*d read as "the boundary after d stages"; at most n+1.

    For an even split boundary[d] = d*s, the spec's formula. When the rule gives more than n+1
    anchors (small n), L-1 is dropped: it is the one anchor no depth reaches as a boundary.
    """
    n, num_layers = len(stage_layers), sum(stage_layers)
    bounds = stage_boundaries(split_layers(num_layers, n, stage_layers))
    anchors = sorted({bounds[min(d, n)] for d in (0, 1, 3, 6)} | {num_layers - 1})
    anchors = [a for a in anchors if 0 <= a <= num_layers]
    if len(anchors) > n + 1:
        anchors.remove(num_layers - 1)
    return anchors


def types_by_depth(stage_layers, anchors) -> list[int]:
    """For depth d = 0..n: how many anchors a token that passed d stages has (its PDM type + 1)."""
    bounds = [0]
    for count in stage_layers:
        bounds.append(bounds[-1] + count)
    return [sum(a <= b for a in anchors) for b in bounds]


def fits_split(trained: list[int], anchors, counts: list[int]) -> bool:
    """A PDM trained for split `trained` drafts exactly as trained under split `counts` when every
    depth reaches the same anchors: its inputs are the same hidden states either way (e.g. a
    15/15 PDM with anchors 0,15,30 runs unchanged on 17/13, but not on 14/16)."""
    return (len(trained) == len(counts) and sum(trained) == sum(counts)
            and types_by_depth(trained, anchors) == types_by_depth(counts, anchors))


def check_anchors(anchors: list[int], num_layers: int, n_stages: int) -> None:
    if not anchors or anchors[0] != 0:
        raise ValueError(f"anchors must start at 0 (the embedding), got {anchors}")
    if any(b <= a for a, b in zip(anchors, anchors[1:])):
        raise ValueError(f"anchors must be strictly increasing, got {anchors}")
    if anchors[-1] > num_layers:
        raise ValueError(f"anchor {anchors[-1]} is past the last layer output index {num_layers}")
    if len(anchors) > n_stages + 1:
        raise ValueError(f"{len(anchors)} anchors given but n={n_stages} stages allow at most "
                         f"{n_stages + 1} (one aggregation type per depth)")


@dataclass(frozen=True)
class TargetFingerprint:
    """What a PDM checkpoint records about the target it was built for."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int

    @classmethod
    def of(cls, target: Target) -> "TargetFingerprint":
        archs = getattr(target.config, "architectures", None) or [target.config.model_type]
        return cls(architecture=target.architecture or archs[0], model_type=target.config.model_type,
                   hidden_size=target.hidden_size, num_layers=target.num_layers,
                   vocab_size=target.vocab_size)


@dataclass(frozen=True)
class PDMConfig:
    target: TargetFingerprint
    stage_layers: tuple[int, ...]          # per-stage layer counts, sum = target layers
    anchors: tuple[int, ...]
    num_layers: int = 1                    # N_s decoder layers in the body
    draft_vocab_size: int | None = None    # None: the full vocabulary
    extra: dict = field(default_factory=dict)  # free-form provenance (training run, ...)

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PDMConfig":
        data = dict(data)
        data["target"] = TargetFingerprint(**data["target"])
        data["stage_layers"] = tuple(data["stage_layers"])
        data["anchors"] = tuple(data["anchors"])
        return cls(**data)


def _body_config(target_config, num_layers: int):
    """The target's config for an N_s-layer body: full attention everywhere (hybrid targets get
    attention layers of their own architecture) and a dense MLP where the family allows it (MoE)."""
    family = family_of(target_config)
    if "hybrid" in layer_kinds(target_config):
        raise UnsupportedModelError(f"{target_config.model_type}: every layer mixes attention and a recurrent "
                                    f"state, so there is no full-attention layer to build a draft body from")
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * num_layers
    if hasattr(cfg, "sliding_window"):
        cfg.sliding_window = None
    for name, value in (family.dense_body or {}).items():
        setattr(cfg, name, list(range(num_layers)) if value == "all" else num_layers)
    return cfg


class PDM(nn.Module):
    """Projections per aggregation type + N_s target-architecture layers + draft lm_head."""

    def __init__(self, config: PDMConfig, target: Target):
        super().__init__()
        hidden, m = target.hidden_size, len(config.anchors)
        check_anchors(list(config.anchors), target.num_layers, config.n_stages)
        self.config = config
        self.boundaries = stage_boundaries(split_layers(target.num_layers, config.n_stages,
                                                        list(config.stage_layers)))
        self.projections = nn.ModuleList(nn.Linear((i + 1) * hidden, hidden, bias=False) for i in range(m))
        layer_cls = target.layer_class
        body_cfg = _body_config(target.config, config.num_layers)
        self.layers = nn.ModuleList(layer_cls(body_cfg, layer_idx=i) for i in range(config.num_layers))
        vocab = config.draft_vocab_size or target.vocab_size
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("draft_ids", torch.arange(vocab), persistent=True)
        # shared with the target, frozen, not part of the PDM's weights
        self._target = {"norm": target.norm, "rotary_emb": target.rotary_emb, "vocab": target.vocab_size}

    @property
    def anchors(self) -> list[int]:
        return list(self.config.anchors)

    def type_of_depth(self, depth: int) -> int:
        """Aggregation type of a token that has passed `depth` stages (depth n: finished)."""
        reached = self.boundaries[min(depth, self.config.n_stages)]
        return max(i for i, a in enumerate(self.config.anchors) if a <= reached)

    def rows(self, features: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """(r, m, H) anchor features and (r,) types -> (1, r, H) PDM input rows."""
        r, m, hidden = features.shape
        out = features.new_empty(r, hidden)
        for t in types.unique().tolist():
            pick = types == t
            out[pick] = self.projections[t](features[pick, : t + 1].reshape(-1, (t + 1) * hidden))
        return out[None]

    def body(self, rows: torch.Tensor, positions: torch.Tensor, mask, cache=None) -> torch.Tensor:
        """(1, r, H) rows at `positions` through the PDM layers and the final norm -> (1, r, H)."""
        position_ids = positions[None]
        rope = self._target["rotary_emb"](rows, position_ids=position_ids)
        hidden = rows
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                           position_embeddings=rope)
        return self._target["norm"](hidden)

    def forward_window(self, rows: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Inference: run rows after the cache's committed positions; (1, r, H) rows -> (V_d,)
        logits of the last row (the newest token's: the draft for the position after it)."""
        kv_len = cache.length(0) + rows.shape[1]
        mask = attention_mask(positions, kv_len, rows.dtype)
        return self.lm_head(self.body(rows, positions, mask, cache)[0, -1]).float()

    def forward_tree(self, rows: torch.Tensor, positions: torch.Tensor, cache, mask, last: int) -> torch.Tensor:
        """Inference over a token tree: rows after the cache's committed positions with an explicit
        additive mask; (1, r, H) rows -> (last, V_d) logits of the last `last` rows (the leaves)."""
        return self.lm_head(self.body(rows, positions, mask, cache)[0, -last:]).float()

    def full_vocab_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(..., V_d) -> (..., V) with -inf outside the draft vocabulary."""
        if self.config.draft_vocab_size is None:
            return draft_logits
        full = draft_logits.new_full((*draft_logits.shape[:-1], self._target["vocab"]), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, draft_logits)

    @classmethod
    def create(cls, target: Target, stage_layers: list[int], anchors: list[int] | None = None,
               num_layers: int = 1, draft_ids: list[int] | None = None,
               init_from_layers: list[int] | None = None, seed: int = 0) -> "PDM":
        """A fresh PDM for `target` cut into `stage_layers`; lm_head rows copied from the target."""
        anchors = list(anchors) if anchors is not None else default_anchors(stage_layers)
        config = PDMConfig(target=TargetFingerprint.of(target), stage_layers=tuple(stage_layers),
                           anchors=tuple(anchors), num_layers=num_layers,
                           draft_vocab_size=len(draft_ids) if draft_ids is not None else None)
        torch.manual_seed(seed)
        pdm = cls(config, target)
        with torch.no_grad():
            if draft_ids is not None:
                ids = torch.tensor(sorted(set(draft_ids)), dtype=torch.long)
                if len(ids) != len(draft_ids) or ids[0] < 0 or ids[-1] >= target.vocab_size:
                    raise ValueError("draft vocabulary must hold distinct ids in [0, vocab_size)")
                pdm.draft_ids.copy_(ids)
            pdm.lm_head.weight.copy_(target.lm_head.weight[pdm.draft_ids])
            for body_layer, target_idx in zip(pdm.layers, init_from_layers or []):
                body_layer.load_state_dict(target.layers[target_idx].state_dict())
        return pdm.to(device=target.device, dtype=target.dtype)
