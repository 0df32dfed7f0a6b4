"""Batched sampling from a Hugging Face causal LM, built for throughput on a CPU.

`sample_batch` decodes many prompts at once through the model's public forward and
`DynamicCache`. What makes it faster than `model.generate` here (SmolLM2-135M, bf16, 2 cores:
~300 -> 400+ answer tokens/s at batch 128):
- sampling by the inverse CDF (softmax, cumsum, one uniform draw per row, searchsorted):
  `torch.multinomial` draws one exponential per vocabulary entry, ~130 ms a step at 128 x 49k;
- a row that has ended leaves the batch (`DynamicCache.batch_select_indices`): finished rows
  cost nothing, where `generate` keeps computing them until the last row ends;
- logits for the last position only;
- decode attention as two batched matmuls over each key/value head's group of query heads
  (`grouped_attention`, registered with transformers' `AttentionInterface`): no copies of K and V
  per query head, and 13% more tokens/s than SDPA at 1 thread, batch 128, 192 tokens.

This module knows nothing about prompts, files or chat templates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "spd_grouped_decode"   # `model.set_attn_implementation(ATTENTION)` before sample_batch


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of one new position per row (decode); anything else goes to transformers' SDPA.
    query (B, H, q, D), key/value (B, Hkv, S, D), attention_mask boolean (B, 1, q, S) or None."""
    if query.shape[2] != 1 or dropout or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, H, _, D = query.shape
    groups = H // key.shape[1]    # query heads h = kv * groups + g share key/value head kv
    scores = torch.matmul(query.reshape(B, -1, groups, D), key.transpose(-1, -2)).float()   # (B, Hkv, G, S)
    scores.mul_(scaling if scaling is not None else D ** -0.5)
    if attention_mask is not None:   # a finite floor: a fully masked (padding) row stays finite
        scores.masked_fill_(~attention_mask, torch.finfo(torch.float32).min)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)              # (B, Hkv, G, D)
    return out.view(B, 1, H, D), None


AttentionInterface.register(ATTENTION, grouped_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)   # boolean masks, as SDPA gets them


@dataclass(frozen=True)
class SampleConfig:
    max_new_tokens: int = 256
    temperature: float = 0.7     # 0 = greedy
    top_p: float = 1.0           # 1 = no nucleus cut


@dataclass
class Sampled:
    tokens: list[int]    # the new tokens, the stop token excluded
    finished: bool       # ended with a stop token (else cut at max_new_tokens)


def pick(logits: torch.Tensor, cfg: SampleConfig, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids: greedy at temperature 0, else one exact draw per row
    from softmax(logits / T), restricted to the top-p nucleus when top_p < 1."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    order = None
    if cfg.top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs            # mass of the tokens ranked above each one
        probs = probs.masked_fill(before >= cfg.top_p, 0.0)
    cdf = probs.cumsum_(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    # first index whose cdf exceeds u: a zero-probability token is never picked
    choice = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
    return (choice if order is None else order.gather(1, choice)).squeeze(1)


@torch.inference_mode()
def sample_batch(model, prompts: list[list[int]], cfg: SampleConfig, stop_ids, pad_id: int,
                 generator: torch.Generator | None = None) -> list[Sampled]:
    """Continue every prompt (token ids) until a stop id or max_new_tokens; one result per prompt.

    Prompts are left-padded into one batch; a row leaves the batch when it ends."""
    from transformers import DynamicCache

    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    out = [Sampled([], False) for _ in prompts]
    live = list(range(len(prompts)))       # the batch's rows, as indices into `prompts`
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    next_pos = positions[:, -1:] + 1
    for step in range(cfg.max_new_tokens):
        token = pick(logits, cfg, generator)
        ended = torch.isin(token, stop)
        for row, (t, e) in enumerate(zip(token.tolist(), ended.tolist())):
            if e:
                out[live[row]].finished = True
            else:
                out[live[row]].tokens.append(t)
        keep = (~ended).nonzero().squeeze(1)
        if step == cfg.max_new_tokens - 1 or len(keep) == 0:
            break
        if len(keep) < len(live):
            cache.batch_select_indices(keep)
            live = [live[i] for i in keep.tolist()]
            token, mask, next_pos = token[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos,
                       cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        next_pos = next_pos + 1
    return out
