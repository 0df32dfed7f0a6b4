"""The control rank: embedding, drafting, final norm + lm_head, verification; drives the stages.

`Controller.stream` is the engine's schedule (spd.engine.stream) with the stage step done by
other processes. It reuses the engine's pieces -- `Pipeline` (which positions run which stage,
admit, settle = verify + truncate), `store_snapshots`, `DraftState`, the drafters and
`sampling.verify` -- so the two loops cannot drift apart. Per cycle:

1. broadcast the command (newest/oldest in-flight positions, and the crop of the last
   rejection), send the newest token's embedding to stage 0 (or run stage 0 here);
2. draft from pre-step features while the stages compute (PPSD-style drafters: after step 3);
3. take the stages' reports: anchor hidden states for the PDM, and the finished token;
4. if a token finished: lm_head + verify; a rejection becomes the next command's crop.

Timing of every cycle is kept for the breakdown (PDM, slowest stage, verify, communication,
idle) that `breakdown` computes once the stages sent their compute times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..drafters import Drafter
from ..engine import Pipeline, SPDStats, store_snapshots
from ..sampling import SamplingParams, sample
from ..target import Target
from .layout import CONTROL_RANK, Layout
from .protocol import Command, Link, Op, report_indices
from .stage import StageWorker, now


@dataclass
class CycleTimes:
    """One decode cycle as the control rank saw it (seconds)."""

    total: float = 0.0      # start of this cycle to start of the next
    local_stage: float = 0.0  # stage 0 run here (with-first-stage)
    pdm: float = 0.0
    reports: float = 0.0    # start of the cycle until the last report arrived
    verify: float = 0.0


@dataclass
class DistributedStats(SPDStats):
    """SPDStats plus the per-cycle breakdown of the distributed runtime (milliseconds)."""

    breakdown: dict = field(default_factory=dict)


def breakdown(cycles: list[CycleTimes], stage_times: list[list[float]]) -> dict:
    """Mean per-cycle milliseconds: cycle, PDM, slowest stage, verify, communication, idle.

    stage_times[k][c] is stage k's compute in cycle c (0 when it idled). communication is the
    exposed part: the time until the last report minus the longer of the control's own work
    before it (stage 0 here, PDM) and the slowest stage. idle is the mean over stages of the
    cycle time a stage spent not computing.
    """
    if not cycles:
        return {}
    count = len(cycles)
    slowest = [max(times[c] for times in stage_times) for c in range(count)]
    exposed = [max(0.0, cy.reports - max(cy.local_stage + cy.pdm, slow)) for cy, slow in zip(cycles, slowest)]
    idle = [cy.total - sum(times[c] for times in stage_times) / len(stage_times) for c, cy in enumerate(cycles)]
    mean = lambda values: 1000.0 * sum(values) / count  # noqa: E731
    return {"cycles": count, "cycle_ms": mean([c.total for c in cycles]), "pdm_ms": mean([c.pdm for c in cycles]),
            "slowest_stage_ms": mean(slowest), "verify_ms": mean([c.verify for c in cycles]),
            "communication_ms": mean(exposed), "idle_ms": mean(idle),
            "stage_ms": [mean(times) for times in stage_times]}


class Controller:
    """Rank 0 of a distributed run. `target` holds embedding, norm, lm_head (+ stage 0 if local)."""

    def __init__(self, target: Target, layout: Layout, link: Link, anchors, local: StageWorker | None):
        assert target.embed_tokens is not None and target.lm_head is not None, "control needs embed + head"
        assert (local is not None) == layout.colocated
        self.target, self.layout, self.link, self.local = target, layout, link, local
        self.anchors = sorted(set(anchors))
        n = layout.n_stages
        self.rows = [report_indices(layout.stages[k], self.anchors, layout.num_layers, k == n - 1)
                     for k in range(n)]

    # -- one cycle's messages -------------------------------------------------------------------
    def _post_reports(self, stages, length: int) -> dict:
        return {k: self.link.post((len(self.rows[k]), length, self.target.hidden_size), self.target.dtype,
                                  self.layout.stage_rank(k), f"the report of stage {k}")
                for k in stages if self.rows[k] and self.layout.stage_rank(k) != CONTROL_RANK}

    def _issue(self, command: Command, hidden: torch.Tensor, stages) -> tuple[dict, dict, float]:
        """Broadcast, hand stage 0 its input, run stage 0 here if local: (posted, reports, local s)."""
        self.link.broadcast(command)
        posted = self._post_reports(stages, hidden.shape[1])
        reports, local_seconds = {}, 0.0
        if self.local is not None:
            t = now(self.link.device)
            reports[0] = self.local.handle(command, hidden)
            local_seconds = now(self.link.device) - t
        else:
            self.link.send(hidden, self.layout.stage_rank(0), "the input of stage 0")
        return posted, reports, local_seconds

    def _collect(self, posted: dict, reports: dict, positions: dict, features, column) -> torch.Tensor | None:
        """Wait for the reports and store their anchors (stage k's are about positions[k]).
        Returns the last stage's output rows (q, H), or None when it did not run."""
        for k, message in posted.items():
            reports[k] = self.link.take(message)
        self.link.flush(before_cycle=True)
        for k, report in reports.items():
            if report is not None:
                store_snapshots(features, positions[k], dict(zip(self.rows[k], report)), column)
        last = reports.get(self.layout.n_stages - 1)
        return None if last is None else last[-1]   # row L is the last report row

    # -- the schedule -----------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, drafter: Drafter, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
               max_new_tokens: int = 128, eos_token_ids=(), stats: DistributedStats | None = None,
               cycles: list[CycleTimes] | None = None) -> Iterator[int]:
        """Yield the verified new tokens of one sequence (the same tokens engine.stream yields)."""
        n, target, device = self.layout.n_stages, self.target, self.link.device
        assert len(prompt_ids) >= 1
        missing = sorted(set(drafter.anchors) - set(self.anchors))
        if missing:
            raise ValueError(f"the drafter needs anchors {missing} that this run does not record "
                             f"(it records {self.anchors}); start the run with the drafter's anchors")
        stats = stats if stats is not None else DistributedStats(n)
        stats.n_stages, stats.prompt_tokens, stats.stage_seconds = n, len(prompt_ids), [0.0] * n
        cycles = cycles if cycles is not None else []
        if max_new_tokens < 1:
            return
        eos, gen = set(eos_token_ids), params.generator(device)
        column = {anchor: i for i, anchor in enumerate(drafter.anchors)}
        capacity = len(prompt_ids) + max_new_tokens + n + 1
        features = torch.zeros(capacity, len(column), target.hidden_size, device=device, dtype=target.dtype)

        # Prefill: the prompt through every stage in turn; the first token is the target's own.
        t0 = now(device)
        length = len(prompt_ids)
        hidden = target.embed(torch.tensor(prompt_ids, device=device))
        store_snapshots(features, slice(0, length), {0: hidden[0]}, column)
        posted, reports, _ = self._issue(Command(Op.PREFILL, newest=length - 1, first=0, crop=0), hidden, range(n))
        last = self._collect(posted, reports, dict.fromkeys(range(n), slice(0, length)), features, column)
        tokens = list(prompt_ids) + [sample(target.logits(last[-1]), params, gen)]
        stats.prefill_seconds, stats.new_tokens = now(device) - t0, 1
        yield tokens[-1]
        if tokens[-1] in eos or max_new_tokens == 1:
            return

        drafter.begin(length)
        pipe = Pipeline(tokens, first_inflight=length, n_stages=n)
        crop = -1
        t_decode = now(device)
        while True:
            cycle, t0 = CycleTimes(), now(device)
            work = pipe.work()
            command = Command(Op.STEP, newest=pipe.newest, first=pipe.first_inflight, crop=crop)
            hidden = target.embed(torch.tensor(tokens[-1:], device=device))   # depth-0 feature
            store_snapshots(features, [pipe.newest], {0: hidden[0]}, column)
            posted, reports, cycle.local_stage = self._issue(command, hidden, [k for _, k in work])
            if not drafter.after_stages:   # concurrently with the stages
                t = now(device)
                draft, q = drafter.draft(pipe.draft_state(features), params, gen)
                cycle.pdm = now(device) - t
            finished = self._collect(posted, reports, {k: [p] for p, k in work}, features, column)
            cycle.reports = now(device) - t0
            stats.cycles += 1
            if drafter.after_stages:   # PPSD-style: from the newest token's stage-1 output
                t = now(device)
                draft, q = drafter.draft(pipe.draft_state(features, stepped=True), params, gen)
                cycle.pdm = now(device) - t
            pipe.admit(draft, q)
            crop, token = -1, None
            if len(work) == n:   # the oldest token finished all n stages: verify the next one
                t = now(device)
                accepted, token, checked = pipe.settle(target.logits(finished[0]), params, gen)
                stats.accepted += accepted
                stats.rejected += not accepted
                crop = -1 if accepted else checked   # every stage crops there next cycle
                cycle.verify = now(device) - t
            stats.pdm_seconds += cycle.pdm
            stats.verify_seconds += cycle.verify
            cycle.total = now(device) - t0
            cycles.append(cycle)
            if token is not None:
                stats.new_tokens += 1
                stats.decode_seconds = now(device) - t_decode
                yield token
                if token in eos or stats.new_tokens >= max_new_tokens:
                    return

    def gather_timings(self, cycles: int) -> list[list[float]]:
        """STATS: every stage's [prefill, per-cycle compute seconds] of the current sequence."""
        self.link.broadcast(Command(Op.STATS))
        posted = {k: self.link.post((cycles + 1,), torch.float64, self.layout.stage_rank(k),
                                    f"the timings of stage {k}")
                  for k in range(self.layout.n_stages) if self.layout.stage_rank(k) != CONTROL_RANK}
        times = {k: self.link.take(message).tolist() for k, message in posted.items()}
        if self.local is not None:
            times[0] = self.local.timings().tolist()
        self.link.flush()
        return [times[k] for k in range(self.layout.n_stages)]

    def stop(self) -> None:
        self.link.broadcast(Command(Op.STOP))
        self.link.flush()
