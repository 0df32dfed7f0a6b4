"""Drafters: what proposes the token that enters stage 1 next.

The engine asks a drafter once per cycle, before the stage step, for the token at position
newest+1, and hands it a `DraftState`: every token so far, which of them are still in flight,
and the anchor features recorded so far. A drafter tells the engine which anchors to record.

- `PDMDrafter`: the Pipeline Draft Module over multi-depth features (the real thing).
- `OracleDrafter` / `AdversarialDrafter`: know the target's greedy continuation and always draft
  it / never draft it. Tests use them to pin down the schedule (all accepted / all rejected).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .cache import KVCache
from .pdm import PDM
from .sampling import SamplingParams, probs


@dataclass
class DraftState:
    tokens: list[int]          # every position so far: prompt, verified tokens, in-flight drafts
    first_inflight: int        # position of the oldest in-flight token (positions before: finished)
    n_stages: int
    features: torch.Tensor     # (capacity, m, H) hidden states at the drafter's anchors per position
    stepped: bool = False      # True when this cycle's stage step already ran (post-step drafters)

    @property
    def newest(self) -> int:
        return len(self.tokens) - 1

    def depth(self, position: int) -> int:
        """Stages passed: in-flight tokens sit at consecutive positions, newest at depth 0
        (depth 1 once the cycle's stage step ran)."""
        if position < self.first_inflight:
            return self.n_stages
        return min(self.n_stages, self.newest - position + self.stepped)


class Drafter(Protocol):
    anchors: list[int]   # hidden-state indices the engine must record for this drafter
    # False (SPD): draft from pre-step features, concurrently with the stages. True (PPSD-style):
    # draft after the stage step, from the newest token's stage-1 output; not hidden.
    after_stages: bool

    def begin(self, prompt_len: int) -> None:
        """A new sequence starts (drop any per-sequence state)."""

    def draft(self, state: DraftState, params: SamplingParams, gen: torch.Generator
              ) -> tuple[int, torch.Tensor | None]:
        """(token for position newest+1, its full-vocabulary draft distribution q or None)."""


class PDMDrafter:
    """Drafts with a PDM: each cycle re-runs the rows whose depth changed, on a committed cache."""

    def __init__(self, pdm: PDM):
        self.pdm = pdm
        self.anchors = pdm.anchors
        self.after_stages = False
        self.cache = KVCache(range(pdm.config.num_layers))
        self.committed = 0   # positions whose depth-n rows are final in the PDM cache
        self.last_source = "pdm"

    def begin(self, prompt_len: int) -> None:
        self.cache.reset()
        self.committed = 0

    @torch.inference_mode()
    def logits(self, state) -> torch.Tensor:
        """(V,) full-vocabulary logits of the PDM's prediction for position newest+1."""
        start, newest = self.committed, state.newest
        depths = [state.depth(p) for p in range(start, newest + 1)]
        types = torch.tensor([self.pdm.type_of_depth(d) for d in depths])
        rows = self.pdm.rows(state.features[start:newest + 1], types)
        positions = torch.arange(start, newest + 1, device=rows.device)
        self.cache.crop(start)  # in-flight rows changed depth since last cycle: recompute them
        logits = self.pdm.full_vocab_logits(self.pdm.forward_window(rows, positions, self.cache))
        self.committed = state.first_inflight  # finished rows just computed at depth n are final
        return logits

    def draft(self, state, params, gen):
        logits = self.logits(state)
        if params.greedy:
            return int(logits.argmax()), None
        q = probs(logits, params)
        return int(torch.multinomial(q, 1, generator=gen)), q


class OracleDrafter:
    """Always drafts the given continuation (the target's greedy output): every draft accepted."""

    anchors: list[int] = []
    after_stages = False

    def __init__(self, continuation: list[int]):
        self.continuation = list(continuation)
        self.prompt_len = 0

    def begin(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def expected(self, state: DraftState) -> int:
        index = state.newest + 1 - self.prompt_len
        return self.continuation[index] if index < len(self.continuation) else 0

    def draft(self, state, params, gen):
        return self.expected(state), None


class AdversarialDrafter(OracleDrafter):
    """Never drafts the given continuation: every draft rejected under greedy verification."""

    def __init__(self, continuation: list[int], vocab_size: int):
        super().__init__(continuation)
        self.vocab_size = vocab_size

    def draft(self, state, params, gen):
        return (self.expected(state) + 1) % self.vocab_size, None
