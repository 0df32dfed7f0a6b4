"""PPSD: pipeline drafting from the newest token's shallow state only (no multi-depth aggregation).

Same schedule as SPD (the engine's `stream`, no copy of it); only the drafter differs. After
each cycle's stage step the newest in-flight token has passed stage 1, and its stage-1 output
h_s (s = layers in stage 1, pre-norm) is the only thing the draft for the next position reads:
an early-exit head of N decoder layers of the target's architecture + the target's final norm +
a draft lm_head. The head keeps its own KV cache over the h_s rows of all earlier positions
(every token's h_s is final once it has left stage 1), so its context is the sequence itself.

Initialised from target layers s..s+N-1 and the target's lm_head, an untrained head is exactly
the target's early exit after s+N layers (a self-speculative baseline); training distils the
target's next-token distribution into it (`train_heads`).

The draft runs after stage 1 (`after_stages = True`), so unlike the PDM it is not hidden behind
the stage work: a cycle costs one stage plus one head forward (see spd.bench.costs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..cache import KVCache
from ..pdm import TargetFingerprint, _body_config
from ..target import Target, attention_mask
from .heads import DraftVocabHead, pick


@dataclass(frozen=True)
class PPSDConfig:
    target: TargetFingerprint
    stage_layers: tuple[int, ...]         # per-stage layer counts (stage 1's sets the exit)
    num_layers: int = 1
    draft_vocab_size: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def exit_index(self) -> int:
        """Hidden-state index the head reads: the output of the last layer of stage 1."""
        return self.stage_layers[0]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PPSDConfig":
        data = dict(data)
        data["target"] = TargetFingerprint(**data["target"])
        data["stage_layers"] = tuple(data["stage_layers"])
        return cls(**data)


class PPSDHead(nn.Module):
    """N target-architecture layers on h_s + the target's final norm + a draft lm_head."""

    METHOD = "ppsd"

    def __init__(self, config: PPSDConfig, target: Target):
        super().__init__()
        if sum(config.stage_layers) != target.num_layers:
            raise ValueError(f"stage split {list(config.stage_layers)} sums to {sum(config.stage_layers)}, "
                             f"the target has {target.num_layers} layers")
        self.config = config
        body_cfg = _body_config(target.config, config.num_layers)
        self.layers = nn.ModuleList(target.layer_class(body_cfg, layer_idx=i) for i in range(config.num_layers))
        self.lm_head = DraftVocabHead(target.hidden_size, target.vocab_size, config.draft_vocab_size)
        self._target = {"norm": target.norm, "rotary_emb": target.rotary_emb}

    @property
    def exit_index(self) -> int:
        return self.config.exit_index

    def forward(self, rows: torch.Tensor, positions: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        """(B, r, H) h_s rows at (r,) positions -> (B, r, H) normed hidden states."""
        position_ids = positions[None]
        rope = self._target["rotary_emb"](rows, position_ids=position_ids)
        hidden = rows
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                           position_embeddings=rope)
        return self._target["norm"](hidden)

    @classmethod
    def create(cls, target: Target, stage_layers: list[int], num_layers: int = 1,
               draft_ids: list[int] | None = None, init_from_target: bool = True, seed: int = 0) -> "PPSDHead":
        """A fresh head; by default its layers are copies of target layers s..s+N-1 (early exit)."""
        config = PPSDConfig(TargetFingerprint.of(target), tuple(stage_layers), num_layers,
                            len(draft_ids) if draft_ids is not None else None)
        torch.manual_seed(seed)
        head = cls(config, target)
        head.lm_head.init_from(target, draft_ids)
        if init_from_target:
            with torch.no_grad():
                for i, layer in enumerate(head.layers):
                    source = min(config.exit_index + i, target.num_layers - 1)
                    # a hybrid or MoE target's layer may differ from the dense full-attention
                    # body layer: copy the weights both have (norms, MLP or attention)
                    own = layer.state_dict()
                    shared = {name: w for name, w in target.layers[source].state_dict().items()
                              if name in own and own[name].shape == w.shape}
                    layer.load_state_dict(shared, strict=False)
        return head.to(device=target.device, dtype=target.dtype)


class PPSDDrafter:
    """The engine's post-step drafter: the draft for newest+1 from h_s of positions <= newest."""

    after_stages = True

    def __init__(self, head: PPSDHead):
        self.head = head
        self.anchors = [head.exit_index]
        self.cache = KVCache(range(head.config.num_layers))

    def begin(self, prompt_len: int) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def draft(self, state, params, gen):
        assert state.stepped, "PPSD drafts after the stage step (after_stages=True)"
        newest = state.newest
        # rows up to newest-1 stay valid unless a rejection replaced tokens; newest is always new
        start = min(self.cache.length(0), newest)
        self.cache.crop(start)
        rows = state.features[start:newest + 1, 0][None]
        positions = torch.arange(start, newest + 1, device=rows.device)
        mask = attention_mask(positions, start + len(positions), rows.dtype)
        hidden = self.head(rows, positions, mask, self.cache)
        return pick(self.head.lm_head(hidden[0, -1]), params, gen)
