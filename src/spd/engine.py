"""The SPD schedule, in one place: prefill, then per cycle draft -> stages -> exit/verify.

`stream()` is the one decode loop (a generator of verified tokens); `generate()` consumes it.
The pipeline (`spd.tree.TreePipeline`) is a list of levels, oldest first: level d holds the
in-flight candidates (up to W; one for the chain, W = 1) of one position, and runs stage d this
cycle. Every layer's KV cache holds all positions before the level that runs it, because older
levels are deeper; candidates of one level share the caches under a tree attention mask.

Lossless by construction: every emitted token is an accepted draft or the target's own token
from the same prefix and cache that plain decoding would use (SPEC sections 2 and 5).
The stage work goes through a `StageRunner`: `LocalStages` here, one stage after another; the
distributed runtime's `Controller` runs this same loop with the stages in other processes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from .drafters import Drafter, draft_source
from .sampling import SamplingParams, sample
from .target import Target
from .tree import Candidate, Node, TreeConfig, TreePipeline


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


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def store_snapshots(features: torch.Tensor, positions, snapshots: dict, column: dict) -> None:
    """Write {anchor: (q, H)} hidden states into the (capacity, m, H) feature table."""
    for anchor, hidden in snapshots.items():
        if anchor in column:
            features[positions, column[anchor]] = hidden


def propose(drafter, pipe: TreePipeline, features, params, gen, stats, times: CycleTimes,
            stepped=False) -> list[list[Candidate]]:
    """Candidates for the children of every newest-level node. W = 1 asks the drafter's one
    `draft` (the chain); W > 1 its `candidates` for all leaves at once. Timed into the cycle's
    `times.pdm` and the sequence's `stats.pdm_seconds`."""
    t = _now(features.device)
    if pipe.width == 1:
        draft, q = drafter.draft(pipe.draft_state(features, stepped), params, gen)
        proposals = [[Candidate(draft, 0.0, draft_source(drafter), q)]]
    else:
        proposals = drafter.candidates(pipe.tree_state(features), params, gen, pipe.width)
    times.pdm = _now(features.device) - t
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


def start_stats(stats: SPDStats, n: int, prompt_len: int, tree: TreeConfig) -> None:
    stats.n_stages, stats.prompt_tokens, stats.stage_seconds = n, prompt_len, [0.0] * n
    stats.verified_by_fill, stats.accepted_by_fill = [0] * n, [0] * n
    stats.tree_width = tree.width


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


@dataclass
class CycleTimes:
    """One decode cycle as the loop saw it (seconds); the distributed runtime fills all of it."""

    total: float = 0.0      # start of this cycle to start of the next
    local_stage: float = 0.0  # stage 0 run in the control process (with-first-stage)
    own: float = 0.0        # start until the control rank began to wait for reports (its own work)
    pdm: float = 0.0
    reports: float = 0.0    # start of the cycle until the last report arrived
    verify: float = 0.0


LOOKAHEAD = ("off", "on", "auto")


class LookaheadPolicy:
    """Whether to issue the next cycle before verifying: "off", "on", or "auto" (when it pays).

    Looking ahead hides the verification time V of every exit and wastes one cycle T on every
    rejection, so "auto" looks ahead while the running acceptance a > 1 - V / T.
    """

    def __init__(self, mode: str, smoothing: float = 0.1):
        if mode not in LOOKAHEAD:
            raise ValueError(f"lookahead must be one of {', '.join(LOOKAHEAD)}; got {mode!r}")
        self.mode, self.smoothing = mode, smoothing
        self.acceptance, self.verify, self.step = 0.5, 0.0, 0.0

    def ahead(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        return self.step > 0 and self.acceptance > 1.0 - self.verify / self.step

    def update(self, accepted: bool, verify_seconds: float, step_seconds: float) -> None:
        mix = lambda old, new: old + self.smoothing * (new - old)  # noqa: E731
        self.acceptance = mix(self.acceptance, float(accepted))
        self.verify = mix(self.verify, verify_seconds) if self.verify else verify_seconds
        self.step = mix(self.step, step_seconds) if self.step else step_seconds


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
            t = _now(device)
            hidden = level[0].hidden if len(level) == 1 else torch.cat([node.hidden for node in level], 1)
            positions = torch.tensor([node.position for node in level], device=device)
            hidden, snapshots = self.target.run_layers(hidden, positions, self.stages[k], self.cache, self.record,
                                                       pipe.stage_mask(k, level, device))
            pipe.ran(k, level, hidden)
            store_snapshots(features, [node.row for node in level], snapshots, column)
            stats.stage_seconds[k] += _now(device) - t
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


@torch.inference_mode()
def stream(target: Target, drafter: Drafter, prompt_ids: list[int], stages,
           params: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
           eos_token_ids=(), stats: SPDStats | None = None, tree: TreeConfig = TreeConfig()) -> Iterator[int]:
    """Yield the verified new tokens of one sequence, one at a time, as SPD produces them.
    `stages`: the n stages' layer ranges (run here, `LocalStages`) or a runner with its methods
    (the distributed `Controller`). `tree.width` W > 1 keeps up to W candidates per level."""
    runner = LocalStages(target, stages) if isinstance(stages, (list, tuple)) else stages
    n, device = runner.n_stages, target.device
    assert len(prompt_ids) >= 1 and getattr(runner, "tree", tree) == tree, "the runner was set up for another tree"
    check_tree(target, drafter, tree)
    stats = stats if stats is not None else SPDStats(n)
    start_stats(stats, n, len(prompt_ids), tree)
    if max_new_tokens < 1:
        return
    eos, gen = set(eos_token_ids), params.generator(device)
    column = {anchor: i for i, anchor in enumerate(drafter.anchors)}   # anchor -> feature column
    capacity = len(prompt_ids) + max_new_tokens + n + 1   # positions; then the in-flight tree nodes' rows
    rows = capacity + TreePipeline.node_row_count(n, tree.width)
    features = torch.zeros(rows, len(column), target.hidden_size, device=device, dtype=target.dtype)

    # Prefill: the whole prompt through the whole model; the first token is the target's own.
    t0 = _now(device)
    tokens = list(prompt_ids) + [runner.prefill(prompt_ids, features, column, params, gen)]
    stats.prefill_seconds, stats.new_tokens = _now(device) - t0, 1
    yield tokens[-1]
    if tokens[-1] in eos or max_new_tokens == 1:
        return

    drafter.begin(len(prompt_ids))
    pipe = TreePipeline(tokens, n, tree, node_rows=capacity)   # the first token is the root
    policy = LookaheadPolicy(runner.lookahead)
    t_decode = _now(device)
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
            last = stats.new_tokens + 1 >= max_new_tokens   # this verification emits the last token
            if policy.ahead() and not last:   # issue the next cycle as if the draft is accepted, then verify
                hidden = embed_level(target, pipe.newest, features, column)
                ahead = runner.step(pipe, pipe.work()[:-1], hidden, first=pipe.root.position + 1)
            t, exited = _now(device), pipe.root
            kept, token = settle(pipe, features, runner.logits(finished), params, gen, stats)
            runner.prune(exited, kept, pipe)   # the caches drop what the verification cut
            cycle.times.verify = _now(device) - t
            stats.verify_seconds += cycle.times.verify
            policy.update(kept is not None, cycle.times.verify, cycle.times.reports)
        if token is not None:
            done = token in eos or stats.new_tokens >= max_new_tokens
            if ahead is not None and (done or kept is None):   # the looked-ahead cycle was in vain
                runner.waste(ahead)
                stats.cycles += 1
                ahead = None
            stats.decode_seconds = _now(device) - t_decode
            try:
                yield token
            except GeneratorExit:   # the consumer stopped early: leave no message unmatched
                if ahead is not None:   # the stages ran it: counted like any wasted cycle
                    runner.waste(ahead)
                    stats.cycles += 1
                raise
            if done:
                return
        if ahead is not None:
            cycle = ahead
            continue
        entering = pipe.newest[0].hidden is None   # not when a pruning left an older level newest
        cycle = runner.step(pipe, pipe.work(), embed_level(target, pipe.newest, features, column) if entering else None)


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
