"""A pipeline stage: its layers, their KV cache, and the loop that obeys the per-cycle command.

`StageWorker.handle(command)` is everything a stage does in one cycle: crop its cache if told,
take its input (stage 0: the new token's embedding from the control rank; stage k > 0: the
hidden state stage k-1 produced LAST cycle, which arrived while both were busy), run its layers
on the position the command assigns it, pass the output downstream for the next cycle, and
report the anchor hidden states it produced (plus, on the last stage, the finished token's
output) to the control rank. So all stages compute at once, each on a different token.

With the head on the last stage (`layout.head_on_last`), the last stage also applies the final
norm and lm_head to the finished token and sends rank 0 only what verification needs: the
argmax when greedy, the logits when the sequence samples (`Command.sample`).

Prefill is pipelined: the prompt flows through the stages in chunks of `prefill_chunk`
positions, each stage passing a chunk on as soon as it ran it, so stage k runs chunk j while
stage k+1 runs chunk j-1 (time to first token drops by up to n, and no wait lasts longer than a
chunk's compute). Each stage reports the prompt's anchors once, at the end.

With a tree width W > 1 a stage runs a whole tree level per cycle, (1, w, H) in one forward
under the tree mask of its own cache tail (`tree.StageTail`, the engine's class), which it
rebuilds from the command's `tree.TreeShape`: it first drops the branches the last verification
pruned (`KVCache.select`, as the engine does), then runs the listed nodes, taking their rows of
what its upstream neighbour sent by uid.

The same worker runs inside the control process for `--draft-rank with-first-stage`; then it
returns its report instead of sending it. `serve` is the loop of a stage process.
"""

from __future__ import annotations

import logging
import time

import torch

from ..target import Target
from ..tree import Node, StageTail, TreeShape
from .layout import CONTROL_RANK, Layout
from .protocol import Command, Link, Op, report_indices

log = logging.getLogger(__name__)


PREFILL_CHUNK = 32   # positions per prefill message: small enough to overlap, big enough for fast matmuls


def prefill_chunks(length: int, chunk: int, recurrent: bool) -> list[slice]:
    """The prompt's positions cut into consecutive chunks (one chunk for recurrent models, whose
    state caches only roll back to call boundaries: the prompt stays one call, as in the engine)."""
    size = length if recurrent or chunk <= 0 else chunk
    return [slice(start, min(start + size, length)) for start in range(0, length, size)]


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StageWorker:
    """Stage k of `layout` on `target` (which must hold at least that stage's layers)."""

    def __init__(self, target: Target, layout: Layout, k: int, link: Link, anchors,
                 prefill_chunk: int = PREFILL_CHUNK, width: int = 1):
        self.target, self.layout, self.k, self.link = target, layout, k, link
        self.stage = layout.stages[k]
        missing = [i for i in self.stage if i not in target.layers]
        assert not missing, f"stage {k} needs layers {list(self.stage)}, this process lacks {missing}"
        self.last = k == layout.n_stages - 1
        self.head = self.last and layout.head_on_last   # norm + lm_head run here
        assert not self.head or target.lm_head is not None, "the last stage needs the head"
        self.rows = report_indices(self.stage, anchors, layout.num_layers, self.last and not self.head)
        self.prefill_chunk = prefill_chunk
        self.record = set(self.rows)
        self.cache = target.new_cache(layout.stages, layers=self.stage)   # recurrent: n - k states
        self.upstream = CONTROL_RANK if k == 0 else layout.stage_rank(k - 1)
        self.downstream = None if self.last else layout.stage_rank(k + 1)
        self.local = layout.stage_rank(k) == CONTROL_RANK   # runs inside the control process
        self.incoming: tuple | None = None     # (position, or a tree level's uids; posted receive)
        self.carried: tuple | None = None      # (position, or a tree level's uids; hidden)
        self.width = width                     # tree width W (1: the chain)
        self.tail = StageTail()                # W > 1: the in-flight nodes of this stage's caches
        self.cycle_seconds: list[float] = []   # compute time per STEP of the current sequence
        self.prefill_seconds = 0.0

    def take_carried(self) -> None:
        """At every command, first: take what stage k-1 sent in the previous STEP, if it ran
        then (to use now, or to drop when a rejection made it stale)."""
        self.carried = None
        if self.incoming is not None:
            key, posted = self.incoming
            self.carried, self.incoming = (key, self.link.take(posted)), None

    def expect(self, command: Command) -> None:
        """Post the receive of what stage k-1 sends in this STEP, taken at the next command. Posted
        now, the transfer goes ahead as soon as upstream sends; posted at the next command, it
        waited for both processes' messaging threads to get a busy core (0.3-6 ms a cycle on a
        2-core CPU)."""
        if self.k == 0 or command.op != Op.STEP:
            return
        size, what = self.target.hidden_size, f"the output of stage {self.k - 1}"
        if self.width > 1:
            upstream = self.shape(command).stages[self.k - 1]
            if upstream:
                self.incoming = (tuple(uid for uid, _ in upstream),
                                 self.link.post((1, len(upstream), size), self.target.dtype, self.upstream,
                                                f"{what}: a {len(upstream)}-node tree level"))
            return
        position = command.position(self.k - 1)
        if position is not None:
            self.incoming = (position, self.link.post((1, 1, size), self.target.dtype, self.upstream,
                                                      f"{what}: the hidden state of position {position}"))

    @torch.inference_mode()
    def handle(self, command: Command, given: torch.Tensor | None = None) -> torch.Tensor | None:
        """Apply one PREFILL or STEP command; return the report (r, q, H) or None.

        `given` is stage 0's input when it runs in the control process.
        """
        carried, self.carried = self.carried, None   # taken by take_carried() for this command
        self.expect(command)
        if command.crop >= 0:
            self.cache.crop(command.crop)
            self.tail.restart()
        if command.op == Op.PREFILL:
            return self._prefill(command, given)
        if self.width > 1:
            return self._tree_step(command, given, carried)
        position = command.position(self.k)
        if position is None:
            self.cycle_seconds.append(0.0)
            return None
        if self.k == 0:
            hidden = given if given is not None else self.link.recv(
                (1, 1, self.target.hidden_size), self.target.dtype, self.upstream,
                f"the embedding of position {position}")
        else:
            assert carried is not None and carried[0] == position, (self.k, carried, command)
            hidden = carried[1]
        # the board said "waiting for ..." during the receive: say computing again (a peer waiting
        # on this stage keeps waiting while it computes, see protocol.Link._wait_patiently)
        self.link.on_wait("computing")
        t = now(self.link.device)
        out, snapshots = self._run(hidden, torch.tensor([position], device=self.link.device))
        verdict = self._verdict(out, command)
        self.cycle_seconds.append(now(self.link.device) - t)
        return self._report([snapshots], verdict)

    def shape(self, command: Command) -> TreeShape:
        return TreeShape.decode(command.tree, self.layout.n_stages, self.width)

    def _tree_step(self, command: Command, given: torch.Tensor | None, carried) -> torch.Tensor | None:
        """A STEP of a tree run: prune as the last verification said, then run this stage's level."""
        shape = self.shape(command)
        if shape.accepted >= 0:   # the root exited and this child survived: drop the other branches
            start, keep = self.tail.settle(shape.accepted)
            if keep is not None:
                self.cache.select(start, keep, self.stage)
        entries = shape.stages[self.k]
        if not entries:
            self.cycle_seconds.append(0.0)
            return None
        nodes = []
        for uid, parent in entries:   # a parent ran every stage before its children: it is in the tail
            above = self.tail.find(parent) if parent >= 0 else None
            nodes.append(Node(-1, above.position + 1 if above is not None else command.first, above, uid=uid))
        if self.k == 0:
            hidden = given if given is not None else self.link.recv(
                (1, len(nodes), self.target.hidden_size), self.target.dtype, self.upstream,
                f"the embeddings of a {len(nodes)}-node tree level")
        else:   # the rows of upstream's last output that survived the pruning, in level order
            assert carried is not None, (self.k, command)
            uids, sent = carried
            hidden = sent[:, [uids.index(uid) for uid, _ in entries]]
        self.link.on_wait("computing")
        t = now(self.link.device)
        positions = torch.tensor([node.position for node in nodes], device=self.link.device)
        out, snapshots = self._run(hidden, positions, self.tail.mask(nodes, self.link.device))
        self.tail.ran(nodes)
        verdict = self._verdict(out, command)
        self.cycle_seconds.append(now(self.link.device) - t)
        return self._report([snapshots], verdict)

    def _run(self, hidden, positions, tree=None):
        """Run this stage's layers and pass the output downstream at once."""
        out, snapshots = self.target.run_layers(hidden, positions, self.stage, self.cache, self.record, tree)
        if self.downstream is not None:
            self.link.send(out, self.downstream, "the output of stage %d" % self.k)
        return out, snapshots

    def _verdict(self, out: torch.Tensor, command: Command) -> torch.Tensor | None:
        """At the head: the finished (last) position's logits when sampling, else their argmax."""
        if not self.head:
            return None
        logits = self.target.logits(out[0, -1])
        return logits if command.sample else logits.argmax().reshape(1)

    def _prefill(self, command: Command, given: torch.Tensor | None) -> torch.Tensor | None:
        """The prompt, chunk by chunk: receive a chunk, run it, pass it on at once (see module doc)."""
        length, hidden_size = command.newest + 1, self.target.hidden_size
        self.cycle_seconds, self.prefill_seconds = [], 0.0
        if self.k == 0 and given is None:   # the whole prompt's embedding in one message
            given = self.link.recv((1, length, hidden_size), self.target.dtype, self.upstream,
                                   "the prompt's embeddings", patient=True)
        chunks = prefill_chunks(length, self.prefill_chunk, self.target.recurrent)
        snapshots = []
        for span in chunks:
            hidden = given[:, span] if self.k == 0 else self.link.recv(
                (1, span.stop - span.start, hidden_size), self.target.dtype, self.upstream,
                f"the prompt's positions {span.start}..{span.stop - 1}", patient=True)   # behind upstream
            self.link.on_wait("computing prefill")
            t = now(self.link.device)
            positions = torch.arange(span.start, span.stop, device=self.link.device)
            out, snaps = self._run(hidden, positions)
            snapshots.append(snaps)
            self.prefill_seconds += now(self.link.device) - t
        t = now(self.link.device)
        verdict = self._verdict(out, command)
        self.prefill_seconds += now(self.link.device) - t
        return self._report(snapshots, verdict)

    def _report(self, snapshots: list[dict], verdict: torch.Tensor | None) -> torch.Tensor | None:
        """Send rank 0 the (r, q, H) anchor rows over the positions just run (returned instead when
        this stage runs in rank 0), then the verdict input: rank 0 receives them in this order."""
        report = None
        if self.rows:
            report = torch.stack([torch.cat([snaps[i] for snaps in snapshots]) for i in self.rows])
            if not self.local:
                self.link.send(report, CONTROL_RANK, "the report of stage %d" % self.k)
        if verdict is not None:
            self.link.send(verdict, CONTROL_RANK, "the verdict input of stage %d" % self.k)
        return report

    def skip(self, command: Command) -> None:
        """Stage 0 in the control process, for a looked-ahead cycle a rejection made useless:
        compute nothing, but send stage 1 the placeholder it expects (it drops it)."""
        assert self.k == 0 and self.local
        self.cycle_seconds.append(0.0)
        if self.downstream is not None:
            self.link.send(torch.zeros(1, 1, self.target.hidden_size, dtype=self.target.dtype, device=self.link.device),
                           self.downstream, "a placeholder for stage 1")

    def timings(self) -> torch.Tensor:
        """[prefill seconds, compute seconds of every STEP] of the current sequence (float64)."""
        return torch.tensor([self.prefill_seconds, *self.cycle_seconds], dtype=torch.float64,
                            device=self.link.device)


def serve(worker: StageWorker, link: Link, board=None) -> None:
    """A stage process's loop: obey commands until STOP."""
    set_state = board.set if board is not None else (lambda state: None)
    while True:
        command = link.receive_command(idle=True)
        worker.take_carried()
        link.flush()   # last cycle's sends: their receivers posted by now
        if command.op == Op.STOP:
            log.debug("stage %d: stop", worker.k)
            return
        if command.op == Op.PING:
            continue
        if command.op == Op.STATS:
            link.send(worker.timings(), CONTROL_RANK, "the timings of stage %d" % worker.k)
        else:
            cycle = ("prefill" if command.op == Op.PREFILL else "a tree level" if worker.width > 1
                     else f"position {command.position(worker.k)}")
            set_state(f"computing {cycle}")
            worker.handle(command)
