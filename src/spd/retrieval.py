"""Retrieval drafting: predict the next token from the sequence itself, beside or instead of a PDM.

`SuffixIndex` answers, for the newest position of one sequence (prompt, verified tokens and
in-flight drafts), "which token followed the most recent earlier occurrence of the longest suffix
that occurred before, and how long is that suffix" (capped at `max_len` tokens). It keeps one
table per suffix length k (the last k tokens -> the newest position they ended at), so appending a
token costs O(max_len) table writes and the answer for the new position is found while writing;
an undo log restores overwritten entries when a rejection truncates the tail, so truncation costs
the same per dropped token. Memory is O(max_len) entries per position: linear in the context.

Drafters (the engine's drafter protocol, `spd.drafters`):
- `RetrievalDrafter`: the retrieved token when there is a match, else the newest token again;
  needs no PDM, no training and no target features, so any model gets useful drafts.
- `HybridDrafter`: retrieval beside a PDM. A `Gate` picks the source from what exists before
  verification: the match length, the PDM's top-1 probability and whether the two agree. Where the
  gate would take the retrieved token whatever the PDM says, the PDM forward is skipped.
A retrieved draft is a point mass (q = None), so sampling verification stays exact (SPEC 5).
Every drafter sets `last_source` ("pdm", "retrieval", "both" when they agree, "none") so the
engine can count acceptance per source.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .drafters import Candidate, PDMDrafter, top_candidates
from .pdm import PDM
from .sampling import draw, probs

GATE_FILE = "retrieval_gate.json"   # beside pdm_config.json in a PDM checkpoint folder
# In a token tree, a retrieved candidate scores at least this probability by match length 1..8
# (roughly how often a match of that length predicted the next token on training-like text);
# a fitted gate's `accuracy` replaces it (`Gate.prior`).
RETRIEVAL_PRIOR = (0.15, 0.3, 0.45, 0.55, 0.65, 0.7, 0.75, 0.8)


def retrieval_prior(match_len: int) -> float:
    return RETRIEVAL_PRIOR[min(match_len, len(RETRIEVAL_PRIOR)) - 1]


class SuffixIndex:
    """Longest-earlier-suffix lookup over one growing (and sometimes truncated) token sequence."""

    def __init__(self, max_len: int = 8):
        assert max_len >= 1
        self.max_len = max_len
        self.tokens: list[int] = []
        self._tables: list[dict[tuple, int]] = [{} for _ in range(max_len)]  # [k-1]: suffix -> end
        self._undo: list[list[tuple[int, tuple, int | None]]] = []  # per position: (k, key, old end)
        self._match_end: list[int] = []   # per position: end of its longest earlier match, or -1
        self._match_len: list[int] = []   # per position: that match's length (0: none)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))
        t = len(self.tokens) - 1
        undo, best_end, best_len = [], -1, 0
        for k in range(1, min(self.max_len, t + 1) + 1):
            key = tuple(self.tokens[t - k + 1:])
            table = self._tables[k - 1]
            old = table.get(key)
            if old is not None:          # an earlier occurrence: longer k overrides shorter
                best_end, best_len = old, k
            table[key] = t
            undo.append((k, key, old))
        self._undo.append(undo)
        self._match_end.append(best_end)
        self._match_len.append(best_len)

    def truncate(self, length: int) -> None:
        """Forget every position >= length (a rejection dropped them)."""
        while len(self.tokens) > length:
            for k, key, old in reversed(self._undo.pop()):
                if old is None:
                    del self._tables[k - 1][key]
                else:
                    self._tables[k - 1][key] = old
            self.tokens.pop()
            self._match_end.pop()
            self._match_len.pop()

    def sync(self, tokens: list[int], stable: int = 0) -> None:
        """Make the index hold exactly `tokens`; `tokens[:stable]` is known to be unchanged since
        the last sync (verified tokens never change), so only the tail after it is compared."""
        i = min(stable, len(self.tokens), len(tokens))
        while i < len(self.tokens) and i < len(tokens) and self.tokens[i] == tokens[i]:
            i += 1
        self.truncate(i)
        for token in tokens[i:]:
            self.append(token)

    def lookup(self) -> tuple[int | None, int]:
        """(token that followed the newest position's longest earlier match, match length);
        (None, 0) when even the newest token never occurred before."""
        if not self.tokens or self._match_len[-1] == 0:
            return None, 0
        return self.tokens[self._match_end[-1] + 1], self._match_len[-1]

    def continuation(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the newest position's match (a retrieved chain)."""
        if not self.tokens or self._match_len[-1] == 0:
            return []
        start = self._match_end[-1] + 1
        return self.tokens[start:start + length]


@dataclass
class Gate:
    """When the hybrid drafter takes the retrieved token instead of the PDM's top-1.

    For a match of length L (capped at `max_len`), retrieval wins when L >= `min_len` and the
    PDM's top-1 probability is below `threshold[L-1]`; a threshold above 1 means retrieval always
    wins at that length, so the PDM forward is skipped there. Fitted by `fit_gate` on training
    conversations; `Gate()` serves checkpoints saved without one. `accuracy[L-1]` is how often a
    retrieved token of match length L was right there where the PDM's top-1 was another token:
    in a token tree the retrieved candidate scores at least that (`prior`).

    Greedy decoding can also adapt to the sequence (`adapt` = w > 0): where retrieval and the PDM's
    top-1 disagreed earlier in this sequence and the verified token is known, lead = (retrieval
    right - PDM right) / disagreements, in [-1, 1], and the threshold moves by w * lead. Code and
    text being reworked make retrieval right more often than the open chat a gate is fitted on.
    A length the fit never hands to retrieval then holds a threshold below -w, one it always does
    above 1 + w.

    Sampling (T > 0) has its own thresholds (`sampled_*`, fitted at `sampled_temperature`): there a
    retrieved token, a point mass, is accepted with the target's probability of it, p(token), and
    the PDM's sampled draft with sum_x min(p, q), so retrieval pays off less often than greedy
    (an argmax that is right is still often rejected at T = 1). A gate without them (fitted before
    they existed) uses the greedy thresholds for sampling too.
    """

    min_len: int = 2
    max_len: int = 8
    threshold: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.8, 0.9, 1.01, 1.01, 1.01, 1.01])
    fitted_on: str = "default (not fitted)"
    accuracy: list[float] | None = None
    sampled_min_len: int | None = None
    sampled_threshold: list[float] | None = None
    sampled_temperature: float | None = None
    adapt: float = 0.0

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len or len(self.threshold) != self.max_len:
            raise ValueError(f"gate needs 1 <= min_len <= max_len and max_len thresholds; got "
                             f"min_len={self.min_len}, max_len={self.max_len}, {len(self.threshold)} thresholds")
        if self.accuracy is not None and (len(self.accuracy) != self.max_len or not all(0 <= a <= 1 for a in self.accuracy)):
            raise ValueError(f"gate accuracy needs max_len={self.max_len} values in [0, 1]; got {self.accuracy}")
        if (self.sampled_threshold is None) != (self.sampled_min_len is None) or (
                self.sampled_threshold is not None and len(self.sampled_threshold) != self.max_len):
            raise ValueError(f"a gate's sampled thresholds need sampled_min_len and max_len={self.max_len} "
                             f"values; got {self.sampled_min_len}, {self.sampled_threshold}")
        if not 0 <= self.adapt <= 1:
            raise ValueError(f"gate adapt must be in [0, 1]; got {self.adapt}")

    def prior(self, match_len: int) -> float:
        """The least score of a retrieved candidate in a token tree, by its match length."""
        if self.accuracy is None:
            return retrieval_prior(match_len)
        return self.accuracy[min(match_len, self.max_len) - 1]

    def _cut(self, match_len: int, sampling: bool, lead: float) -> float:
        """The threshold for this match length, moved by the sequence's lead when greedy (never
        retrieval below the minimum length)."""
        sampled = sampling and self.sampled_threshold is not None
        min_len, thresholds = ((self.sampled_min_len, self.sampled_threshold) if sampled
                               else (self.min_len, self.threshold))
        if match_len < min_len:
            return 0.0
        return thresholds[min(match_len, self.max_len) - 1] + (0.0 if sampling else self.adapt * lead)

    def skips_pdm(self, match_len: int, sampling: bool = False, lead: float = 0.0) -> bool:
        return self._cut(match_len, sampling, lead) > 1.0

    def takes_retrieval(self, match_len: int, pdm_top1: float, sampling: bool = False, lead: float = 0.0) -> bool:
        return pdm_top1 < self._cut(match_len, sampling, lead)

    def save(self, folder) -> Path:
        path = Path(folder) / GATE_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, folder) -> "Gate":
        """The gate saved beside a PDM checkpoint, or the documented default when it has none."""
        path = Path(folder) / GATE_FILE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path} is not a valid retrieval gate ({err}); delete it to use the "
                             f"default gate, or refit it with `spd gate`") from None


class Disputes:
    """Where retrieval and the PDM's top-1 disagreed along one sequence, and retrieval's lead over the
    PDM at those already verified: (retrieval right - PDM right) / settled disputes, in [-1, 1]."""

    def __init__(self):
        self.open: dict[int, tuple[int, int]] = {}   # position -> (retrieved, PDM top-1), not yet verified
        self.settled, self.retrieval_lead = 0, 0

    def add(self, position: int, retrieved: int, top1: int) -> None:
        self.open[position] = (retrieved, top1)

    def lead(self, drafting: int, first_inflight: int, verified) -> float:
        """The lead when drafting position `drafting`: disputes before `first_inflight` are settled
        against `verified(position)`, those at `drafting` or later were dropped by a rejection."""
        for p in [p for p in self.open if p >= drafting or p < first_inflight]:
            retrieved, top1 = self.open.pop(p)
            if p < drafting:
                token = verified(p)
                self.settled += 1
                self.retrieval_lead += (retrieved == token) - (top1 == token)
        return self.retrieval_lead / self.settled if self.settled else 0.0


class RetrievalDrafter:
    """Drafts the retrieved token; with no match, the newest token again (a guess, rarely right)."""

    anchors: list[int] = []
    after_stages = False

    def __init__(self, max_len: int = 8):
        self.index = SuffixIndex(max_len)
        self.last_source = "none"

    def begin(self, prompt_len: int) -> None:
        self.index = SuffixIndex(self.index.max_len)

    def draft(self, state, params, gen):
        self.index.sync(state.tokens, state.first_inflight)
        token, _ = self.index.lookup()
        self.last_source = "none" if token is None else "retrieval"
        return (state.tokens[-1] if token is None else token), None

    def candidates(self, state, params, gen, width):
        """One candidate per leaf of a token tree: its retrieved token (else its own token again)."""
        out = []
        for leaf in state.leaves:
            self.index.sync(state.path(leaf), state.root_position)
            token, match_len = self.index.lookup()
            out.append([Candidate(token, math.log(retrieval_prior(match_len)), "retrieval") if token is not None
                        else Candidate(leaf.token, math.log(0.01), "none")])
        return out


class HybridDrafter:
    """Retrieval beside a PDM, one source per draft chosen by a `Gate` (see the module docstring)."""

    after_stages = False

    def __init__(self, pdm: PDM, gate: Gate | None = None):
        self.pdm_drafter = PDMDrafter(pdm)
        self.anchors = self.pdm_drafter.anchors
        self.gate = gate or Gate()
        self.begin(0)
        self.last_source = "none"

    def begin(self, prompt_len: int) -> None:
        self.pdm_drafter.begin(prompt_len)
        self.index = SuffixIndex(self.gate.max_len)
        self.disputes = Disputes()

    def draft(self, state, params, gen):
        self.index.sync(state.tokens, state.first_inflight)
        retrieved, match_len = self.index.lookup()
        sampling = not params.greedy
        adapting = self.gate.adapt > 0 and not sampling
        lead = self.disputes.lead(len(state.tokens), state.first_inflight, state.tokens.__getitem__) if adapting else 0.0
        if retrieved is not None and self.gate.skips_pdm(match_len, sampling, lead):
            self.last_source = "retrieval"   # the PDM catches up on these rows at its next forward
            return retrieved, None
        logits = self.pdm_drafter.logits(state)
        top1_p, top1 = torch.softmax(logits, -1).max(-1)
        if retrieved is not None and retrieved != int(top1):
            if adapting:
                self.disputes.add(len(state.tokens), retrieved, int(top1))
            if self.gate.takes_retrieval(match_len, float(top1_p), sampling, lead):
                self.last_source = "retrieval"
                return retrieved, None
        self.last_source = "both" if retrieved == int(top1) else "pdm"
        if params.greedy:
            return int(top1), None
        q = probs(logits, params)
        return draw(q, gen), q

    def candidates(self, state, params, gen, width):
        """Per leaf of a token tree: its retrieved token (scored at least the gate's prior for the
        match length), then the PDM's top-W; one batched PDM forward for all leaves."""
        out = []
        for leaf, logits in zip(state.leaves, self.pdm_drafter.tree_logits(state)):
            self.index.sync(state.path(leaf), state.root_position)
            retrieved, match_len = self.index.lookup()
            extra = None if retrieved is None else (retrieved, self.gate.prior(match_len))
            out.append(top_candidates(logits, params, width, "pdm", extra))
        return out


DRAFTERS = ("hybrid", "pdm", "retrieval")


def drafter_kind(kind: str | None, has_pdm: bool) -> str:
    """The drafter to use: the one asked for, else hybrid with a PDM and retrieval without."""
    if kind is None:
        return "hybrid" if has_pdm else "retrieval"
    if kind not in DRAFTERS:
        raise ValueError(f"--drafter must be one of {', '.join(DRAFTERS)}; got {kind!r}")
    return kind


def make_drafter(kind: str, pdm: PDM | None, gate: Gate | None = None):
    """A fresh drafter of `kind` (one per sequence stream; they hold per-sequence state)."""
    if kind == "retrieval":
        return RetrievalDrafter(gate.max_len if gate else 8)
    if pdm is None:
        raise ValueError(f"the {kind} drafter needs a PDM; give --pdm or use --drafter retrieval")
    return PDMDrafter(pdm) if kind == "pdm" else HybridDrafter(pdm, gate)
