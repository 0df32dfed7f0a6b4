"""Tree SPD bookkeeping: several candidate drafts per pipeline level, pruned at verification.

The in-flight tokens form a tree. Level 0 is the root: the oldest in-flight token, always
verified (it was checked when its own parent exited). Level i holds up to W candidate nodes for
position root + i, each with its parent in level i-1, and runs the stage of its depth this
cycle, all its nodes in one batched forward. Depths are consecutive (newest 0) except after a
pruning emptied the newest levels: the branch that survived then goes on from a deeper level
(a bubble, as after a rejection). With W = 1 the tree is a chain and everything below reduces
to the plain schedule of SPEC section 2.

Per stage, every layer's cache holds the verified prefix (positions 0..root-1 in slots
0..root-1, never moved) and then a *tail* of in-flight nodes in the order they ran it (root
first). A query sees the prefix, its own ancestors in the tail and itself (`stage_mask`). When
the root exits, its logits verify level 1: the accepted child becomes the root, every node not
under it is pruned, and `settle` says which tail entries each stage keeps (the engine compacts
the caches); on rejection the target's token restarts the pipeline (caches cropped there).

`DraftState` (what a drafter sees each cycle) and `Candidate` (a tree drafter's proposal) live
here, below spd.drafters, which imports them. This module knows nothing about models or
processes: the engine's loop (spd.engine.stream, in one process or distributed) drives `TreePipeline`; the distributed controller sends each cycle's
`TreeShape`, from which a stage process mirrors its own `StageTail`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, verify_multi
from .target import TreeMask


@dataclass(frozen=True)
class Candidate:
    """A tree drafter's proposal for the child of one leaf: its token, log-score, source, and the
    draft distribution it was sampled from (None: chosen deterministically, a point mass)."""

    token: int
    logprob: float = 0.0
    source: str = "draft"
    q: torch.Tensor | None = None


@dataclass
class DraftState:
    tokens: list[int]          # every position so far: prompt, verified tokens, in-flight drafts
    first_inflight: int        # position of the oldest in-flight token (positions before: finished)
    n_stages: int
    features: torch.Tensor     # (capacity, m, H) hidden states at the drafter's anchors per position
    stepped: bool = False      # True when this cycle's stage step already ran (post-step drafters)

    @property
    def newest(self) -> int:
        return len(self.tokens) - 1

    def depth(self, position: int) -> int:
        """Stages passed: in-flight tokens sit at consecutive positions, newest at depth 0
        (depth 1 once the cycle's stage step ran)."""
        if position < self.first_inflight:
            return self.n_stages
        return min(self.n_stages, self.newest - position + self.stepped)


@dataclass(frozen=True)
class TreeConfig:
    """Tree options of one decode: `width` W candidates per level (1 = the plain chain)."""

    width: int = 1

    def __post_init__(self):
        if self.width < 1:
            raise ValueError(f"tree width must be >= 1, got {self.width}")


_ids = itertools.count()


@dataclass(eq=False)
class Node:
    token: int
    position: int
    parent: "Node | None" = None
    score: float = 0.0            # path log-score: the drafter's, summed from the root
    source: str = "draft"
    fill: int = 0                 # levels in flight when it was drafted (SPDStats' pipeline fill)
    q: torch.Tensor | None = None
    row: int = -1                 # its row in the engine's feature table
    hidden: torch.Tensor | None = None   # (1, 1, H) its hidden state after the stages it ran
    uid: int = field(default_factory=lambda: next(_ids))

    def lineage(self) -> set[int]:
        """uids of its in-flight ancestors and itself (the root's parent link is cut)."""
        out, node = set(), self
        while node is not None:
            out.add(node.uid)
            node = node.parent
        return out


def ancestry(nodes: list[Node]) -> torch.Tensor:
    """(q, q) bool: [i, j] when nodes[j] is nodes[i] or one of its ancestors."""
    lines = [node.lineage() for node in nodes]
    return torch.tensor([[other.uid in line for other in nodes] for line in lines], dtype=torch.bool)


@dataclass
class TreeDraftState:
    """What a tree drafter sees: verified tokens (root last), the in-flight levels, features."""

    tokens: list[int]
    levels: list[list[Node]]
    depths: list[int]             # per level: stages passed before this cycle's step
    n_stages: int
    features: torch.Tensor        # rows by Node.row (in flight) and by position (finished)

    @property
    def root_position(self) -> int:
        return len(self.tokens) - 1

    @property
    def leaves(self) -> list[Node]:
        return self.levels[-1]

    def depth(self, level: int) -> int:
        return self.depths[level]

    def path(self, node: Node) -> list[int]:
        """Every token of the sequence that ends at `node`: the verified ones, then its ancestors."""
        chain = []
        while node.parent is not None:
            chain.append(node.token)
            node = node.parent
        return self.tokens + chain[::-1]


class StageTail:
    """What one stage's caches hold after the verified prefix: the in-flight nodes that ran it, in
    the order they ran (the root first). The engine keeps one per stage inside `TreePipeline`; a
    stage process of the distributed runtime keeps its own, rebuilt from each cycle's `TreeShape`,
    and both mask and prune with these same methods."""

    def __init__(self):
        self.nodes: list[Node] = []

    def find(self, uid: int) -> Node:
        for node in self.nodes:
            if node.uid == uid:
                return node
        raise KeyError(f"node {uid} is not in this stage's cache tail ({[n.uid for n in self.nodes]})")

    def mask(self, nodes: list[Node], device) -> TreeMask | None:
        """The mask of `nodes` (one level) running this stage; None when it is a chain (the causal
        mask is exact). Keys: the prefix (every position before the root), the tail, the nodes."""
        tail = self.nodes
        prefix = tail[0].position if tail else nodes[0].position   # an empty tail: the root runs
        lines = [node.lineage() for node in nodes]
        if len(nodes) == 1 and all(t.uid in lines[0] for t in tail):
            return None
        kv = prefix + len(tail) + len(nodes)
        keys = list(range(prefix)) + [t.position for t in tail] + [node.position for node in nodes]
        allowed = torch.zeros(len(nodes), kv, dtype=torch.bool)
        allowed[:, :prefix] = True
        for i, line in enumerate(lines):
            allowed[i, prefix:prefix + len(tail)] = torch.tensor([t.uid in line for t in tail], dtype=torch.bool)
            allowed[i, prefix + len(tail) + i] = True
        return TreeMask(torch.tensor(keys, device=device), allowed.to(device))

    def ran(self, nodes: list[Node]) -> None:
        self.nodes.extend(nodes)

    def settle(self, accepted: int) -> tuple[int, list[int] | None]:
        """The root exited and its child `accepted` (a uid) survived: the root's entry joins the
        prefix and only the accepted child's subtree stays. Returns (the root's position, the
        entries after it to keep, None: all) for `KVCache.select`; (0, None) on an empty tail."""
        tail = self.nodes
        if not tail:
            return 0, None
        keep = [0] + [i for i in range(1, len(tail)) if accepted in tail[i].lineage()]
        self.nodes = [tail[i] for i in keep[1:]]
        if self.nodes:
            assert self.nodes[0].uid == accepted, (accepted, self.nodes[0].uid)
            self.nodes[0].parent = None   # the new root: lineages stay short
        return tail[0].position, None if len(keep) == len(tail) else keep

    def restart(self) -> None:
        """A rejection: every cache was cropped to the corrected position; nothing is in flight."""
        self.nodes = []


@dataclass(frozen=True)
class TreeShape:
    """One cycle's tree as the stages of the distributed runtime need it (W > 1): `accepted`, the
    uid of the child the last verification kept (-1: none, or a rejection, which crops instead),
    and per stage the nodes it runs as (uid, parent uid; -1 for the root), in level order.

    As ints (`encode`): accepted, then per stage [w, uid_1..uid_W, parent_1..parent_W], padded
    with -1: 1 + n (1 + 2W) slots."""

    accepted: int
    stages: tuple[tuple[tuple[int, int], ...], ...]

    @staticmethod
    def size(n_stages: int, width: int) -> int:
        return 1 + n_stages * (1 + 2 * width)

    def encode(self, width: int) -> list[int]:
        out = [self.accepted]
        for nodes in self.stages:
            assert len(nodes) <= width, (len(nodes), width)
            pad = [-1] * (width - len(nodes))
            out += [len(nodes)] + [u for u, _ in nodes] + pad + [p for _, p in nodes] + pad
        return out

    @classmethod
    def decode(cls, ints, n_stages: int, width: int) -> "TreeShape":
        ints = list(ints)
        assert len(ints) == cls.size(n_stages, width), (len(ints), n_stages, width)
        stages, slot = [], 1 + 2 * width
        for k in range(n_stages):
            part = ints[1 + k * slot: 1 + (k + 1) * slot]
            w = part[0]
            stages.append(tuple(zip(part[1:1 + w], part[1 + width:1 + width + w])))
        return cls(ints[0], tuple(stages))


class TreePipeline:
    """One sequence's tree of in-flight tokens and each stage's cache tail (see module docstring)."""

    @staticmethod
    def node_row_count(n_stages: int, width: int) -> int:
        """Feature-table rows reserved for in-flight tree nodes (more than ever live at once; 0 for a chain)."""
        return 0 if width == 1 else (n_stages + 3) * (width + 1)

    def __init__(self, tokens: list[int], n_stages: int, config: TreeConfig, node_rows: int):
        """`tokens`: the prompt and the first (verified) token, which becomes the root.
        `node_rows`: first row of the feature table reserved for in-flight nodes (W > 1)."""
        self.tokens, self.n_stages, self.width = tokens, n_stages, config.width
        self.node_rows = node_rows
        self.row_count = self.node_row_count(n_stages, config.width)
        self.levels: list[list[Node]] = []
        self.tails = [StageTail() for _ in range(n_stages)]
        self.pruned: list[list[int] | None] = [None] * n_stages
        self._restart(tokens[-1], len(tokens) - 1)

    def _node(self, token: int, position: int, **kw) -> Node:
        node = Node(token, position, **kw)
        node.row = position if self.width == 1 else self.node_rows + node.uid % self.row_count
        return node

    def _restart(self, token: int, position: int) -> None:
        self.levels = [[self._node(token, position)]]
        self.depths = [0]
        for tail in self.tails:
            tail.restart()

    @property
    def root(self) -> Node:
        return self.levels[0][0]

    @property
    def newest(self) -> list[Node]:
        return self.levels[-1]

    def work(self) -> list[tuple[list[Node], int]]:
        """This cycle's stage step as (level's nodes, stage k), newest level first."""
        return [(level, k) for level, k in zip(reversed(self.levels), reversed(self.depths))]

    @property
    def exits(self) -> bool:
        """After a cycle's step and `grow`: the root has passed all n stages (it verifies level 1)."""
        return self.depths[0] == self.n_stages

    def draft_state(self, features: torch.Tensor, stepped: bool = False) -> DraftState:
        """The chain drafters' view (W = 1): the one path, the root as oldest in flight."""
        return DraftState(self.path_tokens(), self.root.position, self.n_stages, features, stepped)

    def tree_state(self, features: torch.Tensor) -> TreeDraftState:
        return TreeDraftState(self.tokens, self.levels, self.depths, self.n_stages, features)

    def path_tokens(self) -> list[int]:
        return self.tokens + [level[0].token for level in self.levels[1:]]

    def stage_mask(self, k: int, nodes: list[Node], device) -> TreeMask | None:
        """The mask of `nodes` running stage k; None when it is a chain (the causal mask is exact)."""
        return self.tails[k].mask(nodes, device)

    def ran(self, k: int, nodes: list[Node], hidden: torch.Tensor | None = None) -> None:
        """`nodes` ran stage k: their entries follow the tail of its caches; (1, w, H) outputs
        (None: the stage ran in another process, which keeps them)."""
        self.tails[k].ran(nodes)
        if hidden is not None:
            for i, node in enumerate(nodes):
                node.hidden = hidden[:, i:i + 1] if len(nodes) > 1 else hidden

    def shape(self, work: list[tuple[list[Node], int]], accepted: int) -> TreeShape:
        """`work` (see `work`) as the stages of the distributed runtime receive it."""
        stages = [()] * self.n_stages
        for level, k in work:
            stages[k] = tuple((node.uid, node.parent.uid if node.parent is not None else -1) for node in level)
        return TreeShape(accepted, tuple(stages))

    def grow(self, proposals: list[list[Candidate]], fill: int) -> list[Node]:
        """Children of the newest level from per-leaf candidates: the best W by path score
        (ties: leaf order, then the drafter's order), one node per distinct token per leaf."""
        scored = []
        for leaf, candidates in zip(self.newest, proposals):
            seen = set()
            for c in candidates:
                if c.token not in seen:
                    seen.add(c.token)
                    scored.append((leaf.score + c.logprob, len(scored), leaf, c))
        scored.sort(key=lambda s: (-s[0], s[1]))
        position = self.newest[0].position + 1
        level = [self._node(c.token, position, parent=leaf, score=score, source=c.source, fill=fill, q=c.q)
                 for score, _, leaf, c in scored[:self.width]]
        self.depths = [d + 1 for d in self.depths] + [0]   # after the step: one stage deeper
        self.levels.append(level)
        return level

    def settle(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
               ) -> tuple[Node | None, int, Node]:
        """The root finished: verify level 1 with its (V,) logits.

        Returns (the accepted child or None, emitted token, the child whose draft is counted).
        Accepted: it becomes the root, every branch not under it is dropped, and `pruned[k]` lists
        the tail entries stage k keeps (None: all). Rejected: the target's token restarts the
        pipeline; the caller crops every cache to its position.
        """
        root, children = self.root, self.levels[1]
        index, token = verify_multi([(c.token, c.q) for c in children], logits, params, gen)
        self.tokens.append(token)
        if index is None:
            self._restart(token, root.position + 1)
            self.pruned = [None] * self.n_stages
            return None, token, children[0]
        child = children[index]
        alive, levels = {child.uid}, [[child]]
        for level in self.levels[2:]:
            kept = [node for node in level if node.parent.uid in alive]
            if not kept:   # the surviving branch ends here: it goes on from its newest node
                break
            levels.append(kept)
            alive.update(node.uid for node in kept)
        child.parent = None   # the root's link is cut: lineages stay short
        self.levels, self.depths = levels, self.depths[1:1 + len(levels)]
        for k, tail in enumerate(self.tails):
            assert not tail.nodes or tail.nodes[0] is root
            _, self.pruned[k] = tail.settle(child.uid)
            assert all(node.uid in alive for node in tail.nodes)
        return child, token, child
