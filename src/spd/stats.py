"""What a decode records: `SPDStats` (counts and seconds of one sequence, the numbers every
report reads) and `CycleTimes` (one cycle as the loop saw it), and `now`, the clock they use.

Filled by spd.engine.stream (and the distributed controller, which runs the same loop);
nothing here decodes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class SPDStats:
    n_stages: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    cycles: int = 0
    accepted: int = 0
    rejected: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    pdm_seconds: float = 0.0
    verify_seconds: float = 0.0
    stage_seconds: list[float] = field(default_factory=list)
    # per verified draft, by pipeline fill f (tokens in flight when it was drafted, 1..n; n = steady
    # state, 1 = first draft after a rejection): index f-1 counts verified / accepted drafts
    verified_by_fill: list[int] = field(default_factory=list)
    accepted_by_fill: list[int] = field(default_factory=list)
    # per verified draft, by where it came from (the drafter's `last_source`: pdm, retrieval,
    # both = retrieval agreed with the PDM, ...): source -> [verified, accepted]
    drafts_by_source: dict[str, list[int]] = field(default_factory=dict)
    tree_width: int = 1              # W: candidates kept per pipeline level
    verified_candidates: int = 0     # candidates of all verified positions (mean width = this / verified)
    stage_tokens: int = 0            # tokens run through one stage, summed (W x levels per cycle)
    # cycles that ran a stage step, by their widest level (a cycle lasts as long as its slowest
    # stage: the bench prices a level of w tokens at its measured cost); a looked-ahead cycle
    # thrown away is in `cycles` only
    cycles_by_width: dict[int, int] = field(default_factory=dict)

    def begin(self, n: int, prompt_len: int, tree_width: int) -> None:
        """A sequence starts: n stages, its prompt, W candidates per level."""
        self.n_stages, self.prompt_tokens, self.stage_seconds = n, prompt_len, [0.0] * n
        self.verified_by_fill, self.accepted_by_fill = [0] * n, [0] * n
        self.tree_width = tree_width

    def add_cycle(self, level_widths: list[int]) -> None:
        """One stage step: each level of `level_widths` tokens ran its stage."""
        self.cycles += 1
        self.stage_tokens += sum(level_widths)
        widest = max(level_widths, default=1)
        self.cycles_by_width[widest] = self.cycles_by_width.get(widest, 0) + 1

    def count(self, fill: int, source: str, accepted: bool) -> None:
        """One verified draft: drafted at pipeline fill `fill` by `source`."""
        self.verified_by_fill[fill - 1] += 1
        self.accepted_by_fill[fill - 1] += accepted
        counts = self.drafts_by_source.setdefault(source, [0, 0])
        counts[0] += 1
        counts[1] += accepted
        if accepted:
            self.accepted += 1
        else:
            self.rejected += 1

    def source_acceptance(self) -> dict[str, dict]:
        """{source: {share, acceptance}}: share of verified drafts, accepted fraction of its own."""
        total = sum(v for v, _ in self.drafts_by_source.values())
        return {name: {"share": v / total, "acceptance": a / v if v else 0.0}
                for name, (v, a) in sorted(self.drafts_by_source.items())}

    @property
    def acceptance_rate(self) -> float:
        """Verified tokens per cycle (<= 1)."""
        return self.new_tokens / self.cycles if self.cycles else 0.0

    @property
    def equivalent_accept_length(self) -> float:
        """n * N / C: the theoretical speedup with balanced stages and a hidden PDM."""
        return self.n_stages * self.acceptance_rate

    @property
    def per_draft_acceptance(self) -> float:
        verified = self.accepted + self.rejected
        return self.accepted / verified if verified else 0.0

    @property
    def mean_width(self) -> float:
        """Candidates per verified position (1 for the chain)."""
        verified = self.accepted + self.rejected
        return self.verified_candidates / verified if verified else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which prefill yields) per second of decoding."""
        return (self.new_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("acceptance_rate", "equivalent_accept_length", "per_draft_acceptance",
                     "mean_width", "decode_tokens_per_second"):
            out[name] = getattr(self, name)
        out["source_acceptance"] = self.source_acceptance()
        return out


@dataclass
class CycleTimes:
    """One decode cycle as the loop saw it (seconds); the distributed runtime fills all of it."""

    total: float = 0.0      # start of this cycle to start of the next
    local_stage: float = 0.0  # stage 0 run in the control process (with-first-stage)
    own: float = 0.0        # start until the control rank began to wait for reports (its own work)
    pdm: float = 0.0
    reports: float = 0.0    # start of the cycle until the last report arrived
    verify: float = 0.0


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
