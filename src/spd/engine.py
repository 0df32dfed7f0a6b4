"""The single-process SPD schedule: prefill, then per cycle draft -> stages -> exit/verify.

`stream()` is the one decode loop (a generator of verified tokens); `generate()` consumes it.
The pipeline (`spd.tree.TreePipeline`) is a list of levels, oldest first: level d holds the
in-flight candidates (up to W; one for the chain, W = 1) of one position, and runs stage d this
cycle. Every layer's KV cache holds all positions before the level that runs it, because older
levels are deeper; candidates of one level share the caches under a tree attention mask.

Lossless by construction: every emitted token is an accepted draft or the target's own token
from the same prefix and cache that plain decoding would use (SPEC sections 2 and 5).
This module knows nothing about processes; the distributed runtime reuses its pieces.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

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


def propose(drafter, pipe: TreePipeline, features, params, gen, stats, stepped=False) -> list[list[Candidate]]:
    """Candidates for the children of every newest-level node. W = 1 asks the drafter's one
    `draft` (the chain); W > 1 its `candidates` for all leaves at once."""
    t = time.perf_counter()
    if pipe.width == 1:
        draft, q = drafter.draft(pipe.draft_state(features, stepped), params, gen)
        proposals = [[Candidate(draft, 0.0, draft_source(drafter), q)]]
    else:
        proposals = drafter.candidates(pipe.tree_state(features), params, gen, pipe.width)
    stats.pdm_seconds += time.perf_counter() - t
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


@torch.inference_mode()
def stream(target: Target, drafter: Drafter, prompt_ids: list[int], stages: list[range],
           params: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
           eos_token_ids=(), stats: SPDStats | None = None, tree: TreeConfig = TreeConfig()) -> Iterator[int]:
    """Yield the verified new tokens of one sequence, one at a time, as SPD produces them.
    `tree.width` W > 1 keeps up to W candidates per pipeline level (spd.tree)."""
    n, device = len(stages), target.device
    assert n >= 1 and stages[-1].stop == target.num_layers and len(prompt_ids) >= 1
    check_tree(target, drafter, tree)
    stats = stats if stats is not None else SPDStats(n)
    start_stats(stats, n, len(prompt_ids), tree)
    if max_new_tokens < 1:
        return
    eos = set(eos_token_ids)
    gen = params.generator(device)
    column = {anchor: i for i, anchor in enumerate(drafter.anchors)}
    record = set(drafter.anchors)
    cache = target.new_cache(stages)   # recurrent layers keep n - k states
    capacity = len(prompt_ids) + max_new_tokens + n + 1
    node_rows = TreePipeline.node_row_count(n, tree.width)   # in-flight tree nodes' rows
    features = torch.zeros(capacity + node_rows, len(column), target.hidden_size, device=device,
                           dtype=target.dtype)

    # Prefill: the whole prompt through the whole model; the first token is the target's own.
    t0 = _now(device)
    prompt = torch.tensor(prompt_ids, device=device)
    last_hidden, snapshots = target.prefill(prompt, cache, record)
    store_snapshots(features, slice(0, len(prompt_ids)), snapshots, column)
    tokens = list(prompt_ids) + [sample(target.logits(last_hidden[0, -1]), params, gen)]
    stats.prefill_seconds = _now(device) - t0
    stats.new_tokens = 1
    yield tokens[-1]
    if tokens[-1] in eos or max_new_tokens == 1:
        return

    drafter.begin(len(prompt_ids))
    pipe = TreePipeline(tokens, n, tree, node_rows=capacity)   # the first token is the root
    embed_level(target, pipe.newest, features, column)
    t_decode = _now(device)
    while True:
        work = pipe.work()
        # 1. Draft the children of the newest level from features that exist before this cycle's stage work.
        if not drafter.after_stages:
            proposals = propose(drafter, pipe, features, params, gen, stats)

        # 2. Stage step: the level at depth k runs stage k (all its nodes in one forward) and
        # records the anchors it passes.
        for level, k in work:
            t = _now(device)
            hidden = level[0].hidden if len(level) == 1 else torch.cat([node.hidden for node in level], 1)
            positions = torch.tensor([node.position for node in level], device=device)
            hidden, snapshots = target.run_layers(hidden, positions, stages[k], cache, record,
                                                  pipe.stage_mask(k, level, device))
            pipe.ran(k, level, hidden)
            store_snapshots(features, [node.row for node in level], snapshots, column)
            stats.stage_seconds[k] += _now(device) - t
            stats.stage_tokens += len(level)
        stats.cycles += 1
        if drafter.after_stages:  # PPSD-style drafters read the newest token's stage-1 output
            proposals = propose(drafter, pipe, features, params, gen, stats, stepped=True)

        # The drafts join the pipeline at depth 0 (dropped again below if a rejection cuts them).
        pipe.grow(proposals, fill=len(work))

        # 3. Exit + verify: the root has finished all n stages (n levels in flight, or fewer after
        # a pruning left a bubble).
        if pipe.exits:
            t = _now(device)
            root = pipe.root
            kept, token = settle(pipe, features, target.logits(root.hidden[0, -1]), params, gen, stats)
            if kept is None:  # everything from the checked position on is gone: crop the caches there
                cache.crop(root.position + 1)
            for k, keep in enumerate(pipe.pruned):   # dropped branches leave the in-flight tails
                if keep is not None:
                    cache.select(root.position, keep, stages[k])
            stats.verify_seconds += _now(device) - t
            stats.decode_seconds = _now(device) - t_decode
            yield token
            if token in eos or stats.new_tokens >= max_new_tokens:
                return
        if pipe.newest[0].hidden is None:   # not when a pruning left an older level newest
            embed_level(target, pipe.newest, features, column)


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
