"""One cost model for every method, and the measured cost of each draft forward.

Unit: one full forward of the target for one new token (all L layers + lm_head) costs 1.

| method | one step | its cost |
|---|---|---|
| AR | one target forward per token | 1 |
| SPD (n stages) | one cycle: every stage runs one token; the PDM drafts concurrently | max(1/n, c_draft) |
| PPSD (n stages) | one cycle; the early-exit head runs after stage 1 (serial) | 1/n + c_draft |
| EAGLE-style (k) | one round: k draft forwards, then one target forward over k+1 tokens | 1 + k * c_draft |
| EAGLE-style tree (B) | one round: `depth` head forwards, then one target forward over B+1 tokens | 1 + depth * c_draft |

c_draft is a draft forward's measured fraction of a target forward (`draft_fraction`: the
median time of one steady-state draft call over the median time of one single-token target
forward, the two called in turn, same machine, same context length; for a tree, the mean of
one head forward within a whole tree draft: 1 row, then top_k-row forwards). A target forward
over k+1 (or B+1) positions counts as 1 (memory-bound decoding on a GPU).

The second, *measured* cost prices that forward at v_T, its measured time over a 1-token
forward on this machine (`verify_fraction`; v_1 = 1; a round of fewer tokens, near the end of
the budget, at v interpolated linearly between 1 and T). SPD / PPSD with one candidate per level
run one token per stage, so both costs agree there. Tree SPD (W > 1) runs a level of up to W
tokens through each stage: the common model counts a cycle as max(1/n, c_draft) whatever its
width; the measured one prices a cycle whose widest level holds w tokens at max(v_w / n, c_draft)
(the record's `cycles_by_width`; v_w from a W-token forward, interpolated like above).

theoretical speedup = decode tokens / decode cost, decode tokens = new tokens - 1 (the prefill
gives the first token for every method), so AR is exactly 1.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..cache import KVCache
from ..drafters import DraftState
from ..sampling import SamplingParams
from ..target import Target, attention_mask

KINDS = ("ar", "spd", "ppsd", "eagle")


def step_cost(kind: str, draft_fraction: float, n: int | None = None) -> float:
    """Cost of one cycle (spd, ppsd) or of one target forward (ar) in target forwards."""
    if kind == "ar":
        return 1.0
    if kind == "spd":
        return max(1.0 / n, draft_fraction)
    if kind == "ppsd":
        return 1.0 / n + draft_fraction
    raise ValueError(f"no per-step cost for {kind!r}")


def decode_cost(record: dict, draft_fraction: float) -> float:
    """Decode cost of one per-prompt record in target forwards (see the module table)."""
    kind = record["kind"]
    if kind == "ar":
        return float(record["target_forwards"])
    if kind in ("spd", "ppsd"):
        return record["cycles"] * step_cost(kind, draft_fraction, record["n"])
    if kind == "eagle":
        return record["target_forwards"] + record["draft_forwards"] * draft_fraction
    raise ValueError(f"unknown method kind {kind!r}; known: {', '.join(KINDS)}")


def measured_decode_cost(record: dict, draft_fraction: float, verify: dict | None) -> float | None:
    """Decode cost with each verification forward priced at its measured v_T (see the module
    docstring); `verify` = {"tokens": T, "fraction": v_T} from `verify_fraction`. None where the
    method has no measured cost (no verify measurement, or records from before it was kept)."""
    kind = record["kind"]
    if kind in ("ar", "ppsd") or (kind == "spd" and (record.get("tree_width") or 1) == 1):
        return decode_cost(record, draft_fraction)
    sizes = record.get("cycles_by_width" if kind == "spd" else "verify_sizes")
    if kind not in ("spd", "eagle") or verify is None or not sizes:
        return None
    tokens, fraction = verify["tokens"], verify["fraction"]
    slope = (fraction - 1.0) / (tokens - 1) if tokens > 1 else 0.0
    price = lambda size: 1.0 + slope * (int(size) - 1)  # noqa: E731   v_size
    if kind == "spd":   # a cycle lasts as long as a stage's widest level (or the concurrent draft)
        return sum(count * max(price(size) / record["n"], draft_fraction) for size, count in sizes.items())
    return sum(count * price(size) for size, count in sizes.items()) + record["draft_forwards"] * draft_fraction


def interleaved_medians(fns, reps: int = 15, warmup: int = 3) -> list[float]:
    """Median seconds of each function, called in turn (round robin) so that a change of load
    on the machine hits all of them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def median_seconds(fn, reps: int = 15, warmup: int = 3) -> float:
    return interleaved_medians([fn], reps, warmup)[0]


@torch.inference_mode()
def target_step(target: Target, context: int):
    """A callable running one new token through every layer and the lm_head after `context`
    cached positions (the cache is cropped back after each call)."""
    device = target.device
    cache = target.new_cache(keep=2)   # cropped back after every step
    target.prefill(torch.zeros(context, dtype=torch.long, device=device), cache)
    token, position = torch.zeros(1, dtype=torch.long, device=device), torch.tensor([context], device=device)

    @torch.inference_mode()
    def step():
        hidden, _ = target.run_layers(target.embed(token), position, range(target.num_layers), cache)
        int(target.logits(hidden[0, -1]).argmax())
        cache.crop(context)
    return step


@torch.inference_mode()
def pipeline_draft_step(target: Target, drafter, n: int, context: int):
    """A callable making one steady-state draft call of an engine drafter (SPD's PDM or PPSD's
    head, or the hybrid's lookup + PDM): a full pipeline of n in flight after `context` finished
    positions, random features."""
    gen = torch.Generator().manual_seed(0)
    columns = max(1, len(drafter.anchors))
    features = torch.randn(context + n + 1, columns, target.hidden_size, generator=gen).to(
        device=target.device, dtype=target.dtype)
    # distinct token ids: no retrieval match, so a hybrid drafter pays for its PDM forward too
    state = DraftState(list(range(context + n)), context, n, features, stepped=drafter.after_stages)
    params, sample_gen = SamplingParams(), torch.Generator(device=target.device)
    drafter.begin(context)
    drafter.draft(state, params, sample_gen)  # fills the drafter's cache with the finished rows
    return lambda: drafter.draft(state, params, sample_gen)


@torch.inference_mode()
def eagle_draft_step(target: Target, head, context: int):
    """A callable making one chain step of the EAGLE-style head (one row on its cache of
    `context` rows, then its lm_head)."""
    device = target.device
    cache = KVCache([0])
    feature = torch.randn(1, context, target.hidden_size, generator=torch.Generator().manual_seed(0))
    feature = feature.to(device=device, dtype=target.dtype)
    ids = torch.zeros(1, context, dtype=torch.long, device=device)
    positions = torch.arange(context, device=device)
    out = head(ids, feature, positions, attention_mask(positions, context, feature.dtype), cache)
    one, position = ids[:, :1], torch.tensor([context], device=device)

    @torch.inference_mode()
    def step():
        int(head.logits(head(one, out[:, -1:], position, None, cache)[0, -1]).argmax())
        cache.crop(context)
    return step


@torch.inference_mode()
def verify_step(target: Target, context: int, tokens: int):
    """A callable running `tokens` new positions (causal mask) through every layer and the lm_head
    after `context` cached positions: a verification forward of a chain or tree of that size."""
    device = target.device
    cache = target.new_cache(keep=2)
    target.prefill(torch.zeros(context, dtype=torch.long, device=device), cache)
    block = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.arange(context, context + tokens, device=device)

    @torch.inference_mode()
    def step():
        hidden, _ = target.run_layers(target.embed(block), positions, range(target.num_layers), cache)
        target.logits(hidden[0]).argmax(-1).tolist()
        cache.crop(context)
    return step


def verify_fraction(target: Target, context: int, tokens: int, reps: int = 15) -> tuple[float, float, float]:
    """(v_T, seconds of a T-token forward, seconds of a 1-token forward), interleaved medians."""
    many, one = interleaved_medians([verify_step(target, context, tokens), target_step(target, context)], reps)
    return measure_fraction(many, one), many, one


@torch.inference_mode()
def head_rows_step(target: Target, head, context: int, rows: int):
    """A callable running one head forward of `rows` tree rows (each seeing the cached rows and
    itself) on a head cache of `context` rows, then its lm_head: a tree draft's per-depth work."""
    device = target.device
    cache = KVCache([0])
    feature = torch.randn(1, context + rows, target.hidden_size, generator=torch.Generator().manual_seed(0))
    feature = feature.to(device=device, dtype=target.dtype)
    ids = torch.zeros(1, context + rows, dtype=torch.long, device=device)
    positions = torch.arange(context, device=device)
    head(ids[:, :context], feature[:, :context], positions, attention_mask(positions, context, feature.dtype), cache)
    row_positions = torch.full((rows,), context, device=device)
    allowed = torch.cat([torch.ones(rows, context, dtype=torch.bool), torch.eye(rows, dtype=torch.bool)], 1)
    mask = torch.zeros(allowed.shape, dtype=feature.dtype).masked_fill(~allowed, torch.finfo(feature.dtype).min)
    mask = mask.to(device)[None, None]

    @torch.inference_mode()
    def step():
        out = head(ids[:, context:], feature[:, context:], row_positions, mask, cache)
        head.logits(out[0]).argmax(-1).tolist()
        cache.crop(context)
    return step


@torch.inference_mode()
def eagle_tree_draft_step(target: Target, head, options, context: int):
    """A callable drafting one whole tree (`spd.baselines.eagle_tree.draft_tree`, greedy scores)
    on a head cache of `context` true rows, random features; `.calls` head forwards per call."""
    from ..baselines.eagle_tree import draft_tree

    device = target.device
    cache = KVCache([0])
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(context + 1, len(head.feature_layers), target.hidden_size, generator=gen)
    features = features.to(device=device, dtype=target.dtype)
    tokens = torch.randint(0, target.vocab_size, (context + 2,), generator=gen).tolist()
    params = SamplingParams()
    draft_tree(head, cache, tokens, features, context, options, params)   # fills rows 0..context-1
    cache.crop(context - 1)

    @torch.inference_mode()
    def step():
        draft_tree(head, cache, tokens, features, context, options, params)
        cache.crop(context - 1)
    step.calls = options.depth
    return step


def target_forward_seconds(target: Target, context: int, reps: int = 15) -> float:
    return median_seconds(target_step(target, context), reps)


def draft_fraction(target: Target, draft_step, context: int, reps: int = 21) -> tuple[float, float, float]:
    """(c_draft, draft seconds, target seconds): medians of interleaved draft and target steps;
    a step that makes several draft forwards (`step.calls`, a tree draft) is divided by them."""
    draft_s, target_s = interleaved_medians([draft_step, target_step(target, context)], reps)
    draft_s /= getattr(draft_step, "calls", 1)
    return measure_fraction(draft_s, target_s), draft_s, target_s


def measure_fraction(draft_seconds: float, target_seconds: float) -> float:
    return draft_seconds / target_seconds if target_seconds > 0 else 0.0


def retrieval_step(context: int, n: int, gate=None):
    """A callable doing one cycle's retrieval work at `context` tokens: the newest in-flight draft
    replaced (a truncation and an append), the lookup, and the gate's decision."""
    import random

    from ..retrieval import Gate, SuffixIndex

    gate = gate or Gate()
    rng = random.Random(0)
    tokens = [rng.randrange(512) for _ in range(context + n)]   # a small vocabulary: matches occur
    index = SuffixIndex(gate.max_len)
    index.sync(tokens)
    flip = [0]

    def step():
        flip[0] ^= 1
        tokens[-1] = 7 + flip[0]
        index.sync(tokens, context)
        _, length = index.lookup()
        gate.skips_pdm(length) or gate.takes_retrieval(length, 0.5)
    return step
