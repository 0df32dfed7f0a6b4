"""A cost model of distributed SPD: predicted tokens/s for any n, layout and split (`spd plan`).

Inputs are per-part costs in milliseconds (`Costs`: one decoder layer, the head = final norm +
lm_head + argmax, one draft call, one message; measured on this device by `measure_costs`, or
given for other hardware) and an acceptance profile: per-draft acceptance by pipeline fill
(`SPDStats.accepted_by_fill / verified_by_fill`; fills past the profile use its last value).

The model, per cycle with f tokens in flight (stages 0..f-1 run; the head only when f == n):
- each rank's work: its layers x layer_ms, plus the draft on rank 0, plus the head where it
  lives; on a CPU every part is slowed by `contention` (the processes share memory bandwidth)
  and the cycle is at least the total work over the cores;
- a stage on another rank starts after the command arrives and answers with a message:
  its path is work + 2 messages; rank 0's own path is its work;
- head on rank 0: after the reports, serially (or, looking ahead, in parallel with the next
  step, at the price of one wasted cycle per rejection: the better of the two is taken, as
  `--lookahead auto` does).
Tokens: every verification emits one token; after a rejection (and at the start) n-1 refill
cycles emit none. With the chance V of a run of verifications before a rejection (fills 1, 2,
.., n, n, ...), decode time per token = T_n + (refill time + waste) / E[V].
This module is pure arithmetic except `measure_costs`, which times the parts on the device.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import typer  # the `spd plan` options (the command lives at the end of this module)

LAYOUTS = (("with-first-stage", "last"), ("with-first-stage", "control"), ("separate", "last"),
           ("separate", "control"))


@dataclass(frozen=True)
class Costs:
    """Milliseconds per part, one token, one process alone on its device (see module doc)."""

    num_layers: int
    layer_ms: float                  # one decoder layer
    head_ms: float                   # final norm + lm_head + argmax over the vocabulary
    message_ms: float                # one small point-to-point message, one way
    draft_ms: dict = field(default_factory=dict)   # drafter name -> one draft call (oracle: 0)
    cores: int | None = None         # a CPU whose cores all ranks share; None: one device per rank
    contention: float = 1.0          # CPU: slowdown of compute when every core is busy
    ar_all_cores_ms: float | None = None   # AR per token on every core of the device (CPU)
    device: str = "cpu"

    @property
    def ar_ms(self) -> float:
        """AR per token on one device (one thread on a CPU): every layer and the head."""
        return self.num_layers * self.layer_ms + self.head_ms

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Costs":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Prediction:
    n: int
    draft_rank: str
    head: str
    split: tuple[int, ...]
    drafter: str
    cycle_ms: float                  # steady state (pipeline full)
    tokens_per_cycle: float
    tokens_per_second: float
    vs_ar_one_device: float          # against AR on one device (the paper's n+1 devices vs one)
    vs_ar_all_cores: float | None    # against AR on every core of the same device (CPU)
    lookahead: bool


def expected_run(acceptance: list[float], n: int) -> float:
    """E[verifications up to and including the first rejection] after a (re)start, when the
    j-th verification checks a draft made at fill min(j, n) with acceptance a_fill."""
    a = [acceptance[min(f, len(acceptance)) - 1] for f in range(1, n + 1)]
    total, survive = 0.0, 1.0
    for f in range(n):          # verifications 1..n
        total += survive
        survive *= a[f]
    if a[-1] >= 1.0:
        return math.inf
    return total + survive / (1.0 - a[-1])   # then geometric at the steady-state acceptance


def _slow(costs: Costs, n: int, draft_rank: str) -> tuple[float, int]:
    processes = n + (draft_rank != "with-first-stage")
    return (costs.contention if costs.cores is not None and processes > 1 else 1.0), processes


def _head_on_last(n: int, draft_rank: str, head: str) -> bool:
    return head == "last" and (n > 1 or draft_rank != "with-first-stage")


def stage_work(costs: Costs, n: int, draft_rank: str, head: str, draft_ms: float, k: int, count: int,
               finishing: bool = True) -> float:
    """The path of stage k's rank in a cycle: its layers (+ the draft when it is rank 0, + the head
    when it holds it and a token finishes, + the command in and the answer out when remote)."""
    slow, _ = _slow(costs, n, draft_rank)
    colocated = draft_rank == "with-first-stage"
    work = count * costs.layer_ms * slow
    if k == 0 and colocated:
        work += draft_ms * slow
    if k == n - 1 and finishing and _head_on_last(n, draft_rank, head):
        work += costs.head_ms * slow
    if not (k == 0 and colocated):
        work += 2 * costs.message_ms
    return work


def _ranks(costs: Costs, split, draft_rank: str, head: str, draft_ms: float, fill: int):
    """(rank 0's own work, [remote paths], head on rank 0, total work, processes) of a cycle with
    `fill` tokens in flight."""
    n, colocated = len(split), draft_rank == "with-first-stage"
    slow, processes = _slow(costs, n, draft_rank)
    paths = [stage_work(costs, n, draft_rank, head, draft_ms, k, split[k], fill == n) for k in range(min(fill, n))]
    own = paths[0] if colocated else draft_ms * slow
    remote = paths[1:] if colocated else paths
    head_here = costs.head_ms * slow if not _head_on_last(n, draft_rank, head) and fill == n else 0.0
    total = own + sum(p - 2 * costs.message_ms for p in remote) + head_here
    return own, remote, head_here, total, processes


def cycle_ms(costs: Costs, split, draft_rank: str, head: str, draft_ms: float, fill: int,
             lookahead: bool = False) -> float:
    """Predicted time of one cycle with `fill` tokens in flight (see module doc)."""
    own, remote, head_here, total, processes = _ranks(costs, split, draft_rank, head, draft_ms, fill)
    parallel = max([own] + remote)
    t = max(parallel, own + head_here) if lookahead else parallel + head_here
    if costs.cores is not None and processes > costs.cores:   # time-sliced: the work shares the cores
        t = max(t, total / costs.cores)
    return t


def predict(costs: Costs, split, draft_rank: str, head: str, acceptance: list[float], drafter: str = "pdm",
            draft_ms: float | None = None, new_tokens: int | None = None, lookahead: bool | None = None) -> Prediction:
    """Tokens/s of one layout; `new_tokens` (per sequence) adds the first refill, as measured runs see it."""
    n = len(split)
    draft = costs.draft_ms.get(drafter, 0.0) if draft_ms is None else draft_ms
    if lookahead is None:   # as --lookahead auto: only where it pays
        options = [predict(costs, split, draft_rank, head, acceptance, drafter, draft, new_tokens, ahead)
                   for ahead in (False, True)]
        return max(options, key=lambda p: p.tokens_per_second)
    times = [cycle_ms(costs, split, draft_rank, head, draft, f, lookahead) for f in range(1, n + 1)]
    refill = sum(times[:-1])
    run = expected_run(acceptance or [1.0], n)
    waste = times[-1] if lookahead and head == "control" else 0.0
    per_token = times[-1] + ((refill + waste) / run if run != math.inf else 0.0)
    if new_tokens is not None and new_tokens > 1:   # the first refill of the sequence, spread over its tokens
        per_token += refill / (new_tokens - 1)   # (nothing is looked ahead of the last token: no waste at the end)
    ar_cores = costs.ar_all_cores_ms
    return Prediction(n, draft_rank, head, tuple(split), drafter, times[-1], times[-1] / per_token,
                      1000.0 / per_token, costs.ar_ms / per_token, ar_cores / per_token if ar_cores else None,
                      bool(lookahead and head == "control"))


def balanced_split(costs: Costs, n: int, draft_rank: str, head: str, draft_ms: float = 0.0,
                   allowed=None) -> tuple[int, ...]:
    """The split of the layers into n stages with the shortest steady-state cycle: a min-max
    dynamic program over stage boundaries; `allowed(d, boundary)` may forbid the boundary after
    d stages (e.g. where a trained PDM would see other anchors)."""
    L = costs.num_layers
    floor = draft_ms * _slow(costs, n, draft_rank)[0] if draft_rank == "separate" else 0.0  # rank 0's own
    best = {0: (floor, ())}          # boundary after d stages -> (slowest path so far, counts)
    for d in range(1, n + 1):
        nxt = {}
        for b in ([L] if d == n else range(d, L - (n - d) + 1)):
            if allowed is not None and d < n and not allowed(d, b):
                continue
            for a, (worst, counts) in best.items():
                if a < b:
                    trial = max(worst, stage_work(costs, n, draft_rank, head, draft_ms, d - 1, b - a))
                    if b not in nxt or trial < nxt[b][0] - 1e-12:
                        nxt[b] = (trial, counts + (b - a,))
        best = nxt
    if L not in best:
        raise ValueError(f"no split of {L} layers into {n} stages fits the constraints")
    return best[L][1]


def plan_table(costs: Costs, acceptance: list[float], drafter: str, max_n: int = 4,
               new_tokens: int | None = None, fixed_split=None) -> list[Prediction]:
    """Predictions for n = 1..max_n and every layout (balanced split each, or `fixed_split`)."""
    rows = []
    draft = costs.draft_ms.get(drafter, 0.0)
    for n in range(1, max_n + 1):
        for draft_rank, head in LAYOUTS:
            if n == 1 and draft_rank == "with-first-stage" and head == "last":
                continue   # the same process: identical to head on control
            split = fixed_split if fixed_split is not None and len(fixed_split) == n else \
                balanced_split(costs, n, draft_rank, head, draft)
            rows.append(predict(costs, split, draft_rank, head, acceptance, drafter, new_tokens=new_tokens))
    return rows


def format_table(rows: list[Prediction], costs: Costs) -> str:
    best = max(rows, key=lambda r: r.tokens_per_second)
    lines = [f"costs ({costs.device}): layer {costs.layer_ms:.2f} ms x {costs.num_layers}, head {costs.head_ms:.2f} ms, "
             f"message {costs.message_ms:.2f} ms, draft " + ", ".join(f"{k} {v:.2f}" for k, v in costs.draft_ms.items())
             + f" ms; contention x{costs.contention:.2f}" + (f" on {costs.cores} cores" if costs.cores else "")
             + f"; AR {1000 / costs.ar_ms:.1f} tok/s on one device"
             + (f", {1000 / costs.ar_all_cores_ms:.1f} on all cores" if costs.ar_all_cores_ms else ""),
             f"{'n':>2} {'draft rank':<17} {'head':<8} {'split':<14} {'cycle ms':>8} {'tok/cyc':>7} {'tok/s':>7} "
             f"{'x AR 1 dev':>10} {'x AR cores':>10}"]
    for r in rows:
        cores = f"{r.vs_ar_all_cores:10.2f}" if r.vs_ar_all_cores is not None else f"{'-':>10}"
        mark = "  <- recommended" if r is best else ""
        lines.append(f"{r.n:>2} {r.draft_rank:<17} {r.head:<8} {','.join(map(str, r.split)):<14} {r.cycle_ms:8.1f} "
                     f"{r.tokens_per_cycle:7.3f} {r.tokens_per_second:7.1f} {r.vs_ar_one_device:10.2f} {cores}"
                     + (" (lookahead)" if r.lookahead else "") + mark)
    return "\n".join(lines)


def acceptance_profile(stats: dict) -> list[float]:
    """Per-draft acceptance by fill from SPDStats.to_dict() (fills never seen: the overall rate)."""
    verified, accepted = stats.get("verified_by_fill", []), stats.get("accepted_by_fill", [])
    overall = sum(accepted) / sum(verified) if sum(verified) else 0.0
    return [a / v if v else overall for v, a in zip(verified, accepted)] or [overall]


# -- measuring the parts on this device ---------------------------------------------------------
def _stage_neighbour(config, layers: int, ready, go, stop) -> None:
    """Another rank's stage: `layers` decoder layers of the target's architecture and its head
    (zero weights, so no checkpoint is read; the memory traffic and the code path are those of
    the last stage, which holds the head by default), run one token at a time, on one thread,
    while `go` is set."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        body = AutoModelForCausalLM.from_config(config)
    body = body.to_empty(device="cpu").eval()
    for tensor in [*body.parameters(), *body.buffers()]:
        tensor.data.zero_()
    hidden = torch.zeros(1, 1, config.hidden_size, dtype=next(body.parameters()).dtype)
    ready.set()
    with torch.inference_mode():
        while not stop.is_set():
            if go.wait(0.05):
                body(inputs_embeds=hidden, use_cache=False)


def measure_contention(layers, config, num_layers: int, cores: int, reps: int = 21) -> float:
    """The slowdown of `layers` (a call running every decoder layer on this thread) while the
    other cores each run a stage's share of the layers: the median ratio of paired calls, one with
    the neighbours paused and one with them running, so a drift of the host cancels."""
    import logging
    import multiprocessing
    import statistics
    import time

    ctx = multiprocessing.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    ready = [ctx.Event() for _ in range(cores - 1)]
    helpers = [ctx.Process(target=_stage_neighbour, args=(config, max(1, num_layers // cores), r, go, stop),
                           daemon=True) for r in ready]
    for proc in helpers:
        proc.start()
    try:
        deadline = time.monotonic() + 120
        while not all(r.is_set() for r in ready):   # they import transformers and build the stage
            if time.monotonic() > deadline or any(proc.exitcode is not None for proc in helpers):
                logging.getLogger(__name__).warning("contention not measured: a neighbour stage did not "
                                                    "start; assuming x1.00")
                return 1.0
            time.sleep(0.1)
        ratios = []
        for _ in range(reps + 2):
            go.clear()
            time.sleep(0.06)   # a neighbour finishes its pass
            t = time.perf_counter()
            layers()
            alone = time.perf_counter() - t
            go.set()
            time.sleep(0.02)
            t = time.perf_counter()
            layers()
            ratios.append((time.perf_counter() - t) / alone)
        return statistics.median(ratios[2:])   # the first pairs warm the neighbours up
    finally:
        stop.set()
        go.set()
        for proc in helpers:
            proc.join(timeout=10)
            if proc.exitcode is None:
                proc.kill()


def _echo(port: int, hidden_size: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    buffer = torch.empty(2, hidden_size)
    while True:
        dist.recv(buffer, 0)
        if float(buffer[0, 0]) < 0:
            break
        dist.send(buffer, 0)
    dist.destroy_process_group()


def measure_message_ms(hidden_size: int = 576, reps: int = 200) -> float:
    """One way of a small gloo message between two local processes (half a round trip)."""
    import datetime
    import multiprocessing
    import time

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    child = multiprocessing.get_context("spawn").Process(target=_echo, args=(store.port, hidden_size), daemon=True)
    child.start()
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2)
        buffer = torch.ones(2, hidden_size)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
            times.append(time.perf_counter() - t)
        dist.send(-torch.ones(2, hidden_size), 1)
        dist.destroy_process_group()
    finally:
        child.join(timeout=10)
        if child.exitcode is None:
            child.kill()
    times.sort()
    return 1000.0 * times[len(times) // 2] / 2


def measure_costs(target, drafters: dict, context: int = 64, reps: int = 21, busy: bool = True) -> Costs:
    """Time the parts on this device: one layer (1 thread, alone and beside a stage on every other core),
    the head, each drafter's call (`drafters`: name -> a callable making one draft), one message,
    and AR per token on every core. `target` must be the whole model."""
    import os

    import torch

    from .costs import interleaved_medians, target_step

    cores = os.cpu_count() or 1
    cpu = target.device.type == "cpu"
    hidden = torch.randn(1, 1, target.hidden_size, dtype=target.dtype, device=target.device)
    cache = target.new_cache(keep=2)
    target.prefill(torch.zeros(context, dtype=torch.long, device=target.device), cache)
    position = torch.tensor([context], device=target.device)

    @torch.inference_mode()
    def layers():
        target.run_layers(hidden, position, range(target.num_layers), cache)
        cache.crop(context)

    @torch.inference_mode()
    def head():
        int(target.logits(hidden[0, -1]).argmax())

    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    ar_all = interleaved_medians([target_step(target, context)], reps)[0] if cpu else None
    torch.set_num_threads(1 if cpu else threads)
    names = list(drafters)
    times = interleaved_medians([layers, head, *[drafters[name] for name in names]], reps)
    contention = 1.0
    if cpu and busy and cores > 1:   # the same layers while every other core runs a stage
        contention = measure_contention(layers, target.config, target.num_layers, cores, reps)
    torch.set_num_threads(threads)
    return Costs(num_layers=target.num_layers, layer_ms=1000.0 * times[0] / target.num_layers,
                 head_ms=1000.0 * times[1], message_ms=measure_message_ms(target.hidden_size) if cpu else 0.05,
                 draft_ms={name: 1000.0 * t for name, t in zip(names, times[2:])},
                 cores=cores if cpu else None, contention=max(1.0, contention),
                 ar_all_cores_ms=1000.0 * ar_all if ar_all else None, device=str(target.device))


def plan_command(
    model: str = typer.Option("default", help="Target to measure on this device (ignored with --costs)."),
    costs_file: Optional[str] = typer.Option(None, "--costs", help="Costs JSON (from --save-costs, or written by hand "
                                             "for other hardware: num_layers, layer_ms, head_ms, message_ms, draft_ms, "
                                             "cores (null: one device per rank), contention, ar_all_cores_ms)."),
    save_costs: Optional[str] = typer.Option(None, help="Write the measured costs here."),
    acceptance: str = typer.Option("0.6", help="Per-draft acceptance, one value or one per fill (1..n), e.g. 0.3,0.6; "
                                   "or a JSON file with verified_by_fill / accepted_by_fill (generate --json stats, "
                                   "or a bench wallclock drafter entry)."),
    drafter: str = typer.Option("pdm", help="Whose draft cost applies: pdm, hybrid, oracle (0)."),
    max_n: int = typer.Option(4, min=1, help="Predict n = 1..max_n."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens per sequence (adds the first refill); default: long."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Predict distributed SPD's tokens/s and speedup for every n and layout from per-part costs; recommend one."""
    from pathlib import Path

    if costs_file is not None:
        costs = Costs.from_json(Path(costs_file).read_text())
    else:
        from ..checkpoint import load_pdm, read_config
        from ..retrieval import Gate, make_drafter
        from ..shipped import shipped_pdm
        from ..target import load_target
        from .costs import pipeline_draft_step

        target, _ = load_target(model)
        pdm = shipped_pdm(model, 2, None)
        calls = {}
        if pdm is not None:
            n = len(read_config(pdm).stage_layers)
            for name in ("pdm", "hybrid"):
                calls[name] = pipeline_draft_step(target, make_drafter(name, load_pdm(pdm, target), Gate.load(pdm)), n, 64)
        costs = measure_costs(target, calls)
    if save_costs:
        Path(save_costs).write_text(costs.to_json())
    if Path(acceptance).is_file():
        data = json.loads(Path(acceptance).read_text())
        profile = acceptance_profile(data.get("stats", data))
    else:
        profile = [float(a) for a in acceptance.split(",")]
    rows = plan_table(costs, profile, drafter, max_n, max_new_tokens)
    if as_json:
        print(json.dumps({"costs": asdict(costs), "acceptance_by_fill": profile,
                          "predictions": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_table(rows, costs))
