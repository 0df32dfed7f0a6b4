"""One worker thread decodes one request at a time; the others wait in a bounded queue.

SPD is a batch-1 method, so requests run strictly in turn. The worker iterates the backend's
token generator, turns tokens into text (stop strings included) and posts one `Output` per
token to the request's asyncio queue. A cancelled job (client gone, server stopping) is
noticed at the next token: the worker stops consuming, which closes the generator and stops
the decode. This module knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..stats import SPDStats
from .text import StopText

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    pass


@dataclass
class Output:
    """One step of a job: new text and token, or the end (finish_reason or error set)."""

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None   # "stop" (EOS or stop string) or "length"
    stats: SPDStats | None = None
    error: str | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def post(self, output: Output) -> None:
        """Hand an output to the request's event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, output)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


@dataclass
class Counters:
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0            # answered "queue full"
    generated_tokens: int = 0


@dataclass
class Totals:
    """Decode statistics summed over every request, for /metrics."""

    prompt_tokens: int = 0
    cycles: int = 0
    decode_seconds: float = 0.0
    verified_by_fill: list[int] = field(default_factory=list)
    accepted_by_fill: list[int] = field(default_factory=list)

    def add(self, stats: SPDStats) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.cycles += stats.cycles
        self.decode_seconds += stats.decode_seconds
        for name in ("verified_by_fill", "accepted_by_fill"):
            mine, theirs = getattr(self, name), getattr(stats, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, count in enumerate(theirs):
                mine[i] += count


class Scheduler:
    """The bounded queue and the worker thread in front of one backend."""

    def __init__(self, backend, queue_size: int):
        if queue_size < 1:
            raise ValueError(f"--queue-size must be at least 1; got {queue_size}")
        self.backend = backend
        self.queue_size = queue_size
        self.counters = Counters()
        self.totals = Totals()
        self.running: Job | None = None
        self._waiting: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._work, name="spd-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running and the waiting jobs, then end the worker thread."""
        while True:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.post(Output(error="the server is shutting down"))
        if self.running is not None:
            self.running.cancel()
        try:
            self._waiting.put(None, timeout=timeout)
        except queue.Full:  # late submissions filled the queue; the thread is a daemon
            return
        self._thread.join(timeout)

    def submit(self, job: Job) -> Job:
        try:
            self._waiting.put_nowait(job)
        except queue.Full:
            self.counters.rejected += 1
            raise QueueFull(f"the server is busy: 1 request is decoding and {self.queue_size} are "
                            f"waiting, the most this server queues (--queue-size "
                            f"{self.queue_size}). Retry later.") from None
        return job

    @property
    def waiting(self) -> int:
        return self._waiting.qsize()

    def snapshot(self) -> dict:
        return {"running": int(self.running is not None), "waiting": self._waiting.qsize(),
                "queue_size": self.queue_size, **vars(self.counters)}

    def _next_job(self) -> Job | None:
        """The next job; first heal a backend that failed; while no job comes, keep the backend
        alive every keepalive_seconds (a failed keep-alive is healed the same way)."""
        while True:
            while self.backend.state == "recovering":   # each try counts: the backend bounds them
                self.backend.heal()
            wait = self.backend.keepalive_seconds if self.backend.state == "ok" else None
            try:
                return self._waiting.get(timeout=wait)
            except queue.Empty:
                try:
                    self.backend.idle()
                except Exception:  # noqa: BLE001 -- the backend failed: /health says so, heal() follows
                    log.exception("keeping the backend alive failed")

    def _work(self) -> None:
        try:
            self._serve()
        finally:
            self.backend.close()   # from this thread, the only one that ever drove the backend

    def _serve(self) -> None:
        while (job := self._next_job()) is not None:
            if job.cancelled.is_set():
                self.counters.cancelled += 1
                continue
            self.running = job
            try:
                self._decode(job)
            except Exception as err:  # noqa: BLE001 -- a failed decode answers its request; the server goes on
                log.exception("decode failed")
                self.counters.failed += 1
                job.post(Output(error=f"decoding failed: {type(err).__name__}: {err}"))
            finally:
                self.running = None

    def _decode(self, job: Job) -> None:
        stats = SPDStats(self.backend.n_stages)
        text = StopText(self.backend.tokenizer, job.stop)
        tokens = self.backend.stream(job.prompt_ids, job.params, job.max_new_tokens,
                                     job.eos_token_ids, stats)
        token, finish = None, "length"
        try:
            for token in tokens:
                self.counters.generated_tokens += 1
                if job.cancelled.is_set():
                    self.counters.cancelled += 1
                    job.post(Output(error="the request was cancelled"))  # for anyone still waiting
                    return
                job.post(Output(text.add(token), token))
                if text.stopped:
                    break
        finally:
            tokens.close()  # stops the decode when we leave early
            self.totals.add(stats)
        if text.stopped or token in job.eos_token_ids:
            finish = "stop"
        self.counters.finished += 1
        job.post(Output(text.finish(), finish_reason=finish, stats=stats))
