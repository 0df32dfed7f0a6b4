"""The runtime's messages: one command per cycle broadcast by rank 0, and point-to-point tensors.

Every cycle rank 0 broadcasts a `Command` (int64 x 5): the op, the newest and oldest in-flight
positions, the position to crop every KV cache to first (the last cycle's rejection, or 0
for a new sequence), and whether the sequence samples (then a last stage that holds the head
returns the target's logits, else only their argmax). From it each stage works out alone whether it runs this cycle and on which
position (stage k runs position newest - k when that is in flight), and whether its upstream
neighbour sent it a hidden state last cycle. With a tree width W > 1 (spd.tree) the command
carries the cycle's `tree.TreeShape` after those 5 ints (1 + n (1 + 2W) more, every command of
the run that size): the child the last verification kept, so each stage prunes its own cache
tail, and per stage the nodes it runs (uid, parent uid), from which it builds their tree mask
and picks its upstream rows; `first` is then the root's position. Tensors that flow:

- control -> stage 0: the new token's embedding (1, 1, H) (the prompt's (1, P, H) at prefill;
  a tree level's (1, w, H));
- stage k -> stage k+1: its output, which stage k+1 runs in the NEXT cycle (at prefill: at once);
- stage k -> control: its *report* (r_k, q, H): the hidden states at the anchors it passes and,
  for the last stage, its output (index L, pre-norm) -- the finished token the control verifies;
  with the head on the last stage (layout.head_on_last) it instead sends the finished token's
  *verdict input*: its argmax (int64, 1) when greedy, its logits (float32, V) when sampling;
- at a STATS command: each stage's compute seconds per cycle (float64) since the last STATS.

`Link` wraps torch.distributed point-to-point calls with a deadline on every wait; a wait that
fails raises `PeerError` naming the peer and what was expected. The deadline bounds waiting on a
peer, not a peer's known compute: the prefill's waits go on while a stage's status board shows
it computing with a rising heartbeat (faults.Progress), so a long prompt is no failure.
"""

from __future__ import annotations

import datetime
import enum
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..tree import TreeShape
from .layout import CONTROL_RANK


class Op(enum.IntEnum):
    PREFILL = 0   # a new sequence: crop to 0, run positions 0..newest through every stage
    STEP = 1      # one decode cycle
    STATS = 2     # send per-cycle compute times to the control rank
    STOP = 3      # leave the stage loop
    PING = 4      # between sequences: nothing to do (keeps an idle stage within its idle timeout)


COMMAND_SIZE = 5


@dataclass(frozen=True)
class Command:
    op: Op
    newest: int = -1     # newest in-flight position (PREFILL: the prompt's last position)
    first: int = 0       # oldest in-flight position
    crop: int = -1       # crop every KV cache to this position before anything else (-1: keep)
    sample: int = 0      # 1: the sequence samples (a last stage holding the head sends logits)
    tree: tuple[int, ...] = ()   # W > 1: the cycle's tree.TreeShape as ints (STEP), else -1s

    def position(self, k: int) -> int | None:
        """The position stage k runs under this command (STEP), or None when it idles."""
        if self.op != Op.STEP:
            return None
        position = self.newest - k
        return position if position >= self.first else None

    def encode(self, device, size: int = COMMAND_SIZE) -> torch.Tensor:
        """`size` ints: the 5 header ints, the tree ints, -1 up to `size` (a tree run's STATS...)."""
        ints = [int(self.op), self.newest, self.first, self.crop, self.sample, *self.tree]
        assert len(ints) <= size, (len(ints), size)
        return torch.tensor(ints + [-1] * (size - len(ints)), dtype=torch.long, device=device)

    @classmethod
    def decode(cls, data: torch.Tensor) -> "Command":
        op, newest, first, crop, sample, *tree = data.tolist()
        return cls(Op(op), newest, first, crop, sample, tuple(tree))


def command_size(n_stages: int, width: int) -> int:
    """Ints per command of a run: 5, plus the tree shape when W > 1 (W = 1 is the chain's format)."""
    return COMMAND_SIZE + (TreeShape.size(n_stages, width) if width > 1 else 0)


def report_indices(stage: range, anchors, num_layers: int, last: bool) -> list[int]:
    """Hidden-state indices stage `stage` reports: the anchors it produces, plus L for the last."""
    wanted = set(anchors) | ({num_layers} if last else set())
    return sorted(a for a in wanted if stage.start < a <= stage.stop)


def first_line(err: Exception) -> str:
    """The first line of an error's message (gloo's run to many), or its type when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class PeerError(RuntimeError):
    """A message from or to `rank` did not complete: it timed out or the connection broke."""

    def __init__(self, rank: int, what: str, reason: str):
        super().__init__(f"{what} (rank {rank}): {reason}")
        self.rank, self.what, self.reason = rank, what, reason


class Link:
    """Point-to-point tensors and the per-cycle command, every wait bounded by `timeout` s.

    `names` maps ranks to roles for messages ("stage 1"); `on_wait` (optional) is told what the
    process waits for, so a status board can say it when something hangs.
    """

    def __init__(self, device: torch.device, timeout: float, names: dict[int, str],
                 idle_timeout: float | None = None, on_wait=None, progress=None, command_size: int = COMMAND_SIZE):
        self.device, self.names = device, names
        self.command_size = command_size   # ints per broadcast command (protocol.command_size)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.idle_timeout = datetime.timedelta(seconds=idle_timeout or timeout)
        self.on_wait = on_wait or (lambda state: None)
        self.progress = progress   # () -> True while some stage computes with a live heartbeat
        self.pending = []          # (work, tensor, peer, what, cycle) of sends not yet known complete
        self.cycle = 0             # sends are tagged with it; see flush(before_cycle=True)
        self.comm_seconds = 0.0    # time spent blocked in waits

    def _wait(self, work, rank: int, what: str, timeout) -> None:
        self.on_wait(f"waiting for {what} (rank {rank})")
        t = time.perf_counter()
        try:
            work.wait(timeout=timeout)
        except RuntimeError as err:
            reason = first_line(err)
            kind = "timed out" if "timed out" in reason.lower() or "timeout" in reason.lower() else "failed"
            raise PeerError(rank, what, f"{kind} after {time.perf_counter() - t:.1f} s: {reason}") from err
        finally:
            self.comm_seconds += time.perf_counter() - t

    def _wait_patiently(self, work, rank: int, what: str) -> None:
        """Wait as long as some stage computes with a live heartbeat (a long prefill): only
        `timeout` seconds without such progress fail. gloo closes the connection when a bounded
        wait expires and cannot poll a receive, so a helper thread does the unbounded wait and
        this thread watches the stages' boards."""
        self.on_wait(f"waiting for {what} (rank {rank})")
        done, failed = threading.Event(), []

        def wait() -> None:
            try:
                work.wait()   # bounded by the process group's own (idle) timeout
            except RuntimeError as err:
                failed.append(err)
            done.set()

        t = time.perf_counter()
        threading.Thread(target=wait, name="spd-patient-wait", daemon=True).start()
        limit = self.timeout.total_seconds()
        deadline = t + limit
        try:
            while not done.wait(min(0.25, limit)):
                if self.progress():
                    deadline = time.perf_counter() + limit
                elif time.perf_counter() > deadline:
                    raise PeerError(rank, what, f"timed out after {time.perf_counter() - t:.1f} s, no stage "
                                                f"computing for the last {limit:.1f} s")
        finally:
            self.comm_seconds += time.perf_counter() - t
        if failed:
            reason = first_line(failed[0])
            raise PeerError(rank, what, f"failed after {time.perf_counter() - t:.1f} s: {reason}") from failed[0]

    def name(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    def _start(self, op, rank: int, what: str):
        """Start an async op; a connection already broken fails here, before any wait."""
        try:
            return op()
        except RuntimeError as err:
            reason = first_line(err)
            raise PeerError(rank, what, f"failed: {reason}") from err

    def send(self, tensor: torch.Tensor, rank: int, what: str) -> None:
        """Start sending; completion is checked at a later `flush` (the tensor stays referenced).
        A send completes only once the peer posted the matching receive."""
        tensor = tensor.contiguous()
        work = self._start(lambda: dist.isend(tensor, rank), rank, f"{what} to {self.name(rank)}")
        self.pending.append((work, tensor, rank, what, self.cycle))

    def flush(self, before_cycle: bool = False) -> None:
        """Wait for the sends started so far (only those of earlier cycles with before_cycle:
        stage 1 takes stage 0's output of this cycle only when the next command came)."""
        keep = [entry for entry in self.pending if before_cycle and entry[4] >= self.cycle]
        done = [entry for entry in self.pending if not (before_cycle and entry[4] >= self.cycle)]
        self.pending = keep
        for work, _tensor, rank, what, _cycle in done:
            self._wait(work, rank, f"{what} to reach {self.name(rank)}", self.timeout)

    def post(self, shape, dtype, rank: int, what: str):
        """Start receiving a tensor; `take` returns it once it arrived."""
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        return self._start(lambda: dist.irecv(buffer, rank), rank, f"{what} from {self.name(rank)}"), buffer, rank, what

    def take(self, posted, patient: bool = False) -> torch.Tensor:
        """The posted tensor once it arrived; `patient` for a wait behind a peer's long compute
        (the prefill): then only `timeout` s without any stage computing fail (see _wait_patiently)."""
        work, buffer, rank, what = posted
        if patient and self.progress is not None:
            self._wait_patiently(work, rank, f"{what} from {self.name(rank)}")
        else:
            self._wait(work, rank, f"{what} from {self.name(rank)}", self.timeout)
        return buffer

    def recv(self, shape, dtype, rank: int, what: str, patient: bool = False) -> torch.Tensor:
        return self.take(self.post(shape, dtype, rank, what), patient)

    def broadcast(self, command: Command) -> None:
        """Rank 0: send this cycle's command to every rank (completion checked at `flush`)."""
        data = command.encode(self.device, self.command_size)
        self.cycle += 1
        work = self._start(lambda: dist.broadcast(data, src=CONTROL_RANK, async_op=True), CONTROL_RANK,
                           "the command broadcast")
        self.pending.append((work, data, CONTROL_RANK, "the command broadcast", self.cycle - 1))

    def receive_command(self, idle: bool = True) -> Command:
        """Any other rank: the next command (waiting at most `idle_timeout` between sequences)."""
        data = torch.empty(self.command_size, dtype=torch.long, device=self.device)
        work = self._start(lambda: dist.broadcast(data, src=CONTROL_RANK, async_op=True), CONTROL_RANK,
                           "the next command from the control rank")
        self._wait(work, CONTROL_RANK, "the next command from the control rank",
                   self.idle_timeout if idle else self.timeout)
        return Command.decode(data.cpu())
