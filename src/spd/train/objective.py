"""The training objective: the PDM over the multi-depth layout, and distillation from the target.

`DraftForward` is an nn.Module (so DDP can wrap it) that turns a batch of anchor features into
the draft-vocabulary logits of the g_0 rows; `teacher_logits` recomputes the frozen target's
logits over the same draft vocabulary from its pre-norm last hidden state; `distill` is
KL(teacher || PDM) at a temperature plus top-1 agreement (the greedy acceptance proxy).

This module knows the layout and the PDM's public parts; it knows nothing about files or steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..pdm import PDM
from ..target import Target
from .layout import Layout


def layout_rows(pdm: PDM, layout: Layout, features: torch.Tensor) -> torch.Tensor:
    """(B, S, m, H) anchor features -> (B, num_blocks * S, H) rows, deepest block first."""
    B, S, m, hidden = features.shape
    assert m == len(pdm.anchors), (m, pdm.anchors)
    blocks = [pdm.projections[k](features[:, :, : k + 1].reshape(B, S, (k + 1) * hidden))
              for k in layout.block_types]
    return torch.cat(blocks, dim=1)


class DraftForward(nn.Module):
    """The PDM as training runs it: the layout rows through the body, the g_0 rows out.

    Only the g_0 rows' outputs are scored, so the body's last layer runs in full on those alone;
    the other rows enter it only as keys and values (their attention is computed and dropped).
    """

    def __init__(self, pdm: PDM, layout: Layout, target: Target):
        super().__init__()
        self.pdm, self.layout = pdm, layout
        self.shared = (target.rotary_emb, target.norm)   # the target's, frozen (not registered)

    def forward(self, features: torch.Tensor, mask: torch.Tensor, select: torch.Tensor | None = None
                ) -> torch.Tensor:
        """(B, S, m, H) features, (1|B, 1, R, R) structural mask, (B, S) bool rows to score ->
        (N, V_d) float32 logits of the selected g_0 rows (all B*S rows when select is None)."""
        B, S = features.shape[:2]
        rotary_emb, norm = self.shared
        hidden = layout_rows(self.pdm, self.layout, features)                # (B, R, H)
        position_ids = self.layout.positions(S, device=features.device)[None]
        cos, sin = rotary_emb(hidden, position_ids=position_ids)
        for layer in self.pdm.layers[:-1]:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))
        last, g0 = self.pdm.layers[-1], self.layout.g0_block * S
        keys = StackedKV()
        if g0:  # keys and values of the deeper blocks' rows, in layout order, into the cache
            last.self_attn(hidden_states=last.input_layernorm(hidden[:, :g0]), attention_mask=None,
                           position_embeddings=(cos[:, :g0], sin[:, :g0]), cache=keys)
        hidden = last(hidden[:, g0:], attention_mask=mask[:, :, g0:], position_ids=position_ids[:, g0:],
                      cache=keys, position_embeddings=(cos[:, g0:], sin[:, g0:]))
        hidden = norm(hidden)                                                # (B, S, H)
        hidden = hidden.reshape(B * S, -1) if select is None or bool(select.all()) else hidden[select]
        return self.pdm.lm_head(hidden).float()


class StackedKV:
    """The one cache method attention modules call, `update`, as a differentiable concatenation."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys, values, layer_idx, *args, **kwargs):
        if layer_idx in self.kv:
            keys = torch.cat([self.kv[layer_idx][0], keys], dim=2)
            values = torch.cat([self.kv[layer_idx][1], values], dim=2)
        self.kv[layer_idx] = (keys, values)
        return keys, values


@torch.no_grad()
def scale_projections(pdm: PDM, features: torch.Tensor, rms: float, seed: int = 0) -> None:
    """Re-initialise the projections for the scale of the data: every anchor contributes alike
    and every row comes out with RMS `rms` (features: (N, m, H) real rows of a batch).

    Anchor features differ in scale by orders of magnitude (SmolLM2: embedding RMS ~0.1, h_L ~45);
    with a scale-blind init the g_0 row (the embedding's projection) is lost next to the body
    layer's output in the residual stream, and Adam takes thousands of steps to grow it.
    """
    N, m, hidden = features.shape
    anchor_rms = features.float().pow(2).mean(dim=(0, 2)).sqrt().clamp(min=1e-6)   # (m,)
    gen = torch.Generator().manual_seed(seed)
    for k, proj in enumerate(pdm.projections):
        weight = torch.randn(hidden, (k + 1) * hidden, generator=gen) / ((k + 1) * hidden) ** 0.5
        weight = weight.view(hidden, k + 1, hidden) / anchor_rms[: k + 1, None].cpu()
        proj.weight.copy_(weight.reshape(hidden, -1) * rms)


def teacher_head(target: Target, pdm: PDM) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target lm_head's rows for the draft vocabulary: (V_d, H) weight and bias or None."""
    weight, bias = target.lm_head.weight, getattr(target.lm_head, "bias", None)
    if pdm.config.draft_vocab_size is None:
        return weight, bias
    ids = pdm.draft_ids.to(weight.device)
    return weight[ids], None if bias is None else bias[ids]


@torch.no_grad()
def teacher_logits(target: Target, head, last_hidden: torch.Tensor) -> torch.Tensor:
    """(N, H) pre-norm last hidden states -> (N, V_d) float32 target logits on the draft vocab."""
    weight, bias = head
    hidden = target.norm(last_hidden.to(weight.dtype))
    return target.scale_logits(F.linear(hidden, weight, bias))   # the family's logit scale / soft-cap


@torch.no_grad()
def full_argmax(target: Target, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """(N, H) pre-norm last hidden -> (N,) the target's argmax over its full vocabulary."""
    out = [target.logits(last_hidden[i:i + chunk]).argmax(-1) for i in range(0, len(last_hidden), chunk)]
    return torch.cat(out) if out else last_hidden.new_zeros(0, dtype=torch.long)


def vocab_index(pdm: PDM, vocab_size: int) -> torch.Tensor:
    """(V,) full id -> its index in the draft vocabulary, or -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=pdm.draft_ids.device)
    index[pdm.draft_ids] = torch.arange(len(pdm.draft_ids), device=pdm.draft_ids.device)
    return index


@dataclass
class DistillStats:
    """Sums over one or more batches (divide by `scored` / `in_vocab` for means)."""

    scored: int = 0          # positions whose next token counts (loss mask)
    in_vocab: int = 0        # ... whose teacher argmax is in the draft vocabulary (the loss's)
    agree: int = 0           # ... where the PDM's argmax is the teacher's argmax
    kl_sum: float = 0.0

    def add(self, other: "DistillStats") -> None:
        self.scored += other.scored
        self.in_vocab += other.in_vocab
        self.agree += other.agree
        self.kl_sum += other.kl_sum

    @property
    def loss(self) -> float:
        return self.kl_sum / self.in_vocab if self.in_vocab else 0.0

    @property
    def agreement(self) -> float:
        """Top-1 agreement over every scored position (out-of-vocabulary ones count as misses)."""
        return self.agree / self.scored if self.scored else 0.0


def distill(student: torch.Tensor, teacher: torch.Tensor, teacher_argmax: torch.Tensor,
            index: torch.Tensor, draft_ids: torch.Tensor, temperature: float = 1.0
            ) -> tuple[torch.Tensor, DistillStats]:
    """Summed KL(teacher || PDM) * T^2 over positions whose teacher argmax is in the draft vocab.

    student, teacher: (N, V_d) logits on the draft vocabulary; teacher_argmax: (N,) full ids;
    index: full id -> draft index or -1. Returns (summed loss tensor, stats). Written for
    (N, V_d) tensors of tens of millions of entries: no boolean indexing, no extra copies.
    """
    assert student.shape == teacher.shape and student.shape[0] == teacher_argmax.shape[0]
    keep = (index[teacher_argmax] >= 0).to(student.dtype)
    if temperature != 1.0:
        student, teacher = student / temperature, teacher / temperature
    with torch.no_grad():
        log_p = F.log_softmax(teacher, dim=-1)
        p = log_p.exp()
        neg_entropy = torch.einsum("nv,nv->n", p, log_p)
    cross = -torch.einsum("nv,nv->n", p, F.log_softmax(student, dim=-1))
    loss = ((cross + neg_entropy) * keep).sum() * temperature ** 2
    with torch.no_grad():
        agree = int((draft_ids[student.argmax(-1)] == teacher_argmax).sum()) if len(student) else 0
    return loss, DistillStats(scored=len(student), in_vocab=int(keep.sum()), agree=agree,
                              kl_sum=float(loss.detach()))
