"""Acceptance of a PDM on a known greedy continuation, without running stages token by token.

Greedy SPD emits the target's greedy continuation, so its whole run (which drafts are accepted,
how many cycles) is fixed by that continuation and the PDM. `replay()` walks the engine's
schedule over the known sequence: the anchor features of every position come from ONE forward
of the target over prompt + continuation, and each cycle asks the real drafter (PDM, retrieval
or hybrid) for its draft, exactly as `engine.stream` does. A draft made while a wrong draft is still in flight is
dropped by the engine before it matters, so replay does not compute it.

The counts equal the engine's up to floating-point noise between a full-sequence forward and
token-by-token decoding (a near-tie may flip a draft); `tests/test_acceptance.py` checks they
match the engine on tiny models. Use it to measure acceptance on hundreds of prompts; use the
engine itself to check token identity.
"""

from __future__ import annotations

import torch

from ..drafters import DraftState, draft_source
from ..engine import SPDStats, store_snapshots
from ..sampling import SamplingParams
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


@torch.inference_mode()
def replay(target: Target, drafter, prompt_ids: list[int], continuation: list[int],
           n_stages: int, snapshots: dict | None = None) -> SPDStats:
    """SPD statistics (cycles, accepted, rejected) for greedy decoding of `continuation`.

    `snapshots` (from `sequence_snapshots` over prompt + continuation, covering the drafter's
    anchors) lets several drafters share one forward."""
    device, prompt_len = target.device, len(prompt_ids)
    sequence = list(prompt_ids) + list(continuation)
    if snapshots is None:
        snapshots = sequence_snapshots(target, sequence, drafter.anchors)
    features = feature_table(target, snapshots, drafter.anchors, len(sequence))

    stats = SPDStats(n_stages, prompt_tokens=prompt_len, new_tokens=1, stage_seconds=[0.0] * n_stages,
                     verified_by_fill=[0] * n_stages, accepted_by_fill=[0] * n_stages)
    params, gen = SamplingParams(), torch.Generator(device=device)
    drafter.begin(prompt_len)
    first_inflight, newest = prompt_len, prompt_len
    wrong_inflight = None          # position of the oldest wrong draft in flight, if any
    drafted = {}                   # draft position -> (pipeline fill when drafted, its source)
    while stats.new_tokens < len(continuation):
        if wrong_inflight is None and newest + 1 < len(sequence):
            state = DraftState(sequence[: newest + 1], first_inflight, n_stages, features)
            draft, _ = drafter.draft(state, params, gen)
            drafted[newest + 1] = (newest - first_inflight + 1, draft_source(drafter))
            if draft != sequence[newest + 1]:
                wrong_inflight = newest + 1
        stats.cycles += 1
        newest += 1
        if newest - first_inflight == n_stages:  # the oldest finished: verify the next position
            checked = first_inflight + 1
            first_inflight = checked
            stats.new_tokens += 1
            stats.count(*drafted.pop(checked), checked != wrong_inflight)
            if checked == wrong_inflight:
                newest, wrong_inflight = checked, None  # the corrected token restarts the pipeline
                drafted.clear()
    return stats
