"""Acceptance of a drafter on a known greedy continuation, without running the target token by token.

Greedy SPD emits the target's greedy continuation, so its whole run (which drafts are accepted,
how many cycles) is fixed by that continuation and the PDM. `replay()` walks the engine's
schedule over the known sequence: the anchor features of every position come from ONE forward
of the target over prompt + continuation, and each cycle asks the real drafter (PDM, retrieval
or hybrid) for its draft, exactly as `engine.stream` does. A draft made while a wrong draft is still in flight is
dropped by the engine before it matters, so replay does not compute it.

The counts equal the engine's up to floating-point noise between a full-sequence forward and
token-by-token decoding (a near-tie may flip a draft); `tests/test_acceptance.py` checks they
match the engine on tiny models. Use it to measure acceptance on hundreds of prompts; use the
engine itself to check token identity. Post-step drafters (PPSD) get the features of the same
cycle's stage step, as in the engine.

`eagle_replay()` does the same for EAGLE-style chain and tree drafting: each round the real head
drafts from the true features of the verified prefix (from the one forward), and the verification
forward is replaced by rows whose argmax is the known next token, checked by the baseline's own
`accept_prefix` / `accept_path`. Token trees of tree SPD (width > 1) cannot be replayed: the
drafter scores every node of a level, including wrong ones, from their own hidden states.

Sampling (T > 0) replays AR's sampled continuation, which has the law of every lossless method's
output. Speculative sampling emits token x after accepting a draft with probability min(p, q)(x)
out of the p(x) that x has in all, so given x the draft was accepted with probability
min(1, q(x) / p(x)) (`agrees`): drawing that coin for each draft against the known token gives
the engine's joint law of tokens and acceptances (not its per-seed counts), with p from the one
forward. A point-mass draft (retrieval, greedy) is accepted iff it equals x; so is an EAGLE tree's
child, whose candidates are point masses (multi-draft rejection never emits a rejected one). An
accepted draft is the known token, so chains are drafted along the known tokens.
"""

from __future__ import annotations

import torch

from ..baselines.eagle import Decoding, EagleHead, EagleStats, accept_prefix, chain_drafts
from ..baselines.eagle_tree import TreeOptions, accept_path, draft_tree
from ..cache import KVCache
from ..drafters import DraftState, draft_source
from ..retrieval import SuffixIndex
from ..sampling import SamplingParams, probs
from ..stages import store_snapshots
from ..stats import SPDStats
from ..target import Target


@torch.inference_mode()
def sequence_snapshots(target: Target, sequence: list[int], anchors) -> dict:
    """{anchor: (S, H)} hidden states of the whole sequence from one forward of the target."""
    _, snapshots = target.prefill(torch.tensor(sequence, device=target.device),
                                  target.new_cache(keep=1), set(anchors))
    return snapshots


def feature_table(target: Target, snapshots: dict, anchors, length: int) -> torch.Tensor:
    """(length+1, m, H): the drafter's anchors of positions 0..length-1 (the engine's layout)."""
    features = torch.zeros(length + 1, len(anchors), target.hidden_size, device=target.device,
                           dtype=target.dtype)
    store_snapshots(features, slice(0, length), snapshots, {a: i for i, a in enumerate(anchors)})
    return features


@torch.inference_mode()
def sequence_features(target: Target, sequence: list[int], anchors) -> tuple[torch.Tensor, torch.Tensor]:
    """((S+1, m, H) anchor features table, (S, H) pre-norm last-layer states) from one forward."""
    last = target.num_layers
    snapshots = sequence_snapshots(target, sequence, set(anchors) | {last})
    return feature_table(target, snapshots, anchors, len(sequence)), snapshots[last]


def agrees(draft: int, q: torch.Tensor | None, token: int, p: torch.Tensor | None,
           gen: torch.Generator) -> bool:
    """Whether verification accepted `draft` at a position whose output is known to be `token`:
    equal tokens for a point mass (q None) or greedy (p None), else a coin with probability
    min(1, q(token) / p(token)) (see the module docstring)."""
    if q is None or p is None:
        return draft == token
    p_x, q_x = float(p[token]), float(q[token])
    u = float(torch.rand((), generator=gen, device=p.device))
    return u * p_x < q_x   # u < min(1, q/p); p_x = 0 (float noise of the one forward): iff q_x > 0


def replay_generator(params: SamplingParams, device) -> torch.Generator:
    """The replay's draws (drafts, coins), seeded apart from `params.seed`, which sampled the
    known tokens: the same stream would tie the coins to the tokens they judge."""
    gen = torch.Generator(device=device)
    gen.manual_seed(((params.seed or 0) + 0x9E3779B97F4A7C15) % 2**63)
    return gen


class TargetProbs:
    """The target's processed next-token probabilities (`probs`) from one forward, by position:
    probs(t) is the law of sequence[t]; None throughout when greedy."""

    def __init__(self, target: Target, snapshots: dict, params: SamplingParams):
        self.params = params
        # every row's logits in one lm_head product: row by row would read its weight once per draft
        self.logits = None if params.greedy else target.logits(snapshots[target.num_layers])

    def __call__(self, t: int) -> torch.Tensor | None:
        return None if self.logits is None else probs(self.logits[t - 1], self.params)


@torch.inference_mode()
def replay(target: Target, drafter, prompt_ids: list[int], continuation: list[int],
           n_stages: int, snapshots: dict | None = None, params: SamplingParams = SamplingParams()) -> SPDStats:
    """SPD statistics (cycles, accepted, rejected) for decoding `continuation` (greedy, or sampled
    with `params`: then one draw of the acceptances' law given these tokens).

    `snapshots` (from `sequence_snapshots` over prompt + continuation, covering the drafter's
    anchors and, when sampling, the last layer) lets several drafters share one forward."""
    device, prompt_len = target.device, len(prompt_ids)
    sequence = list(prompt_ids) + list(continuation)
    if snapshots is None:
        snapshots = sequence_snapshots(target, sequence, set(drafter.anchors) | {target.num_layers})
    features = feature_table(target, snapshots, drafter.anchors, len(sequence))
    p_of = TargetProbs(target, snapshots, params)

    stats = SPDStats(n_stages, prompt_tokens=prompt_len, new_tokens=1, stage_seconds=[0.0] * n_stages,
                     verified_by_fill=[0] * n_stages, accepted_by_fill=[0] * n_stages)
    gen = replay_generator(params, device)
    drafter.begin(prompt_len)
    first_inflight, newest = prompt_len, prompt_len
    wrong_inflight = None          # position of the oldest wrong draft in flight, if any
    drafted = {}                   # draft position -> (pipeline fill when drafted, its source)
    while stats.new_tokens < len(continuation):
        if wrong_inflight is None and newest + 1 < len(sequence):
            state = DraftState(sequence[: newest + 1], first_inflight, n_stages, features, drafter.after_stages)
            draft, q = drafter.draft(state, params, gen)
            drafted[newest + 1] = (newest - first_inflight + 1, draft_source(drafter))
            if not agrees(draft, q, sequence[newest + 1], p_of(newest + 1), gen):
                wrong_inflight = newest + 1
        stats.add_cycle([1] * (newest - first_inflight + 1))   # every in-flight token ran one stage
        newest += 1
        if newest - first_inflight == n_stages:  # the oldest finished: verify the next position
            checked = first_inflight + 1
            first_inflight = checked
            stats.new_tokens += 1
            stats.verified_candidates += 1
            stats.count(*drafted.pop(checked), checked != wrong_inflight)
            if checked == wrong_inflight:
                newest, wrong_inflight = checked, None  # the corrected token restarts the pipeline
                drafted.clear()
    return stats


def known_logits(sequence: list[int], positions, vocab_size: int) -> torch.Tensor:
    """(len(positions), V) rows whose argmax is the token after each position: what a greedy
    verification forward over the known continuation would decide."""
    rows = torch.zeros(len(positions), vocab_size)
    rows[torch.arange(len(positions)), torch.tensor([sequence[p + 1] for p in positions])] = 1.0
    return rows


@torch.inference_mode()
def eagle_replay(target: Target, head: EagleHead, prompt_ids: list[int], continuation: list[int],
                 max_new_tokens: int, k: int | None = None, tree: TreeOptions | None = None,
                 retrieval_min_len: int | None = None, snapshots: dict | None = None,
                 params: SamplingParams = SamplingParams()) -> EagleStats:
    """EAGLE-style statistics for decoding `continuation` (greedy, or sampled with `params` as in
    `replay`): chains of k drafts (with the
    retrieved chain of `eagle_stream` when retrieval_min_len is set) or trees of `tree`'s shape.
    Rounds draft no further than `eagle.decode_rounds` would (its budget, `max_new_tokens`), nor
    past the known tokens (only a continuation that ended at EOS can make that differ)."""
    assert (k is None) != (tree is None)
    sequence, vocab = list(prompt_ids) + list(continuation), target.vocab_size
    if snapshots is None:
        snapshots = sequence_snapshots(target, sequence, set(head.feature_layers) | {target.num_layers})
    features = torch.stack([snapshots[i] for i in head.feature_layers], 1)
    p_of = TargetProbs(target, snapshots, params)
    depth = tree.depth if tree is not None else k
    stats = EagleStats(depth, prompt_tokens=len(prompt_ids), new_tokens=1,
                       verified_by_position=[0] * depth, accepted_by_position=[0] * depth)
    gen, greedy = replay_generator(params, target.device), SamplingParams()
    state = Decoding(target, head, params, gen, stats, sequence[:len(prompt_ids) + 1], None, KVCache([0]), features)
    index = SuffixIndex() if retrieval_min_len is not None else None
    while stats.new_tokens < len(continuation):
        c = state.c
        room = min(max_new_tokens - stats.new_tokens - 1, len(sequence) - 2 - c)
        if tree is None:
            drafts, qs, source = chain_drafts(state, k, room, index, retrieval_min_len, sequence[c + 1:c + 1 + k])
            # the coins decide; then the known rows verify the known token (accepted) or another
            coupled = []
            for j, (draft, q) in enumerate(zip(drafts, qs)):
                x = sequence[c + 1 + j]
                coupled.append(x if agrees(draft, q, x, p_of(c + 1 + j), gen) else (x + 1) % vocab)
                if coupled[-1] != x:
                    break
            accepted, token = accept_prefix(coupled, [None] * len(coupled),
                                            known_logits(sequence, range(c, c + len(drafts) + 1), vocab),
                                            greedy, gen, stats, source)
            emitted = coupled[:accepted] + [token]
            stats.count_forward(len(drafts) + 1)
        else:
            root, nodes, calls = draft_tree(head, state.head_cache, state.tokens, features, c, tree, params, depth=room)
            stats.draft_forwards += calls
            block = [root] + nodes
            path, token = accept_path(root, nodes, known_logits(sequence, [n.position for n in block], vocab),
                                      greedy, gen, stats)
            emitted = [nodes[i].token for i in path] + [token]
            stats.count_forward(len(block))
        state.head_cache.crop(c)   # as the rounds do: rows on the head's own outputs are redone
        stats.rounds += 1
        emitted = emitted[:len(continuation) - stats.new_tokens]   # the decode stops at EOS / the budget
        assert emitted == sequence[c + 1:c + 1 + len(emitted)]
        state.tokens += emitted
        stats.new_tokens += len(emitted)
    return stats
