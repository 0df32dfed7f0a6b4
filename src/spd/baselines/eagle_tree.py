"""EAGLE-style *tree* drafting (the EAGLE-2 dynamic tree) on the chain baseline's head and loop.

Per round, with x_c the newest verified token (the root) and the head of `spd.baselines.eagle`:

1. Expand by depth. The head's row on the last true feature gives the root's children: its
   top_k tokens, each scored by its path log-probability (the sum of the head's log q along the
   path). At each further depth the top_k nodes of the newest depth by that score run ONE
   batched head forward (each row: the node's token, its parent's head output as feature, at
   position node.position - 1; a row sees the true rows, its ancestors' rows and itself) and each
   proposes its top_k children. `depth` head forwards in all.
2. Re-rank every node proposed (not only the expanded ones) by path score and keep the best
   `budget` B. A child's score never exceeds its parent's, so a kept node's parent is kept too
   (ties: shallower first); the kept nodes go in depth order, parents before children.
3. Verify: the target runs [x_c, the B nodes] in ONE forward under a tree mask (verified prefix
   + the node's own ancestors + itself; `spd.tree.ancestry`, `spd.target.TreeMask`). From the
   root, each verified node's children are checked against its logits with
   `spd.sampling.verify_multi`, the children being point masses (the tree is a deterministic
   function of the context, drawn before the target's randomness), so greedy keeps the child
   equal to the argmax and sampling uses recursive multi-draft rejection: the output law is the
   target's exactly. The walk ends with the target's own token (recovered, or the bonus after a
   leaf).
4. Compact: the target's cache keeps x_c and the accepted path (`KVCache.select`, as the tree
   SPD engine does), the features the same rows; the head's cache is cropped to the true rows.

A chain is a tree too, but the chain baseline keeps its causal-mask forward (no mask built).
Recurrent targets cannot drop branches from a state: refused. This module knows the tree round;
the loop (prefill, budget, EOS) is `eagle.decode_rounds`, the head and its training are elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..cache import KVCache
from ..sampling import SamplingParams, probs, sample, verify_multi
from ..target import Target, TreeMask, attention_mask
from ..tree import Node, ancestry
from .eagle import Decoding, EagleHead, EagleStats, decode_rounds

DEFAULT_DEPTH, DEFAULT_TOP_K = 6, 8   # EAGLE-2 uses depth 5-6 and top_k 10 at a budget of 60


@dataclass(frozen=True)
class TreeOptions:
    """One tree round's shape: `budget` B draft nodes verified (the target's forward covers B + 1
    tokens), `depth` head forwards (the deepest draft is depth tokens ahead), `top_k` children per
    expanded node and nodes expanded per depth. 0 means the default: min(6, B) and min(8, B)."""

    budget: int = 16
    depth: int = 0
    top_k: int = 0

    def __post_init__(self):
        if self.budget < 1 or self.depth < 0 or self.top_k < 0:
            raise ValueError(f"tree budget must be >= 1 and depth, top_k >= 0 (0 = default); got "
                             f"budget={self.budget}, depth={self.depth}, top_k={self.top_k}")
        object.__setattr__(self, "depth", self.depth or min(DEFAULT_DEPTH, self.budget))
        object.__setattr__(self, "top_k", self.top_k or min(DEFAULT_TOP_K, self.budget))


def _children(parents: list[Node], logits: torch.Tensor, params: SamplingParams, top_k: int) -> list[Node]:
    """Each parent's top_k tokens by its (V,) row of head logits, as nodes whose path score adds
    the token's log-probability: log-softmax when greedy, else the log of the processed q
    (temperature, top-k, top-p as the target's p: tokens p gives 0 are never drafted)."""
    k = min(top_k, logits.shape[-1])
    if params.greedy:
        values, tokens = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)
    else:   # the log of the top k only: torch.log over a row of zeros is ~15x slower on a CPU
        values, tokens = torch.topk(probs(logits, params), k, dim=-1)
        values = values.log()
    out = []
    for parent, vals, toks in zip(parents, values.tolist(), tokens.tolist()):
        out += [Node(t, parent.position + 1, parent=parent, score=parent.score + v)
                for v, t in zip(vals, toks) if v != float("-inf")]
    return out


def _best(nodes: list[Node], count: int) -> list[Node]:
    """The `count` best by path score; ties: shallower first, then proposal order."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].position, i))
    return [nodes[i] for i in order[:count]]


def tree_mask(prefix: int, nodes: list[Node], queries: int, offset: int, device) -> TreeMask:
    """Keys: positions 0..prefix-1 (visible to all), then `nodes` (the last `queries` of them are
    this forward's queries) at node.position - offset; a query sees its ancestors and itself."""
    allowed = torch.cat([torch.ones(queries, prefix, dtype=torch.bool), ancestry(nodes)[len(nodes) - queries:]], 1)
    keys = list(range(prefix)) + [n.position - offset for n in nodes]
    return TreeMask(torch.tensor(keys, device=device), allowed.to(device))


def draft_tree(head: EagleHead, cache: KVCache, tokens: list[int], features: torch.Tensor, c: int,
               options: TreeOptions, params: SamplingParams, depth: int | None = None
               ) -> tuple[Node, list[Node], int]:
    """The root (x_c, position c), at most B draft nodes (parents before children) and the
    number of head forwards made.

    The head cache holds true-feature rows 0..start-1; rows start..c-1 run first (the last gives
    the root's children), then one forward per further depth; the caller crops it back to c.
    `depth` caps options.depth (no drafts past the token budget)."""
    depth = options.depth if depth is None else min(depth, options.depth)
    root = Node(tokens[c], c)
    if depth < 1:
        return root, [], 0
    device, start = features.device, cache.length(0)
    assert start < c, (start, c)
    positions = torch.arange(start, c, device=device)
    next_ids = torch.tensor(tokens[start + 1:c + 1], device=device)[None]
    mask = attention_mask(positions, c, features.dtype)
    out = head(next_ids, head.fused(features[start:c])[None], positions, mask, cache)
    newest = _children([root], head.logits(out[0, -1:]), params, options.top_k)
    proposed, ran, output, calls = list(newest), [], {root.uid: out[0, -1]}, 1
    for _ in range(depth - 1):
        frontier = _best(newest, options.top_k)
        if not frontier:
            break
        calls += 1
        ran += frontier
        rows = torch.tensor([n.position - 1 for n in frontier], device=device)   # each row: its parent's position
        mask = tree_mask(c, ran, len(frontier), 1, device).additive(rows, features.dtype)
        feature = torch.stack([output[n.parent.uid] for n in frontier])[None]
        out = head(torch.tensor([[n.token for n in frontier]], device=device), feature, rows, mask, cache)
        output.update((n.uid, out[0, i]) for i, n in enumerate(frontier))
        newest = _children(frontier, head.logits(out[0]), params, options.top_k)
        proposed += newest
    kept = _best(proposed, options.budget)
    kept.sort(key=lambda n: n.position)   # stable: by depth, then rank
    return root, kept, calls


def accept_path(root: Node, nodes: list[Node], logits: torch.Tensor, params: SamplingParams,
                gen: torch.Generator, stats: EagleStats) -> tuple[list[int], int]:
    """Walk the tree from the root with the target's (B + 1, V) logits (row 0: the root, row i:
    nodes[i - 1]): (indices into `nodes` of the accepted path, the target's own token)."""
    row = {root.uid: 0, **{n.uid: i + 1 for i, n in enumerate(nodes)}}
    children: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        children.setdefault(n.parent.uid, []).append(i)
    path, node, counts = [], root, stats.drafts_by_source.setdefault("head", [0, 0])
    while node.uid in children:
        kids = children[node.uid]
        level = len(path)
        stats.verified += 1                      # one per level checked, however many children
        stats.verified_by_position[level] += 1
        counts[0] += 1
        index, token = verify_multi([(nodes[i].token, None) for i in kids], logits[row[node.uid]], params, gen)
        if index is None:
            return path, token                       # recovered token
        stats.accepted += 1
        stats.accepted_by_position[level] += 1
        counts[1] += 1
        path.append(kids[index])
        node = nodes[kids[index]]
    return path, sample(logits[row[node.uid]], params, gen)   # bonus token after a leaf


def tree_round(state: Decoding, options: TreeOptions, room: int) -> list[int]:
    """Draft a tree (no deeper than `room`), verify it in one target forward, keep the accepted path."""
    target, stats, c, device = state.target, state.stats, state.c, state.target.device
    t = time.perf_counter()
    root, nodes, calls = draft_tree(state.head, state.head_cache, state.tokens, state.features, c, options,
                                    state.params, depth=room)
    stats.draft_forwards += calls
    stats.draft_seconds += time.perf_counter() - t
    t = time.perf_counter()
    block = [root] + nodes
    positions = torch.tensor([n.position for n in block], device=device)
    mask = tree_mask(c, block, len(block), 0, device) if nodes else None
    hidden, snapshots = target.run_layers(target.embed(torch.tensor([n.token for n in block], device=device)),
                                          positions, range(target.num_layers), state.cache, state.record, tree=mask)
    path, token = accept_path(root, nodes, target.logits(hidden[0]), state.params, state.gen, stats)
    rows = [0] + [i + 1 for i in path]
    state.cache.select(c, rows)                       # x_c and the accepted path, in order
    state.keep(c, snapshots, rows)
    state.head_cache.crop(c)                          # rows on the head's own outputs are redone
    stats.count_forward(len(block))
    stats.verify_seconds += time.perf_counter() - t
    return [nodes[i].token for i in path] + [token]


def eagle_tree_stream(target: Target, head: EagleHead, prompt_ids: list[int],
                      options: TreeOptions = TreeOptions(), params: SamplingParams = SamplingParams(),
                      max_new_tokens: int = 128, eos_token_ids=(), stats: EagleStats | None = None
                      ) -> Iterator[int]:
    """Yield the new tokens of one sequence: per round a draft tree of B nodes, one target forward."""
    if target.recurrent:
        raise ValueError(f"{target.config.model_type} has recurrent layers: their state cannot drop a "
                         f"tree's rejected branches; use chain drafting (eagle-k<K>) on this target")
    stats = stats if stats is not None else EagleStats(options.depth)
    stats.k = options.depth
    stats.verified_by_position, stats.accepted_by_position = [0] * options.depth, [0] * options.depth
    step = lambda state, room: tree_round(state, options, room)  # noqa: E731
    return decode_rounds(target, head, prompt_ids, step, params, max_new_tokens, eos_token_ids, stats,
                         options.depth + 2)


def eagle_tree_generate(target: Target, head: EagleHead, prompt_ids: list[int],
                        options: TreeOptions = TreeOptions(), params: SamplingParams = SamplingParams(),
                        max_new_tokens: int = 128, eos_token_ids=None) -> tuple[list[int], EagleStats]:
    eos = target.eos_token_ids if eos_token_ids is None else eos_token_ids
    stats = EagleStats(options.depth)
    tokens = list(eagle_tree_stream(target, head, prompt_ids, options, params, max_new_tokens, eos, stats))
    return tokens, stats
