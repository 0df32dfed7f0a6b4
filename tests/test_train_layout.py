"""The training layout against inference: the structural mask, and train/serve parity of logits.

Parity is the key property of PDM training: the g_0 logits the training forward computes for a
position t and a pipeline fill f must be the logits the engine's PDMDrafter computes when t is
the newest token with f tokens in flight (older tokens finished, their rows in the PDM cache).
"""

import random

import pytest
import torch

from conftest import tiny_target
from spd import engine
from spd.baselines.ar import ar_generate
from spd.drafters import DraftState, PDMDrafter
from spd.pdm import PDM
from spd.sampling import SamplingParams
from spd.target import split_layers
from spd.train.features import target_pass
from spd.train.layout import make_layout, pdm_layout, sample_fills, structural_allowed
from spd.train.objective import DraftForward

ATOL = 1e-4


# ----- the structural mask against a reference written from the engine's point of view --------

def reference_allowed(n, depth_types, kind, S, fills):
    """Loops over rows: what the PDM row of depth r at position t sees in the cycle it belongs to."""
    if kind == "types":
        reps = [d for d in range(n + 1) if d == 0 or depth_types[d] != depth_types[d - 1]]
        block_of_depth = {d: max(i for i, r in enumerate(reps) if r <= d) for d in range(n + 1)}
    else:
        reps, block_of_depth = list(range(n + 1)), {d: d for d in range(n + 1)}
    blocks = list(reversed(reps))                      # deepest first
    nb = len(blocks)
    row = lambda b, t: b * S + t                        # noqa: E731
    allowed = torch.zeros(nb * S, nb * S, dtype=torch.bool)
    for qb, r in enumerate(blocks):
        for t in range(S):
            cycle = t + r                               # the newest position of that cycle
            f = fills[cycle] if cycle < S else n
            for p in range(t + 1):                      # every older-or-same position
                if r < f:                               # an in-flight row: the window's view
                    depth = cycle - p if cycle - p < f else n
                else:                                   # a finished row sees finished rows only
                    depth = n
                key_block = nb - 1 - block_of_depth[depth]
                allowed[row(qb, t), row(key_block, p)] = True
    return allowed


@pytest.mark.parametrize("n,depth_types", [(1, [0, 1]), (2, [0, 1, 2]), (3, [0, 1, 1, 2]),
                                           (4, [0, 1, 1, 2, 4]), (4, [0, 0, 1, 1, 2])])
@pytest.mark.parametrize("kind", ["types", "depths"])
def test_structural_mask_matches_reference(n, depth_types, kind):
    for S, seed in ((1, 0), (5, 1), (9, 2)):
        gen = torch.Generator().manual_seed(seed)
        for fills in (torch.full((S,), n), torch.full((S,), 1), sample_fills(S, n, 0.7, gen)):
            layout = make_layout(depth_types, kind)
            got = structural_allowed(layout, S, fills)
            want = reference_allowed(n, depth_types, kind, S, fills.tolist())
            assert torch.equal(got, want), (n, depth_types, kind, S, fills)
            assert got.any(dim=1).all()  # every row attends to something (no NaN rows)


def test_layout_blocks_and_errors():
    layout = make_layout([0, 1, 1, 2, 4], "types")
    assert layout.block_depths == (4, 3, 1, 0) and layout.block_types == (4, 2, 1, 0)
    assert [layout.block_of_depth(d) for d in range(5)] == [3, 2, 2, 1, 0]
    assert make_layout([0, 1, 1, 2, 4], "depths").num_blocks == 5
    with pytest.raises(ValueError, match="layout must be one of"):
        make_layout([0, 1], "rows")
    with pytest.raises(ValueError, match="needs its own block"):
        type(layout)(4, (0, 1, 1, 2, 4), (4, 1, 0))


# ----- parity: training forward vs the engine's PDM drafter ----------------------------------

def make_case(n, split=None, anchors=None, pdm_layers=1, vocab=None, family="llama", num_layers=6, seed=0):
    target = tiny_target(family, num_layers=num_layers, seed=seed)
    stage_layers = split or [len(s) for s in split_layers(num_layers, n)]
    draft_ids = sorted(random.Random(seed).sample(range(target.vocab_size), vocab)) if vocab else None
    pdm = PDM.create(target, stage_layers, anchors, pdm_layers, draft_ids, seed=seed + 1).eval()
    with torch.no_grad():  # random projections are small; make every row matter
        for proj in pdm.projections:
            proj.weight.mul_(3.0)
    return target, pdm


def train_logits(target, pdm, layout, seq, fills):
    """g_0 logits (S, V_d) of the training forward for one sequence and per-position fills."""
    ids = torch.tensor([seq])
    snaps, _ = target_pass(target, ids, pdm.anchors)
    features = torch.stack([snaps[a] for a in pdm.anchors], dim=2)
    mask = torch.zeros(structural_allowed(layout, len(seq), fills).shape)
    mask = mask.masked_fill(~structural_allowed(layout, len(seq), fills), torch.finfo(torch.float32).min)
    with torch.no_grad():
        return DraftForward(pdm, layout, target)(features, mask[None, None])


class Recorder:
    """Wraps the PDM's inference forward on this instance to keep the last row's logits."""

    def __init__(self, pdm):
        self.calls, inner = [], pdm.forward_window

        def forward_window(rows, positions, cache):
            out = inner(rows, positions, cache)
            self.calls.append(out.reshape(-1, out.shape[-1])[-1].clone())  # the newest row
            return out
        pdm.forward_window = forward_window


def serve_logits(target, pdm, seq, t, f):
    """What PDMDrafter computes when position t is newest with f tokens in flight; the PDM
    cache first committed the finished rows 0..t-f-1 in an earlier cycle (as after a reject)."""
    snaps, _ = target_pass(target, torch.tensor([seq]), pdm.anchors)
    features = torch.stack([snaps[a][0] for a in pdm.anchors], dim=1)   # (S, m, H)
    n = pdm.config.n_stages
    recorder, drafter = Recorder(pdm), PDMDrafter(pdm)
    drafter.begin(0)
    params, gen = SamplingParams(), torch.Generator()
    if t - f >= 0:  # an earlier cycle: t-f newest and alone in flight; commits 0..t-f-1
        drafter.draft(DraftState(seq[:t - f + 1], t - f, n, features), params, gen)
    drafter.draft(DraftState(seq[:t + 1], t - f + 1, n, features), params, gen)
    del pdm.forward_window
    return recorder.calls[-1]


CASES = {
    "n2-even-m=n+1": dict(n=2, num_layers=4),
    "n3-uneven-m<n+1-vocab": dict(n=3, split=[1, 2, 3], anchors=[0, 1, 6], vocab=40),
    "n3-uneven-m=n+1": dict(n=3, split=[3, 2, 1], anchors=[0, 3, 5, 6]),
    "n4-default-anchors-qwen3": dict(n=4, num_layers=8, split=[3, 2, 2, 1], family="qwen3"),
    "n1": dict(n=1, num_layers=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parity_every_position_and_fill(name):
    target, pdm = make_case(**CASES[name])
    layout = pdm_layout(pdm)
    n, S = pdm.config.n_stages, 10
    seq = torch.randint(0, target.vocab_size, (S,), generator=torch.Generator().manual_seed(3)).tolist()
    for f in range(1, n + 1):
        trained = train_logits(target, pdm, layout, seq, torch.full((S,), f))
        for t in range(f - 1, S):
            served = serve_logits(target, pdm, seq, t, f)
            torch.testing.assert_close(trained[t], served, atol=ATOL, rtol=0, msg=f"{name} t={t} f={f}")
    # per-position fills in one forward give each position its own cycle's logits
    fills = sample_fills(S, n, 0.6, torch.Generator().manual_seed(5)).clamp(max=torch.arange(1, S + 1))
    trained = train_logits(target, pdm, layout, seq, fills)
    for t in range(S):
        torch.testing.assert_close(trained[t], serve_logits(target, pdm, seq, t, int(fills[t])), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n,split,anchors", [(3, [2, 2, 2], [0, 2, 6]), (4, [2, 2, 1, 1], [0, 2, 5, 6])])
def test_parity_two_body_layers_needs_the_depth_layout(n, split, anchors):
    """N_s = 2: the one-block-per-depth layout is exact; the per-type layout is not (m < n+1)."""
    target, pdm = make_case(n, split=split, anchors=anchors, pdm_layers=2)
    assert len(anchors) < n + 1
    S = 9
    seq = torch.randint(0, target.vocab_size, (S,), generator=torch.Generator().manual_seed(4)).tolist()
    exact, per_type = make_layout_for(pdm, "depths"), make_layout_for(pdm, "types")
    assert pdm_layout(pdm).block_depths == exact.block_depths  # auto picks the exact one
    worst = 0.0
    for f in range(1, n + 1):
        fills = torch.full((S,), f)
        trained, approx = train_logits(target, pdm, exact, seq, fills), train_logits(target, pdm, per_type, seq, fills)
        for t in range(f - 1, S):
            served = serve_logits(target, pdm, seq, t, f)
            torch.testing.assert_close(trained[t], served, atol=ATOL, rtol=0, msg=f"t={t} f={f}")
            worst = max(worst, float((approx[t] - served).abs().max()))
    assert worst > 1e-3  # the caveat docs/training.md describes


def make_layout_for(pdm, kind):
    return make_layout([pdm.type_of_depth(d) for d in range(pdm.config.n_stages + 1)], kind)


class ScheduledDrafter:
    """The real PDM drafter, but the token it proposes is the target's own (accept) or a wrong
    one (reject) on a fixed random schedule, so the run passes through every pipeline fill."""

    def __init__(self, pdm, continuation, prompt_len, vocab_size, seed=0):
        self.inner, self.recorder = PDMDrafter(pdm), Recorder(pdm)
        self.anchors, self.after_stages = self.inner.anchors, False
        self.continuation, self.prompt_len, self.vocab = continuation, prompt_len, vocab_size
        self.rng, self.states = random.Random(seed), []

    def begin(self, prompt_len):
        self.inner.begin(prompt_len)

    def draft(self, state, params, gen):
        self.inner.draft(state, params, gen)
        self.states.append((list(state.tokens), state.first_inflight))
        right = self.continuation[min(state.newest + 1 - self.prompt_len, len(self.continuation) - 1)]
        return (right if self.rng.random() < 0.8 else (right + 1) % self.vocab), None


@pytest.mark.parametrize("name", ["n3-uneven-m<n+1-vocab", "n4-default-anchors-qwen3"])
def test_parity_along_a_real_engine_run(name):
    """Every draft the engine makes from a correct prefix equals the training forward's g_0 row."""
    target, pdm = make_case(**CASES[name])
    prompt = [3, 17, 5, 9]
    continuation, _ = ar_generate(target, prompt, SamplingParams(), 30, ())
    stages = split_layers(target.num_layers, pdm.config.n_stages, list(pdm.config.stage_layers))
    drafter = ScheduledDrafter(pdm, continuation, len(prompt), target.vocab_size)
    out = engine.generate(target, drafter, prompt, stages, SamplingParams(), 30, ())
    assert out.tokens == continuation and out.stats.rejected > 2 and out.stats.accepted > 2
    final = prompt + continuation
    layout, n = pdm_layout(pdm), pdm.config.n_stages
    checked, fills_seen = 0, set()
    for (tokens, first_inflight), served in zip(drafter.states, drafter.recorder.calls):
        t = len(tokens) - 1
        if tokens != final[:t + 1] or t + 1 >= len(final):
            continue  # drafted behind a wrong draft: discarded by the engine anyway
        f = t - first_inflight + 1
        trained = train_logits(target, pdm, layout, final[:t + 2], torch.full((t + 2,), f))
        torch.testing.assert_close(trained[t], served, atol=ATOL, rtol=0, msg=f"t={t} f={f}")
        checked, fills_seen = checked + 1, fills_seen | {f}
    assert checked >= 10 and fills_seen == set(range(1, n + 1))


def test_batched_padded_forward_equals_one_sequence_at_a_time():
    target, pdm = make_case(**CASES["n3-uneven-m<n+1-vocab"])
    layout = pdm_layout(pdm)
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in (9, 5)]
    fills = sample_fills(9, 3, 0.5, gen)
    padded = torch.tensor([seqs[0], seqs[1] + [0] * 4])
    snaps, _ = target_pass(target, padded, pdm.anchors)
    features = torch.stack([snaps[a] for a in pdm.anchors], dim=2)
    allowed = structural_allowed(layout, 9, fills)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        both = DraftForward(pdm, layout, target)(features, mask).reshape(2, 9, -1)
    for row, seq in enumerate(seqs):
        alone = train_logits(target, pdm, layout, seq, fills[:len(seq)])
        torch.testing.assert_close(both[row, :len(seq)], alone, atol=ATOL, rtol=0)
