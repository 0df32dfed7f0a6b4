"""The multi-depth training layout (SPEC section 4): blocks of rows and the structural mask.

One frozen-target pass gives every position's hidden states at every anchor. Training lays a
sequence of length S out as `num_blocks` blocks of S rows; the block with representative depth r
holds, at each position, that position's row of type type(r). Position ids repeat 0..S-1 per
block, blocks go deepest first, and the g_0 block (depth 0) is last. The structural mask lets
each row attend to exactly the rows that the engine's PDM window would hold for it.

What inference computes (engine.stream + PDMDrafter), for the cycle whose newest token is at
position c with f tokens in flight (f = n: full pipeline; f < n: refilling after a rejection):
a token at distance e = c - T from the newest is at depth e if e < f (in flight), else n
(finished). A PDM row of depth d at position T belongs to cycle c = T + d; it attends to the
key at distance delta (position T - delta) at depth

    key_depth(d, delta, f) = d + delta   if d + delta < f   else n.

Finished rows (d = n) attend finished rows only: the PDM cache holds exactly those.

Two block lists (both from `make_layout`):
- "types" (the spec's m blocks): one block per aggregation type, representative depth = the
  smallest depth of that type. Exact for the g_0 output when the PDM has N_s = 1 layer (a key
  row enters only through its key/value projections, which depend on its type alone).
- "depths": one block per depth 0..n. Exact for any N_s: with N_s >= 2 a key row's deeper
  keys/values depend on its own attention context, which at inference follows its actual depth.
Both coincide when every depth has its own type (m = n+1 types in use).

Each cycle c draws its own fill f_c (`sample_fills`), so one sequence trains full and partial
pipelines at once; a row of representative depth r at position T uses the fill of cycle T + r.
Pure functions of integers and tensors: no models here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("types", "depths")


@dataclass(frozen=True)
class Layout:
    """Which depth each block represents, and which aggregation type its rows use."""

    n_stages: int
    depth_types: tuple[int, ...]    # aggregation type of depth d, d = 0..n
    block_depths: tuple[int, ...]   # representative depth per block, deepest first (g_0 last)

    def __post_init__(self):
        n, depths = self.n_stages, sorted(self.block_depths)
        assert len(self.depth_types) == n + 1, self.depth_types
        if tuple(reversed(depths)) != self.block_depths or len(set(depths)) != len(depths):
            raise ValueError(f"block depths must be distinct and deepest first, got {self.block_depths}")
        if depths[0] != 0 or depths[-1] > n:
            raise ValueError(f"block depths must include 0 and lie in 0..{n}, got {self.block_depths}")
        for d in range(n + 1):  # every depth's rows must be the rows of the block it maps to
            if self.depth_types[d] != self.depth_types[self.block_depths[self.block_of_depth(d)]]:
                raise ValueError(f"block depths {self.block_depths} put depth {d} (type "
                                 f"{self.depth_types[d]}) in a block of another type; every "
                                 f"change of type needs its own block")

    @property
    def num_blocks(self) -> int:
        return len(self.block_depths)

    @property
    def block_types(self) -> tuple[int, ...]:
        return tuple(self.depth_types[r] for r in self.block_depths)

    @property
    def g0_block(self) -> int:
        return self.num_blocks - 1

    def block_of_depth(self, depth: int) -> int:
        """The block holding rows of `depth`: the one with the largest representative depth <= it."""
        return min(b for b, r in enumerate(self.block_depths) if r <= depth)

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """(num_blocks * S,) position ids: 0..S-1 once per block."""
        return torch.arange(seq_len, device=device).repeat(self.num_blocks)


def make_layout(depth_types: list[int], kind: str = "types") -> Layout:
    """Layout for a PDM whose depth d (0..n) has type depth_types[d]; kind "types" or "depths"."""
    n = len(depth_types) - 1
    if kind == "types":
        reps = [d for d in range(n + 1) if d == 0 or depth_types[d] != depth_types[d - 1]]
    elif kind == "depths":
        reps = list(range(n + 1))
    else:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {kind!r}")
    return Layout(n, tuple(depth_types), tuple(reversed(reps)))


def pdm_layout(pdm, kind: str = "auto") -> Layout:
    """The layout for a PDM: "auto" is the cheapest one that is exact for its N_s."""
    depth_types = [pdm.type_of_depth(d) for d in range(pdm.config.n_stages + 1)]
    if kind == "auto":
        kind = "types" if pdm.config.num_layers == 1 else "depths"
    return make_layout(depth_types, kind)


def key_depth(depth: torch.Tensor, delta: torch.Tensor, fill: torch.Tensor, n: int) -> torch.Tensor:
    """Depth at which a row of `depth` sees the key `delta` positions back, `fill` in flight."""
    reached = depth + delta
    return torch.where(reached < fill, reached, torch.full_like(reached, n))


def sample_fills(seq_len: int, n: int, partial_prob: float, gen: torch.Generator | None = None) -> torch.Tensor:
    """(S,) tokens in flight for the cycle at each position: n (full) with probability
    1 - partial_prob, else uniform in 1..n-1 (the reference mixes half full, half partial)."""
    if n == 1 or partial_prob <= 0:
        return torch.full((seq_len,), n, dtype=torch.long)
    partial = torch.rand(seq_len, generator=gen) < partial_prob
    fills = torch.randint(1, n, (seq_len,), generator=gen)
    return torch.where(partial, fills, torch.full_like(fills, n))


def structural_allowed(layout: Layout, seq_len: int, fills: torch.Tensor | None = None,
                       device=None) -> torch.Tensor:
    """(R, R) bool, R = num_blocks * S: may the row i (query) attend to the row j (key)?

    `fills` is the (S,) fill of the cycle at each position (None: full pipelines everywhere).
    """
    n, S = layout.n_stages, seq_len
    if fills is None:
        fills = torch.full((S,), n, dtype=torch.long)
    assert fills.shape == (S,) and int(fills.min()) >= 1 and int(fills.max()) <= n, fills
    # cycles past the end have no g_0 query; their rows only feed nothing that is scored
    fills = torch.cat([fills.to(device=device, dtype=torch.long),
                       torch.full((n,), n, dtype=torch.long, device=device)])
    t = torch.arange(S, device=device)
    delta = t[:, None] - t[None, :]                               # (S query, S key)
    block_of = torch.tensor([layout.block_of_depth(d) for d in range(n + 1)], device=device)
    allowed = torch.zeros(layout.num_blocks, S, layout.num_blocks, S, dtype=torch.bool, device=device)
    for b, r in enumerate(layout.block_depths):
        fill = fills[t + r][:, None]                              # cycle of row (b, t) is t + r
        kd = key_depth(torch.full_like(delta, r), delta.clamp(min=0), fill, n)
        key_block = block_of[kd]                                  # (S, S)
        for kb in range(layout.num_blocks):
            allowed[b, :, kb] = (delta >= 0) & (key_block == kb)
    return allowed.reshape(layout.num_blocks * S, layout.num_blocks * S)


def structural_mask(layout: Layout, seq_len: int, fills: torch.Tensor | None = None,
                    dtype=torch.float32, device=None) -> torch.Tensor:
    """Additive (1, 1, R, R) mask for `PDM.body`: 0 where allowed, the dtype's min elsewhere."""
    allowed = structural_allowed(layout, seq_len, fills, device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
