"""The control rank: embedding, drafting, final norm + lm_head, verification; drives the stages.

The schedule is `engine.stream`'s, the one decode loop: the Controller is its stage runner (the
methods of `stages.LocalStages`), so the single-process and distributed runs cannot drift apart.
What it adds is where the stage work happens. Per cycle:

1. `step`: broadcast the command (newest/oldest in-flight positions, the crop of the last
   rejection; with W > 1 also the tree shape: the child the last verification kept and every
   stage's nodes), send the newest level's embedding to stage 0 (or `start` runs stage 0 here);
2. the loop drafts from pre-step features while the stages compute;
3. `finish`: take the stages' reports: anchor hidden states for the PDM, and the finished token
   (its hidden state, or -- head on the last stage -- its argmax / logits computed there);
4. the loop verifies (`logits`: lm_head here unless the last stage did it); `prune` keeps a
   rejection's crop or a kept child (W > 1) for the next command. With lookahead the loop issues
   the next cycle before verifying and `waste`s it after a rejection.

Timing of every cycle is kept for the breakdown (PDM, slowest stage, verify, communication,
idle) that `breakdown` computes once the stages sent their compute times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..drafters import Drafter
from ..engine import stream
from ..lookahead import LookaheadPolicy
from ..sampling import SamplingParams, sample
from ..stages import store_snapshots
from ..stats import CycleTimes, SPDStats
from ..target import Target
from ..tree import Node, TreeConfig, TreePipeline
from .layout import CONTROL_RANK, Layout
from .protocol import Command, Link, Op, report_indices
from .stage import StageWorker, now


@dataclass
class DistributedStats(SPDStats):
    """SPDStats plus the per-cycle breakdown of the distributed runtime (milliseconds)."""

    breakdown: dict = field(default_factory=dict)


def breakdown(cycles: list[CycleTimes], stage_times: list[list[float]]) -> dict:
    """Mean per-cycle milliseconds: cycle, PDM, slowest stage, verify, communication, idle.

    stage_times[k][c] is stage k's compute in cycle c (0 when it idled). communication is the
    exposed part: the time until the last report minus the longer of the control's own work
    before it (stage 0 here, PDM, the previous verify under lookahead) and the slowest stage.
    idle is the mean over stages of the cycle time a stage spent not computing.
    """
    if not cycles:
        return {}
    count = len(cycles)
    slowest = [max(times[c] for times in stage_times) for c in range(count)]
    exposed = [max(0.0, cy.reports - max(cy.own, slow)) for cy, slow in zip(cycles, slowest)]
    idle = [cy.total - sum(times[c] for times in stage_times) / len(stage_times) for c, cy in enumerate(cycles)]
    mean = lambda values: 1000.0 * sum(values) / count  # noqa: E731
    return {"cycles": count, "cycle_ms": mean([c.total for c in cycles]), "pdm_ms": mean([c.pdm for c in cycles]),
            "slowest_stage_ms": mean(slowest), "verify_ms": mean([c.verify for c in cycles]),
            "communication_ms": mean(exposed), "idle_ms": mean(idle),
            "stage_ms": [mean(times) for times in stage_times]}


@dataclass
class Issued:
    """A cycle whose command went out: what it runs, and the reports still to take."""

    command: Command
    work: list[tuple]                # (feature rows: a slice or a list, stage k), newest first
    hidden: torch.Tensor | None      # stage 0's input (None: stage 0 idles)
    posted: dict                     # stage k -> pending report receive
    verdict: tuple | None            # pending receive of the last stage's argmax / logits (head there)
    times: CycleTimes
    start: float
    levels: list[tuple[list[Node], int]] = field(default_factory=list)   # a STEP's (tree level, stage k)
    reports: dict = field(default_factory=dict)


class Controller:
    """Rank 0 of a distributed run. `target` holds embedding, norm, lm_head (+ stage 0 if local).

    With lookahead the next cycle is issued (assuming acceptance) before verifying, so lm_head and
    verification overlap the stages' next step; a rejection then wastes that one cycle. Tokens,
    drafts and accept/reject decisions are the engine's either way; only the cycle count moves.
    """

    def __init__(self, target: Target, layout: Layout, link: Link, anchors, local: StageWorker | None,
                 lookahead: str = "off", board=None, tree: TreeConfig = TreeConfig()):
        assert target.embed_tokens is not None and target.lm_head is not None, "control needs embed + head"
        assert (local is not None) == layout.colocated
        self.target, self.layout, self.link, self.local = target, layout, link, local
        self.lookahead, self.tree = lookahead, tree
        self.board = board   # the status board that shows stage 1 a long local prefill (with-first-stage)
        LookaheadPolicy(lookahead)   # a bad mode fails here
        if tree.width > 1 and lookahead != "off":
            raise ValueError(f"--lookahead {lookahead} needs tree width 1 (it assumes the one draft is "
                             f"accepted); use --lookahead off with --tree-width {tree.width}")
        self._last: Issued | None = None   # the latest STEP, whose total the next command closes
        self.anchors = sorted(set(anchors))
        n = layout.n_stages
        self.rows = [report_indices(layout.stages[k], self.anchors, layout.num_layers,
                                    k == n - 1 and not layout.head_on_last) for k in range(n)]
        self._sample = 0   # this sequence samples: a last stage holding the head sends logits
        self._crop, self._accepted = -1, -1   # the last verification's cut, for the next command
        self.cycles: list[CycleTimes] = []    # the current sequence's STEPs, in order

    # -- one cycle's messages -------------------------------------------------------------------
    def _close_times(self, t: float) -> None:
        """A cycle's total runs from its command to the next one's (or to the end)."""
        if self._last is not None:
            self._last.times.total = t - self._last.start
        self._last = None

    def _issue(self, command: Command, hidden: torch.Tensor | None, work, levels=()) -> Issued:
        """Broadcast the command, post the report receives, send stage 0 its input (if remote)."""
        start = now(self.link.device)
        self._close_times(start)
        self.link.broadcast(command)
        count = lambda rows: len(range(rows.stop)[rows]) if isinstance(rows, slice) else len(rows)  # noqa: E731
        posted = {k: self.link.post((len(self.rows[k]), count(rows), self.target.hidden_size), self.target.dtype,
                                    self.layout.stage_rank(k), f"the report of stage {k}")
                  for rows, k in work if self.rows[k] and self.layout.stage_rank(k) != CONTROL_RANK}
        verdict = None
        last = self.layout.n_stages - 1
        if self.layout.head_on_last and any(k == last for _, k in work):
            shape, dtype = ((self.target.vocab_size,), torch.float32) if command.sample else ((1,), torch.long)
            verdict = self.link.post(shape, dtype, self.layout.stage_rank(last), "the verdict input of the last stage")
        assert (hidden is not None) == any(k == 0 for _, k in work), "stage 0 runs iff it gets an input"
        if self.local is None and hidden is not None:
            self.link.send(hidden, self.layout.stage_rank(0), "the input of stage 0")
        issued = Issued(command, work, hidden, posted, verdict, CycleTimes(), start, list(levels))
        self._last = issued if command.op == Op.STEP else None
        return issued

    def _run_local(self, cycle: Issued) -> None:
        """Stage 0's share of the cycle when it lives in this process."""
        if self.local is not None:
            if self.board is not None:
                self.board.set("computing prefill" if cycle.command.op == Op.PREFILL else "computing")
            t = now(self.link.device)
            cycle.reports[0] = self.local.handle(cycle.command, cycle.hidden)
            cycle.times.local_stage = now(self.link.device) - t
            if self.board is not None:
                self.board.set("control")

    def _collect(self, cycle: Issued, features, column, patient: bool = False) -> torch.Tensor | None:
        """Wait for the cycle's reports and store their anchors; what the last stage sent about
        the finished token (see `logits`), or None when it did not run. `patient`: the prefill,
        which may compute for long."""
        cycle.times.own = now(self.link.device) - cycle.start
        for k, message in cycle.posted.items():
            cycle.reports[k] = self.link.take(message, patient)
        verdict = self.link.take(cycle.verdict, patient) if cycle.verdict is not None else None
        self.link.flush(before_cycle=True)
        rows = {k: rows for rows, k in cycle.work}
        for k, report in cycle.reports.items():
            if report is not None:
                store_snapshots(features, rows[k], dict(zip(self.rows[k], report)), column)
        cycle.times.reports = now(self.link.device) - cycle.start
        if self.layout.head_on_last:
            return verdict
        last = cycle.reports.get(self.layout.n_stages - 1)
        return None if last is None else last[-1]   # row L is the last report row

    def logits(self, finished: torch.Tensor) -> torch.Tensor:
        """(V,) target logits of the finished token, for `sample` / `engine.settle`: from its
        (q, H) pre-norm rows here, or as the last stage sent them. A greedy last stage sends only
        the argmax, which is all greedy verification reads: a one-hot stands for the logits."""
        if not self.layout.head_on_last:
            return self.target.logits(finished[-1])
        if finished.dtype == torch.long:
            return torch.nn.functional.one_hot(finished[0], self.target.vocab_size).float()
        return finished

    # -- the stage runner of engine.stream (see stages.LocalStages) ----------------------------------
    @property
    def n_stages(self) -> int:
        return self.layout.n_stages

    def step(self, pipe: TreePipeline, work, hidden: torch.Tensor | None, first: int | None = None) -> Issued:
        """Issue the STEP of `work` ((level, stage k), newest first; `hidden`: the embedding of
        the level at depth 0, if one is), with the crop or pruning of the last verification.
        W = 1: the chain's command, positions first..newest."""
        # a looked-ahead step goes out before verification, so no cut is pending (and W = 1)
        assert first is None or (self._crop, self._accepted) == (-1, -1)
        first = pipe.root.position if first is None else first
        tree = tuple(pipe.shape(work, self._accepted).encode(pipe.width)) if pipe.width > 1 else ()
        command = Command(Op.STEP, newest=pipe.newest[0].position, first=first, crop=self._crop, sample=self._sample,
                          tree=tree)
        self._crop, self._accepted = -1, -1
        issued = self._issue(command, hidden, [([node.row for node in level], k) for level, k in work], work)
        self.cycles.append(issued.times)
        return issued

    def start(self, cycle: Issued) -> None:
        self._run_local(cycle)

    def finish(self, cycle: Issued, pipe: TreePipeline, features, column, stats) -> torch.Tensor | None:
        finished = self._collect(cycle, features, column)
        for level, k in cycle.levels:
            pipe.ran(k, level)   # the stage processes keep the outputs
        return finished

    def prune(self, exited: Node, kept: Node | None, pipe: TreePipeline) -> None:
        """The next command carries it: a rejection crops every stage after `exited`; a kept
        child (W > 1) drops the branches not under it."""
        if kept is None:
            self._crop = exited.position + 1
        elif self.tree.width > 1:
            self._accepted = kept.uid

    def waste(self, cycle: Issued) -> None:
        """Finish a looked-ahead cycle whose work a rejection (or the end) made useless."""
        if self.local is not None:
            self.local.skip(cycle.command)
        for message in cycle.posted.values():
            self.link.take(message)
        if cycle.verdict is not None:
            self.link.take(cycle.verdict)
        self.link.flush(before_cycle=True)

    def prefill(self, prompt_ids, features, column, params, gen) -> int:
        """The prompt through the stages, pipelined in chunks (crop to 0 first); the target's own
        first token."""
        missing = sorted(set(column) - set(self.anchors))
        if missing:
            raise ValueError(f"the drafter needs anchors {missing} that this run does not record "
                             f"(it records {self.anchors}); start the run with the drafter's anchors")
        self._sample = int(not params.greedy)   # a last stage holding the head sends logits, else the argmax
        self._crop, self._accepted = -1, -1
        length = len(prompt_ids)
        hidden = self.target.embed(torch.tensor(prompt_ids, device=self.link.device))
        store_snapshots(features, slice(0, length), {0: hidden[0]}, column)
        prefill = self._issue(Command(Op.PREFILL, newest=length - 1, first=0, crop=0, sample=self._sample), hidden,
                              [(slice(0, length), k) for k in range(self.layout.n_stages)])
        self._run_local(prefill)
        return sample(self.logits(self._collect(prefill, features, column, patient=True)), params, gen)

    # -- one sequence ------------------------------------------------------------------------------
    def stream(self, drafter: Drafter, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
               max_new_tokens: int = 128, eos_token_ids=(), stats: DistributedStats | None = None,
               cycles: list[CycleTimes] | None = None) -> Iterator[int]:
        """Yield the verified new tokens of one sequence: `engine.stream` with this controller
        doing the stage work. `cycles` receives every STEP's times (for `breakdown`)."""
        stats = stats if stats is not None else DistributedStats(self.layout.n_stages)
        self.cycles = cycles if cycles is not None else []
        try:
            yield from stream(self.target, drafter, prompt_ids, self, params, max_new_tokens, eos_token_ids, stats,
                              self.tree)
        finally:   # the last cycle's total ends here, not at the next sequence's prefill
            self._close_times(now(self.link.device))

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

    def ping(self) -> None:
        """Between sequences: show the stages rank 0 is alive, so none gives up waiting."""
        self.link.broadcast(Command(Op.PING))
        self.link.flush()

    def stop(self) -> None:
        self.link.broadcast(Command(Op.STOP))
        self.link.flush()
