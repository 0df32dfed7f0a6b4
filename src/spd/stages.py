"""Where `engine.stream`'s stage work runs: the `StageRunner` protocol, and `LocalStages`, every
stage in this process one after another on one cache. The distributed runtime's `Controller`
is the other runner (stages in other processes). `store_snapshots` writes the anchors a stage
passes into the drafter's feature table (both runners and the engine use it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .sampling import sample
from .stats import CycleTimes, SPDStats, now
from .target import Target
from .tree import Node, TreePipeline


def store_snapshots(features: torch.Tensor, positions, snapshots: dict, column: dict) -> None:
    """Write {anchor: (q, H)} hidden states into the (capacity, m, H) feature table."""
    for anchor, hidden in snapshots.items():
        if anchor in column:
            features[positions, column[anchor]] = hidden


@dataclass
class Cycle:
    """A cycle of `LocalStages`: what runs, and its times (the loop fills pdm and verify)."""

    levels: list[tuple[list[Node], int]]   # (a level's nodes, the stage k it runs), newest first
    times: CycleTimes = field(default_factory=CycleTimes)


class StageRunner(Protocol):
    """Where `stream`'s stage work runs: `LocalStages` (this process) or the runtime's
    `Controller` (stage processes). A cycle object carries `levels` and `times` (CycleTimes)."""

    n_stages: int
    lookahead: str   # LookaheadPolicy mode; "off" where nothing runs in parallel with verification

    def prefill(self, prompt_ids, features, column, params, gen) -> int: ...   # the target's first token
    def step(self, pipe, work, hidden, first=None): ...   # issue a cycle: (level, stage k), newest first
    def start(self, cycle) -> None: ...   # its share that runs here beside the draft
    def finish(self, cycle, pipe, features, column, stats): ...   # the rest; the root's output
    def logits(self, finished) -> torch.Tensor: ...   # (V,) logits of the exiting root
    def prune(self, exited, kept, pipe) -> None: ...   # the caches drop what verification cut
    def waste(self, cycle) -> None: ...   # drain a looked-ahead cycle made useless (lookahead only)


class LocalStages:
    """`StageRunner` in this process: every stage, one after another, on one cache (no `waste`:
    it never looks ahead)."""

    lookahead = "off"   # issuing a cycle early only pays when other processes run it

    def __init__(self, target: Target, stages: list[range]):
        assert len(stages) >= 1 and stages[-1].stop == target.num_layers, stages
        self.target, self.stages, self.n_stages = target, stages, len(stages)

    def prefill(self, prompt_ids: list[int], features: torch.Tensor, column: dict, params, gen) -> int:
        """The whole prompt through the whole model; the target's own first token."""
        self.record, self.cache = set(column), self.target.new_cache(self.stages)   # recurrent layers keep n - k states
        prompt = torch.tensor(prompt_ids, device=self.target.device)
        last_hidden, snapshots = self.target.prefill(prompt, self.cache, self.record)
        store_snapshots(features, slice(0, len(prompt_ids)), snapshots, column)
        return sample(self.target.logits(last_hidden[0, -1]), params, gen)

    def step(self, pipe: TreePipeline, work, hidden: torch.Tensor | None, first: int | None = None) -> Cycle:
        """This cycle's stage step, to run in `finish` (the levels' inputs are their nodes' hidden)."""
        return Cycle(work)

    def start(self, cycle: Cycle) -> None:
        """Nothing runs before the draft here: the stages read features the draft does not."""

    def finish(self, cycle: Cycle, pipe: TreePipeline, features, column, stats: SPDStats) -> torch.Tensor:
        """Every level runs its stage (all its nodes in one forward) and records the anchors it
        passes; the root's output, which has passed the last stage if the root exits."""
        device = self.target.device
        for level, k in cycle.levels:
            t = now(device)
            hidden = level[0].hidden if len(level) == 1 else torch.cat([node.hidden for node in level], 1)
            positions = torch.tensor([node.position for node in level], device=device)
            hidden, snapshots = self.target.run_layers(hidden, positions, self.stages[k], self.cache, self.record,
                                                       pipe.stage_mask(k, level, device))
            pipe.ran(k, level, hidden)
            store_snapshots(features, [node.row for node in level], snapshots, column)
            stats.stage_seconds[k] += now(device) - t
        return pipe.root.hidden

    def logits(self, finished: torch.Tensor) -> torch.Tensor:
        return self.target.logits(finished[0, -1])

    def prune(self, exited: Node, kept: Node | None, pipe: TreePipeline) -> None:
        """After verifying `exited`'s child: a rejection crops every cache after it; an accepted
        child drops the branches not under it from the in-flight tails."""
        if kept is None:
            self.cache.crop(exited.position + 1)
        for k, keep in enumerate(pipe.pruned):
            if keep is not None:
                self.cache.select(exited.position, keep, self.stages[k])
