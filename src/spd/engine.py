"""The SPD schedule, in one place: prefill, then per cycle draft -> stages -> exit/verify.

`stream()` is the one decode loop (a generator of verified tokens); `generate()` consumes it.
The pipeline (`spd.tree.TreePipeline`) is a list of levels, oldest first: level d holds the
in-flight candidates (up to W; one for the chain, W = 1) of one position, and runs stage d this
cycle. Every layer's KV cache holds all positions before the level that runs it, because older
levels are deeper; candidates of one level share the caches under a tree attention mask.

Lossless by construction: every emitted token is an accepted draft or the target's own token
from the same prefix and cache that plain decoding would use (SPEC sections 2 and 5).
The stage work goes through a `StageRunner` (spd.stages): `LocalStages`, one stage after
another in this process, or the distributed runtime's `Controller`, which runs this same loop
with the stages in other processes. What a decode records is in spd.stats; whether to look
ahead, in spd.lookahead. This module is the loop and the per-phase functions it calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .drafters import Drafter, draft_source
from .lookahead import LookaheadPolicy
from .sampling import SamplingParams
from .stages import LocalStages, store_snapshots
from .stats import CycleTimes, SPDStats, now
from .target import Target
from .tree import Candidate, Node, TreeConfig, TreePipeline


def propose(drafter, pipe: TreePipeline, features, params, gen, stats, times: CycleTimes,
            stepped=False) -> list[list[Candidate]]:
    """Candidates for the children of every newest-level node. W = 1 asks the drafter's one
    `draft` (the chain); W > 1 its `candidates` for all leaves at once. Timed into the cycle's
    `times.pdm` and the sequence's `stats.pdm_seconds`."""
    t = now(features.device)
    if pipe.width == 1:
        draft, q = drafter.draft(pipe.draft_state(features, stepped), params, gen)
        proposals = [[Candidate(draft, 0.0, draft_source(drafter), q)]]
    else:
        proposals = drafter.candidates(pipe.tree_state(features), params, gen, pipe.width)
    times.pdm = now(features.device) - t
    stats.pdm_seconds += times.pdm
    return proposals


def settle(pipe: TreePipeline, features: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
           gen: torch.Generator, stats: SPDStats) -> tuple[Node | None, int]:
    """The root exited with (V,) `logits`: verify level 1, prune, count. Returns (the accepted
    child or None, the emitted token); the caller then crops (None: every cache to the root's
    position + 1) or compacts (`pipe.pruned`) the caches, here or in the stage processes."""
    root = pipe.root
    if root.row != root.position:   # finished: its features move to its position's row
        features[root.position] = features[root.row]
    stats.verified_candidates += len(pipe.levels[1])
    kept, token, counted = pipe.settle(logits, params, gen)
    stats.count(counted.fill, counted.source, kept is not None)
    stats.new_tokens += 1
    return kept, token


def embed_level(target: Target, level: list[Node], features: torch.Tensor, column: dict) -> torch.Tensor:
    """The newest level enters stage 1: embed its tokens (their depth-0 features); (1, w, H)."""
    hidden = target.embed(torch.tensor([node.token for node in level], device=target.device))
    store_snapshots(features, [node.row for node in level], {0: hidden[0]}, column)
    for i, node in enumerate(level):
        node.hidden = hidden[:, i:i + 1] if len(level) > 1 else hidden
    return hidden


def waste(runner, cycle, stats: SPDStats) -> None:
    """Drain a looked-ahead cycle made useless; the stages ran it, so it counts in `stats.cycles`."""
    runner.waste(cycle)
    stats.cycles += 1


def check_tree(target: Target, drafter, config: TreeConfig) -> None:
    """Refuse tree widths a target or drafter cannot run, with the reason."""
    if config.width == 1:
        return
    if target.recurrent:
        raise ValueError(f"--tree-width {config.width} needs attention-only layers: {target.config.model_type} "
                         f"has recurrent layers, whose state cannot hold several branches; use width 1")
    if drafter.after_stages or not hasattr(drafter, "candidates"):
        raise ValueError(f"{type(drafter).__name__} drafts one token per cycle; tree width "
                         f"{config.width} needs a drafter with `candidates` (pdm, hybrid, retrieval)")


@torch.inference_mode()
def stream(target: Target, drafter: Drafter, prompt_ids: list[int], stages,
           params: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
           eos_token_ids=(), stats: SPDStats | None = None, tree: TreeConfig = TreeConfig()) -> Iterator[int]:
    """Yield the verified new tokens of one sequence, one at a time, as SPD produces them. `stages`: the n
    stages' layer ranges (`LocalStages`) or a runner (the distributed `Controller`); W = `tree.width` per level."""
    runner = LocalStages(target, stages) if isinstance(stages, (list, tuple)) else stages
    n, device = runner.n_stages, target.device
    assert len(prompt_ids) >= 1 and getattr(runner, "tree", tree) == tree, "the runner was set up for another tree"
    check_tree(target, drafter, tree)
    stats = stats if stats is not None else SPDStats(n)
    stats.begin(n, len(prompt_ids), tree.width)
    if max_new_tokens < 1:
        return
    eos, gen = set(eos_token_ids), params.generator(device)
    column = {anchor: i for i, anchor in enumerate(drafter.anchors)}   # anchor -> feature column
    capacity = len(prompt_ids) + max_new_tokens + n + 1   # positions; then the in-flight tree nodes' rows
    rows = capacity + TreePipeline.node_row_count(n, tree.width)
    features = torch.zeros(rows, len(column), target.hidden_size, device=device, dtype=target.dtype)

    # Prefill: the whole prompt through the whole model; the first token is the target's own.
    t0 = now(device)
    tokens = list(prompt_ids) + [runner.prefill(prompt_ids, features, column, params, gen)]
    stats.prefill_seconds, stats.new_tokens = now(device) - t0, 1
    yield tokens[-1]
    if tokens[-1] in eos or max_new_tokens == 1:
        return

    drafter.begin(len(prompt_ids))
    pipe = TreePipeline(tokens, n, tree, node_rows=capacity)   # the first token is the root
    policy = LookaheadPolicy(runner.lookahead)
    t_decode = now(device)
    cycle = runner.step(pipe, pipe.work(), embed_level(target, pipe.newest, features, column))
    while True:
        runner.start(cycle)   # a stage that runs in this process beside the draft (distributed)
        # 1. Draft the children of the newest level from features that exist before this cycle's stage work.
        if not drafter.after_stages:
            proposals = propose(drafter, pipe, features, params, gen, stats, cycle.times)

        # 2. Stage step: the level at depth k runs stage k and records the anchors it passes.
        finished = runner.finish(cycle, pipe, features, column, stats)
        stats.add_cycle([len(level) for level, _ in cycle.levels])
        if drafter.after_stages:  # PPSD-style drafters read the newest token's stage-1 output
            proposals = propose(drafter, pipe, features, params, gen, stats, cycle.times, stepped=True)
        # The drafts join the pipeline at depth 0 (dropped again below if a rejection cuts them).
        pipe.grow(proposals, fill=len(cycle.levels))

        # 3. Exit + verify: the root has finished all n stages (n levels in flight, or fewer after
        # a pruning left a bubble).
        ahead, token, kept = None, None, None
        if pipe.exits:
            if policy.ahead() and stats.new_tokens + 1 < max_new_tokens:   # issue the next cycle, then verify
                hidden = embed_level(target, pipe.newest, features, column)
                ahead = runner.step(pipe, pipe.work()[:-1], hidden, first=pipe.root.position + 1)
            t, exited = now(device), pipe.root
            kept, token = settle(pipe, features, runner.logits(finished), params, gen, stats)
            runner.prune(exited, kept, pipe)   # the caches drop what the verification cut
            cycle.times.verify = now(device) - t
            stats.verify_seconds += cycle.times.verify
            policy.update(kept is not None, cycle.times.verify, cycle.times.reports)
        if token is not None:
            done = token in eos or stats.new_tokens >= max_new_tokens
            if ahead is not None and (done or kept is None):   # the looked-ahead cycle was in vain
                waste(runner, ahead, stats)
                ahead = None
            stats.decode_seconds = now(device) - t_decode
            try:
                yield token
            except GeneratorExit:   # the consumer stopped early: leave no message unmatched
                if ahead is not None:
                    waste(runner, ahead, stats)
                raise
            if done:
                return
        if ahead is not None:   # the next cycle is already issued
            cycle = ahead
        else:   # the newest level enters stage 1 (unless a pruning left an older level newest)
            entering = embed_level(target, pipe.newest, features, column) if pipe.newest[0].hidden is None else None
            cycle = runner.step(pipe, pipe.work(), entering)


@dataclass
class GenerationResult:
    tokens: list[int]      # new tokens only
    stats: SPDStats


def generate(target: Target, drafter: Drafter, prompt_ids: list[int], stages: list[range],
             params: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
             eos_token_ids=None, on_token: Callable[[int], None] | None = None,
             tree: TreeConfig = TreeConfig()) -> GenerationResult:
    """Decode one sequence with SPD. eos_token_ids=None uses the target's own EOS ids."""
    eos = target.eos_token_ids if eos_token_ids is None else eos_token_ids
    stats = SPDStats(len(stages))
    tokens = []
    for token in stream(target, drafter, prompt_ids, stages, params, max_new_tokens, eos, stats, tree):
        tokens.append(token)
        if on_token is not None:
            on_token(token)
    return GenerationResult(tokens, stats)
