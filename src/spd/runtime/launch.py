"""Starting a distributed run: check the plan, start or join the processes, and a Session on rank 0.

- `plan(...)` turns user arguments into a `RunSpec` after checking them against the model's
  config.json and the PDM checkpoint's JSON (never any weights): a bad n or split fails here.
- `start(spec)` spawns the stage processes on this machine (this process becomes rank 0), or,
  under torchrun (RANK/WORLD_SIZE set), joins as the rank torchrun gave: rank 0 gets a Session,
  the other ranks serve their stage until STOP and get None.
- `Session.stream/generate` decode on rank 0; a failed message wait becomes a `StageFailure`
  naming the stage and the cause (see faults.py); `close` stops every process it started and
  kills what does not stop (children also die with the parent: no orphans).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..checkpoint import read_config
from ..engine import GenerationResult
from ..families import RECURRENT_KINDS, layer_kinds
from ..lookahead import LOOKAHEAD
from ..pdm import default_anchors, fits_split
from ..retrieval import Gate, drafter_kind, make_drafter
from ..sampling import SamplingParams
from ..shipped import shipped_pdm
from ..stats import CycleTimes
from ..tree import TreeConfig
from .controller import Controller, DistributedStats, breakdown
from .faults import Progress, StageFailure, StatusBoard, describe_exit, diagnose, read_status
from .layout import CONTROL_RANK, Layout, LayoutError, default_threads
from .protocol import Link, PeerError
from .spec import READY, RunSpec, connect_store, init_rank, pick_rank_device, rank_names
from .weights import read_model_config
from .worker import run_stage, worker_main

log = logging.getLogger(__name__)


def plan(model: str, stages: int | None = None, split: list[int] | None = None, draft_rank: str = "separate",
         pdm: str | None = None, **options) -> RunSpec:
    """Check the arguments against config.json and the PDM's JSON; raise LayoutError if they clash."""
    if options.get("lookahead", "off") not in LOOKAHEAD:
        raise LayoutError(f"--lookahead must be one of {', '.join(LOOKAHEAD)}; got {options['lookahead']!r}")
    folder, config = read_model_config(model)
    check_tree_width(config, options.get("tree_width", 1), options.get("lookahead", "off"))
    num_layers = config.num_hidden_layers
    pdm = pdm if pdm is not None else shipped_pdm(model, stages, split)
    pdm_config = read_config(pdm) if pdm is not None else None
    if pdm_config is not None and stages is None and split is None:
        split = list(pdm_config.stage_layers)
    if split is not None and stages is not None and len(split) != stages:
        raise LayoutError(f"--split has {len(split)} counts ({split}) but --stages is {stages}")
    n = len(split) if split is not None else (stages if stages is not None else 2)
    layout = Layout.of(num_layers, n, split, draft_rank)
    counts = tuple(len(s) for s in layout.stages)
    if pdm_config is not None:
        if pdm_config.target.num_layers != num_layers:
            raise LayoutError(f"PDM checkpoint {pdm} was made for a target with {pdm_config.target.num_layers} "
                              f"layers, but {model} has {num_layers}")
        if not fits_split(list(pdm_config.stage_layers), pdm_config.anchors, list(counts)):
            raise LayoutError(f"PDM checkpoint {pdm} was trained for n={pdm_config.n_stages} stages split "
                              f"{list(pdm_config.stage_layers)}, but {n} stages split {list(counts)} were asked "
                              f"for; use --stages {pdm_config.n_stages} or train a PDM for this split")
    kind = drafter_kind(options.pop("drafter", None), pdm is not None)
    if pdm_config is not None:
        anchors = tuple(pdm_config.anchors)
    else:   # retrieval reads no features: the stages report none
        anchors = () if kind == "retrieval" else tuple(default_anchors(list(counts)))
    return RunSpec(model=str(folder), stage_layers=counts, draft_rank=draft_rank, anchors=anchors, pdm=pdm,
                   drafter=kind, **options)


def check_tree_width(config, width: int, lookahead: str) -> None:
    """Refuse a tree width the run cannot do, before any process starts (the engine's own check
    runs again on rank 0 with the drafter)."""
    if width < 1:
        raise LayoutError(f"--tree-width must be at least 1; got {width}")
    if width == 1:
        return
    recurrent = sorted(set(layer_kinds(config)) & RECURRENT_KINDS)
    if recurrent:
        raise LayoutError(f"--tree-width {width} needs attention-only layers: {config.model_type} has "
                          f"{', '.join(recurrent)} layers, whose state cannot hold several branches; "
                          f"use --tree-width 1")
    if lookahead != "off":
        raise LayoutError(f"--lookahead {lookahead} needs --tree-width 1 (it assumes the one draft is accepted); "
                          f"use --lookahead off with --tree-width {width}")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


class Session:
    """Rank 0's handle on a running job: decode sequences, then `close` (or use `with`)."""

    def __init__(self, spec: RunSpec, controller: Controller, store, workers: dict | None, pdm, gate: Gate):
        self.spec, self.controller, self.store, self.workers, self.pdm = spec, controller, store, workers, pdm
        self.gate = gate   # the hybrid's gate: the PDM checkpoint's, else the default
        self.layout = spec.layout
        self.closed = False

    @property
    def target(self):
        return self.controller.target

    def drafter(self, kind: str | None = None):
        """A fresh drafter for one sequence: `kind` (hybrid, pdm, retrieval) or the run's own."""
        return make_drafter(kind or self.spec.drafter, self.pdm, self.gate)

    def default_drafter(self):
        return self.drafter()

    def _exit_codes(self) -> dict[int, int | None]:
        return {rank: proc.exitcode for rank, proc in (self.workers or {}).items()}

    def _failure(self, err: PeerError) -> StageFailure:
        failure = diagnose(self.store, self.layout, err.rank, str(err),
                           self._exit_codes if self.workers is not None else None, timeout=self.spec.timeout)
        log.error("distributed run failed: %s", failure)
        self.close(failed=True)
        return failure

    def stream(self, prompt_ids: list[int], drafter=None, params: SamplingParams = SamplingParams(),
               max_new_tokens: int = 128, eos_token_ids=None, stats: DistributedStats | None = None
               ) -> Iterator[int]:
        """Yield the new tokens of one sequence; fills `stats` (breakdown included) at the end."""
        if self.closed:
            raise StageFailure("this distributed session is closed")
        drafter = drafter if drafter is not None else self.default_drafter()
        eos = self.target.eos_token_ids if eos_token_ids is None else eos_token_ids
        stats = stats if stats is not None else DistributedStats(self.layout.n_stages)
        cycles: list[CycleTimes] = []
        log.info("decoding a %d-token prompt, up to %d new tokens, on %d stages", len(prompt_ids),
                 max_new_tokens, self.layout.n_stages)
        try:
            yield from self.controller.stream(drafter, prompt_ids, params, max_new_tokens, eos, stats, cycles)
            times = self.controller.gather_timings(stats.cycles)
        except PeerError as err:
            raise self._failure(err) from err
        stats.stage_seconds = [sum(t[1:]) for t in times]
        stats.breakdown = breakdown(cycles, [t[1:] for t in times])
        stats.breakdown["prefill_stage_ms"] = [1000.0 * t[0] for t in times]

    def generate(self, prompt_ids: list[int], drafter=None, params: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 128, eos_token_ids=None,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        stats = DistributedStats(self.layout.n_stages)
        tokens = []
        for token in self.stream(prompt_ids, drafter, params, max_new_tokens, eos_token_ids, stats):
            tokens.append(token)
            if on_token is not None:
                on_token(token)
        return GenerationResult(tokens, stats)

    def ping(self) -> None:
        """Between sequences: reset the stages' idle deadline (a long-running server calls this
        well within `spec.idle_timeout`); raises StageFailure when a stage is gone."""
        if self.closed:
            raise StageFailure("this distributed session is closed")
        try:
            self.controller.ping()
        except PeerError as err:
            raise self._failure(err) from err

    def close(self, failed: bool = False) -> None:
        """Stop the stages (STOP, or kill them after a failure) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if not failed:
            try:
                self.controller.stop()
            except PeerError as err:
                log.warning("stopping the stages: %s", err)
                failed = True
        if self.controller.board is not None:
            self.controller.board.stop()
        for proc in (self.workers or {}).values():
            _reap(proc, grace=0.5 if failed else 10.0)
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as err:  # peers gone: nothing left to tear down
            log.debug("destroy_process_group: %s", err)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)


def _reap(proc, grace: float) -> None:
    """Wait for a stage process to end; terminate, then kill it when it does not."""
    proc.join(timeout=grace)
    if proc.exitcode is None:
        proc.terminate()
        proc.join(timeout=2.0)
    if proc.exitcode is None:
        proc.kill()
        proc.join()


# Stage processes fork from one server process that imported these once (fast starts, no
# re-import per process and per run); they die with it, and it dies with this process.
PRELOAD = ["spd.runtime.worker", "spd.runtime.weights", "transformers.models.auto.modeling_auto",
           "transformers.models.llama.modeling_llama"]


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(spec: RunSpec) -> Session | None:
    """Spawn the stage processes here, or join torchrun's job (None on ranks other than 0)."""
    if under_torchrun():
        return _join_torchrun(spec)
    return _spawn_local(spec)


def _spawn_local(spec: RunSpec) -> Session:
    layout = spec.layout
    world = layout.world_size
    store = connect_store("127.0.0.1", 0, world, master=True)   # port 0: the OS picks a free one
    workers = {}
    try:
        ctx = _context()
        for rank in range(1, world):
            workers[rank] = ctx.Process(target=worker_main, name=f"spd-{layout.role(rank).replace(' ', '')}",
                                        args=(spec.to_json(), rank, world, f"127.0.0.1:{store.port}"), daemon=True)
            workers[rank].start()
        log.info("started %s", ", ".join(f"{layout.role(r)} as rank {r} (pid {p.pid})" for r, p in workers.items()))
        return _control(spec, store, world, local_rank=0, local_world=world, workers=workers)
    except BaseException:
        for proc in workers.values():
            _reap(proc, grace=0.0)
        raise


def _join_torchrun(spec: RunSpec) -> Session | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec.layout.check_world_size(world)   # before any weights load
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          master=rank == CONTROL_RANK and not agent_store)
    store = dist.PrefixStore(f"spd/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
                             f"/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if rank != CONTROL_RANK:

        run_stage(spec, rank, world, store, local_rank, local_world)
        return None
    return _control(spec, store, world, local_rank, local_world, workers=None)


def _control(spec: RunSpec, store, world: int, local_rank: int, local_world: int, workers) -> Session:
    """Rank 0: load embedding, norm, lm_head (+ stage 0), the PDM; build the controller."""
    from ..loading import parse_dtype
    from .stage import StageWorker
    from .weights import load_partial_target

    layout = spec.layout
    torch.set_num_threads(spec.threads or default_threads(local_world))
    device = pick_rank_device(spec, CONTROL_RANK, world, local_rank)
    own = layout.stages[0] if layout.colocated else range(0)
    target = load_partial_target(spec.model, own, embed=True, head=True, dtype=parse_dtype(spec.dtype), device=device)
    pdm = _load_pdm(spec, target)
    _wait_ready(store, layout, workers, spec.idle_timeout)
    init_rank(spec, CONTROL_RANK, world, store, local_rank, local_world)
    remote = [layout.stage_rank(k) for k in range(layout.n_stages) if layout.stage_rank(k) != CONTROL_RANK]
    # with stage 0 here, a board shows stage 1 that this process computes the prefill
    board = StatusBoard(store, CONTROL_RANK).start() if layout.colocated else None
    read = board.read if board is not None else (lambda rank: read_status(store, rank))
    link = Link(device, spec.timeout, rank_names(layout), spec.idle_timeout, progress=Progress(read, remote),
                command_size=spec.command_size)
    local = (StageWorker(target, layout, 0, link, spec.anchors, prefill_chunk=spec.prefill_chunk, width=spec.tree_width)
             if layout.colocated else None)
    controller = Controller(target, layout, link, spec.anchors, local, lookahead=spec.lookahead, board=board,
                            tree=TreeConfig(spec.tree_width))
    gate = Gate.load(spec.pdm) if spec.pdm is not None else Gate()
    return Session(spec, controller, store, workers, pdm, gate)


def _wait_ready(store, layout: Layout, workers, timeout: float) -> None:
    """Wait until every stage process loaded its weights; fail fast if one dies or errs."""
    deadline = time.monotonic() + timeout
    pending = [r for r in range(layout.world_size) if layout.stage_of(r) is not None and r != CONTROL_RANK]
    while pending:
        for rank in list(pending):
            status = read_status(store, rank) or {}
            code = workers[rank].exitcode if workers else None
            if status.get("error") or code is not None:
                why = status.get("error") or describe_exit(code)
                raise StageFailure(f"{layout.role(rank)} (rank {rank}) failed while starting: {why}",
                                   layout.stage_of(rank))
            if status.get("state") == READY:
                pending.remove(rank)
        if pending and time.monotonic() > deadline:
            raise StageFailure(f"{', '.join(layout.role(r) for r in pending)} did not load within {timeout:.0f} s",
                               layout.stage_of(pending[0]))
        time.sleep(0.05)


def _load_pdm(spec: RunSpec, target):
    from ..checkpoint import load_pdm
    from ..pdm import PDM

    if spec.pdm is not None:
        return load_pdm(spec.pdm, target)   # plan() checked that it fits the split
    if spec.drafter == "retrieval":
        return None
    log.warning("no --pdm given: drafting with a randomly initialised PDM. Output is still exact, "
                "but almost every draft is rejected; train one with `spd train`.")
    return PDM.create(target, list(spec.stage_layers), list(spec.anchors), num_layers=spec.pdm_layers).eval()
