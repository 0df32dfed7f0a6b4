"""Sampling parameters, logits -> probabilities, and draft verification as pure functions.

Words follow speculative-sampling usage: p = the target's distribution, q = the draft's; a draft
is *accepted* or replaced by a *recovered* token sampled from normalize(max(0, p - q)).
The same `probs()` processing (temperature, top-k, top-p) is applied to p and q, so verification
preserves the target's processed distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 means greedy
    top_k: int = 0             # 0 means off
    top_p: float = 1.0         # 1 means off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:   # torch seeds are 64-bit
            raise ValueError(f"seed must fit in 64 bits (e.g. 0 to 2**63 - 1), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device="cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p, row by row."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted first (softmax does not change) and a temperature that float32 keeps above 0: a tiny
    # temperature gives 0 for the top logit and -inf below it, never inf - inf
    logits = (logits - logits.amax(-1, keepdim=True)) / max(params.temperature, torch.finfo(logits.dtype).tiny)
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(p, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """One index of (V,) non-negative weights (any positive total), with probability weight / total.

    By the inverse CDF: one uniform draw against a float64 cumulative sum; a zero weight is never
    drawn. `torch.multinomial` takes ~2 ms for one draw over 49k entries on a CPU core, this ~0.1 ms."""
    cdf = weights.double().cumsum(0)
    u = torch.rand((1,), generator=gen, dtype=torch.float64, device=weights.device) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index == len(cdf):   # u * total rounded up to the total: the last entry with weight
        index = int(weights.nonzero()[-1])
    return index


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The target's own next token from (V,) logits: argmax when greedy, else a draw."""
    if params.greedy:
        return int(logits.argmax())
    return draw(probs(logits, params), gen)


def verify_greedy(draft: int, target_logits: torch.Tensor) -> tuple[bool, int]:
    """Accept iff the draft is the target's argmax; return (accepted, emitted token)."""
    best = int(target_logits.argmax())
    return draft == best, best


def verify_sample(draft: int, p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> tuple[bool, int]:
    """Speculative sampling: accept with min(1, p/q), else draw from normalize(max(0, p - q))."""
    p_x, q_x = float(p[draft]), float(q[draft])
    u = float(torch.rand((), generator=gen, device=p.device))
    if q_x > 0 and u < min(1.0, p_x / q_x):
        return True, draft
    residual = torch.clamp(p - q, min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: p itself is the right law
        residual = p
    return False, draw(residual, gen)


def verify(draft: int, draft_q: torch.Tensor | None, target_logits: torch.Tensor,
           params: SamplingParams, gen: torch.Generator) -> tuple[bool, int]:
    """Verify one draft token against the target's logits for its position."""
    if params.greedy:
        return verify_greedy(draft, target_logits)
    p = probs(target_logits, params)
    q = draft_q if draft_q is not None else torch.nn.functional.one_hot(
        torch.tensor(draft), p.shape[-1]).float()  # a drafter without q is a point mass
    return verify_sample(draft, p, q.to(p.device), gen)


def verify_multi(candidates: list[tuple[int, torch.Tensor | None]], target_logits: torch.Tensor,
                 params: SamplingParams, gen: torch.Generator) -> tuple[int | None, int]:
    """Verify several candidate drafts for one position (a token tree's children); returns
    (index of the accepted candidate or None, emitted token).

    Greedy: the candidate equal to the target's argmax. Sampling: multi-draft (recursive)
    rejection as in SpecInfer: candidate i, proposed by q_i (None: a point mass), is accepted with
    min(1, r(x)/q_i(x)) under the current residual r (first r = p); a rejection replaces r by
    normalize(max(0, r - q_i)); when all are rejected the token is drawn from the last r. Each
    step preserves r, so the output law is p. A single candidate is exactly `verify`.
    """
    if len(candidates) == 1:
        accepted, token = verify(*candidates[0], target_logits, params, gen)
        return (0 if accepted else None), token
    if params.greedy:
        best = int(target_logits.argmax())
        return next((i for i, (x, _) in enumerate(candidates) if x == best), None), best
    residual = probs(target_logits, params)
    for i, (draft, q) in enumerate(candidates):
        q = torch.nn.functional.one_hot(torch.tensor(draft), residual.shape[-1]).float() if q is None else q
        q = q.to(residual.device)
        r_x, q_x = float(residual[draft]), float(q[draft])
        u = float(torch.rand((), generator=gen, device=residual.device))
        if q_x > 0 and u < min(1.0, r_x / q_x):
            return i, draft
        nxt = torch.clamp(residual - q, min=0)
        if float(nxt.sum()) > 0:   # all zero: r == q up to rounding, r itself stays the law
            residual = nxt / nxt.sum()
    return None, draw(residual, gen)
