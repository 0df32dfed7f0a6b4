"""Drafters: what proposes the token that enters stage 1 next.

The engine asks a drafter once per cycle, before the stage step, for the token at position
newest+1, and hands it a `spd.tree.DraftState`: every token so far, which of them are still in flight,
and the anchor features recorded so far. A drafter tells the engine which anchors to record.

- `PDMDrafter`: the Pipeline Draft Module over multi-depth features (the real thing).
- `OracleDrafter` / `AdversarialDrafter`: know the target's greedy continuation and always draft
  it / never draft it. Tests use them to pin down the schedule (all accepted / all rejected).
- `CandidateOracle`: W candidates per leaf that always / never / sometimes hold the target's
  token, for token trees (spd.tree).

Tree drafters (width W > 1) also have `candidates(state, params, gen, width)`: for every leaf
of a `spd.tree.TreeDraftState`, a list of `spd.tree.Candidate` (token, log-score, source).
"""

from __future__ import annotations

import math
import random
from typing import Protocol

import torch

from .cache import KVCache
from .pdm import PDM
from .sampling import SamplingParams, draw, probs
from .target import TreeMask
from .tree import Candidate, DraftState, ancestry


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


def draft_source(drafter) -> str:
    """Where the drafter's latest draft came from (its `last_source`; "draft" when it keeps none)."""
    return getattr(drafter, "last_source", "draft")


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
        return draw(q, gen), q

    @torch.inference_mode()
    def tree_logits(self, state) -> torch.Tensor:
        """(leaves, V) logits for every newest-level node of a token tree, in one PDM forward:
        the finished rows since the committed ones, then every in-flight node at its depth, each
        seeing the finished rows, its own ancestors and itself."""
        start, root = self.committed, state.root_position
        nodes = [node for level in state.levels for node in level]
        depths = [state.n_stages] * (root - start) + [state.depth(i) for i, level in enumerate(state.levels)
                                                      for _ in level]
        types = torch.tensor([self.pdm.type_of_depth(d) for d in depths])
        device = state.features.device
        feats = torch.cat([state.features[start:root], state.features[[node.row for node in nodes]]])
        rows = self.pdm.rows(feats, types)
        positions = torch.tensor(list(range(start, root)) + [node.position for node in nodes], device=device)
        finished, r = root - start, len(depths)
        allowed = torch.ones(r, start + r, dtype=torch.bool)
        allowed[:, start:] = torch.ones(r, r, dtype=torch.bool).tril()
        allowed[finished:, start + finished:] = ancestry(nodes)
        keys = torch.cat([torch.arange(start, device=device), positions])
        self.cache.crop(start)  # in-flight rows changed depth since last cycle: recompute them
        mask = TreeMask(keys, allowed.to(device)).additive(positions, rows.dtype)
        logits = self.pdm.forward_tree(rows, positions, self.cache, mask, len(state.leaves))
        self.committed = root
        return self.pdm.full_vocab_logits(logits)

    def candidates(self, state, params, gen, width):
        """The PDM's top-W tokens per leaf, scored by log-probability (processed like q)."""
        return [top_candidates(logits, params, width, "pdm") for logits in self.tree_logits(state)]


def top_candidates(logits: torch.Tensor, params: SamplingParams, width: int, source: str,
                   extra=None) -> list:
    """`extra` (token, probability floor) first, then the top-`width` tokens of (V,) logits."""
    logq = torch.log_softmax(logits.float(), -1) if params.greedy else probs(logits, params).log()
    values, ids = torch.topk(logq, width)
    out = []
    if extra is not None:
        token, floor = extra
        least = math.log(floor) if floor > 0 else float("-inf")   # a fitted accuracy can be 0
        out.append(Candidate(token, max(float(logq[token]), least), "retrieval"))
    out += [Candidate(int(t), float(v), source) for v, t in zip(values, ids) if v > float("-inf")]
    return out


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

    def candidates(self, state, params, gen, width):
        return [[Candidate(self.expected_at(leaf.position + 1), 0.0, "oracle")] for leaf in state.leaves]

    def expected_at(self, position: int) -> int:
        index = position - self.prompt_len
        return self.continuation[index] if index < len(self.continuation) else 0


class CandidateOracle(OracleDrafter):
    """`width` candidates per leaf; whether the target's token is among them: "always", "never",
    or "sometimes" (a seeded coin per leaf). With `best_first` the target's token, when present,
    has the top score, so its branch always survives pruning (an oracle tree); else its rank and
    every score are random."""

    def __init__(self, continuation, vocab_size: int, mode: str, seed: int = 0, best_first: bool = False):
        super().__init__(continuation)
        assert mode in ("always", "never", "sometimes")
        self.vocab_size, self.mode, self.best_first = vocab_size, mode, best_first
        self.rng = random.Random(seed)

    def candidates(self, state, params, gen, width):
        out = []
        for leaf in state.leaves:
            truth = self.expected_at(leaf.position + 1)
            others = [t for t in self.rng.sample(range(self.vocab_size), width + 1) if t != truth][:width]
            scored = [(t, -0.01 - 3 * self.rng.random()) for t in others]   # < 0: below a best-first truth
            if self.mode == "always" or (self.mode == "sometimes" and self.rng.random() < 0.5):
                if self.best_first:
                    scored = [(truth, 0.0)] + scored[:width - 1]
                else:
                    scored[self.rng.randrange(width)] = (truth, -0.01 - 3 * self.rng.random())
            out.append([Candidate(t, score, "oracle") for t, score in scored])
        return out

    def draft(self, state, params, gen):
        raise NotImplementedError("CandidateOracle drafts token trees (width > 1) only")


class AdversarialDrafter(OracleDrafter):
    """Never drafts the given continuation: every draft rejected under greedy verification."""

    def __init__(self, continuation: list[int], vocab_size: int):
        super().__init__(continuation)
        self.vocab_size = vocab_size

    def draft(self, state, params, gen):
        return (self.expected(state) + 1) % self.vocab_size, None

    def candidates(self, state, params, gen, width):
        return [[Candidate((self.expected_at(leaf.position + 1) + 1) % self.vocab_size, 0.0, "oracle")]
                for leaf in state.leaves]
