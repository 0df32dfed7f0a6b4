"""Knowing which stage failed and why: status boards in the rendezvous store, and the diagnosis.

Every stage process runs a `StatusBoard`: a daemon thread that writes its state ("computing
cycle 12", "waiting for the hidden state from stage 0 (rank 1)"), a heartbeat counter and its
pid/host into the job's store every `interval` seconds, and its error at once if it fails.
When a message wait on the control rank fails (a broken connection or the deadline), the control
rank calls `diagnose`, which reads every board until each beat again or its process ended (at
most 4 intervals) and blames, in this order: a stage whose
process is known dead (exit code), a stage whose heartbeat stopped (died or frozen), a stage
that failed by itself (not because a peer vanished), a stage stuck computing, and finally the
peer the control rank was waiting for. The result is raised as `StageFailure`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

STATUS_KEY = "spd/status/{rank}"


class StageFailure(RuntimeError):
    """The distributed run cannot go on; the message names the stage and the cause."""

    def __init__(self, message: str, stage: int | None = None):
        super().__init__(message)
        self.stage = stage


class StatusBoard:
    """This process's state, published to `store` by a daemon thread (heartbeat)."""

    def __init__(self, store, rank: int, interval: float = 0.5):
        self.store, self.rank, self.interval = store, rank, interval
        self.state, self.since = "starting", time.monotonic()
        self.error: str | None = None
        self.peer_error = False
        self.beat = 0
        self.info: dict = {}   # static facts worth reading from outside (parameters held, layers)
        self._stop = threading.Event()
        self._lock = threading.Lock()   # one store client, two threads
        self._thread = threading.Thread(target=self._run, name=f"spd-status-{rank}", daemon=True)

    def start(self) -> "StatusBoard":
        self.publish()
        self._thread.start()
        return self

    def set(self, state: str) -> None:
        if state != self.state:
            self.state, self.since = state, time.monotonic()

    def fail(self, error: str, peer: bool) -> None:
        """Record why this process stops; `peer` when a neighbour vanished (not our own fault)."""
        self.error, self.peer_error = error, peer
        self.publish()

    def publish(self) -> None:
        record = {"beat": self.beat, "state": self.state, "in_state_s": round(time.monotonic() - self.since, 2),
                  "error": self.error, "peer_error": self.peer_error, "pid": os.getpid(),
                  "host": socket.gethostname(), **self.info}
        with self._lock:
            try:
                self.store.set(STATUS_KEY.format(rank=self.rank), json.dumps(record))
            except RuntimeError:  # the store went away: the run is over anyway
                self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat += 1
            self.publish()

    def stop(self) -> None:
        self._stop.set()

    def read(self, rank: int) -> dict | None:
        """Another rank's board, through this board's store client (shared with its thread)."""
        with self._lock:
            return read_status(self.store, rank)


class Progress:
    """`progress()` is True when some stage's board shows it computing and its heartbeat rose
    since the last call: it is alive and working, so whoever waits on it keeps waiting."""

    def __init__(self, read, ranks: list[int]):
        self.read, self.ranks = read, ranks   # read(rank) -> the board's record or None
        self.beats: dict[int, int] = {}

    def __call__(self) -> bool:
        moving = False
        for rank in self.ranks:
            status = self.read(rank) or {}
            beat = status.get("beat", -1)
            if status.get("state", "").startswith("computing") and beat > self.beats.get(rank, beat):
                moving = True
            self.beats[rank] = beat
        return moving


def read_status(store, rank: int) -> dict | None:
    try:
        key = STATUS_KEY.format(rank=rank)
        if not store.check([key]):
            return None
        return json.loads(store.get(key))
    except RuntimeError:
        return None


def describe_exit(code: int | None) -> str | None:
    if code is None:
        return None
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def diagnose(store, layout, waited_rank: int | None, cause: str, exit_codes: dict | None = None,
             interval: float = 0.5, timeout: float = 30.0) -> StageFailure:
    """Find the stage to blame for a failed wait on the control rank (see the module docstring)."""
    ranks = [layout.stage_rank(k) for k in range(layout.n_stages) if layout.stage_rank(k) != 0]
    first = {r: read_status(store, r) for r in ranks}
    deadline = time.monotonic() + 4 * interval
    while True:  # until every board beat again or its process ended: a stale beat means frozen or dead
        time.sleep(interval / 2)
        second = {r: read_status(store, r) for r in ranks}
        codes = exit_codes() if exit_codes else {}
        settled = [codes.get(r) is not None or (first[r] and second[r] and second[r]["beat"] != first[r]["beat"])
                   for r in ranks]
        if all(settled) or time.monotonic() > deadline:
            break

    def who(rank):
        k = layout.stage_of(rank)
        status = second.get(rank) or first.get(rank) or {}
        where = f", pid {status['pid']} on {status['host']}" if status.get("pid") else ""
        return k, f"stage {k} (rank {rank}{where})"

    def last_state(rank):
        status = second.get(rank) or first.get(rank)
        return f"; its last state: {status['state']}" if status else ""

    def own_error(rank):
        status = second.get(rank) or {}
        return f": {status['error']}" if status.get("error") and not status.get("peer_error") else ""

    # 1. known dead (where this process started the stages), not because a peer vanished;
    #    killed by a signal first
    dead = [r for r in ranks if codes.get(r) not in (None, 0) and not (second.get(r) or {}).get("peer_error")]
    for rank in sorted(dead, key=lambda r: codes[r] >= 0):
        k, name = who(rank)
        return StageFailure(f"{name} {describe_exit(codes[rank])}{own_error(rank)}{last_state(rank)}", k)
    for rank in ranks:  # 2. heartbeat stopped
        a, b = first.get(rank), second.get(rank)
        if a is None or (b is not None and a["beat"] == b["beat"] and not b.get("error")):
            k, name = who(rank)
            what = "never reported a status" if a is None else "stopped responding (no heartbeat)"
            return StageFailure(f"{name} {what}: the process died or froze{last_state(rank)}", k)
    for rank in ranks:  # 3. failed on its own
        status = second.get(rank) or {}
        if status.get("error") and not status.get("peer_error"):
            k, name = who(rank)
            return StageFailure(f"{name} failed: {status['error']}", k)
    for rank in ranks:  # 4. stuck computing
        status = second.get(rank) or {}
        if status.get("state", "").startswith("computing") and status.get("in_state_s", 0) >= timeout:
            k, name = who(rank)
            return StageFailure(f"{name} hung: {status['state']} for {status['in_state_s']:.0f} s", k)
    if waited_rank is not None and layout.stage_of(waited_rank) is not None:
        k, name = who(waited_rank)
        return StageFailure(f"{name} did not answer: {cause}{last_state(waited_rank)}", k)
    return StageFailure(f"the distributed run failed: {cause}")


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it exits (no orphans)."""
    if not hasattr(os, "getppid") or not os.path.exists("/proc/self"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
