"""A stage process: `worker_main` (forked by spd.runtime.launch on one machine; also
`python -m spd.runtime.worker --spec JSON --rank R --world-size W --master H:P`), or
`run_stage`, reached through `start()` on ranks > 0 under torchrun. Loads only its stage's layers, publishes its status, serves commands until STOP, and
exits non-zero (after publishing why) on any failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

import torch.distributed as dist

from .faults import Progress, StatusBoard, die_with_parent
from .layout import CONTROL_RANK
from .protocol import Link, PeerError
from .spec import READY, RunSpec, connect_store, init_rank, pick_rank_device, rank_names

log = logging.getLogger(__name__)


def run_stage(spec, rank: int, world_size: int, store, local_rank: int, local_world: int) -> None:
    """Everything a stage rank does; raises SystemExit(1) after a failure."""
    from ..loading import parse_dtype
    from .stage import StageWorker, serve
    from .weights import load_partial_target, parameter_count

    layout = spec.layout
    k = layout.stage_of(rank)
    assert k is not None and rank != CONTROL_RANK, f"rank {rank} runs no stage in {layout}"
    board = StatusBoard(store, rank).start()
    try:
        board.set("loading its layers")
        device = pick_rank_device(spec, rank, world_size, local_rank)
        head = layout.head_on_last and k == layout.n_stages - 1   # norm + lm_head run on the last stage
        target = load_partial_target(spec.model, layout.stages[k], embed=False, head=head,
                                     dtype=parse_dtype(spec.dtype), device=device)
        board.info = {"params": parameter_count(target), "layers": sorted(target.layers)}
        board.set(READY)
        board.publish()
        init_rank(spec, rank, world_size, store, local_rank, local_world)
        stage_ranks = [layout.stage_rank(j) for j in range(layout.n_stages)]
        link = Link(device, spec.timeout, rank_names(layout), spec.idle_timeout, on_wait=board.set,
                    progress=Progress(board.read, [r for r in stage_ranks if r != rank]),
                    command_size=spec.command_size)
        worker = StageWorker(target, layout, k, link, spec.anchors, prefill_chunk=spec.prefill_chunk, width=spec.tree_width)
        log.info("stage %d (rank %d, pid %d): layers %d..%d on %s", k, rank, os.getpid(),
                 layout.stages[k].start, layout.stages[k].stop - 1, device)
        serve(worker, link, board)
        board.set("stopped")
    except PeerError as err:
        board.fail(f"lost contact: {err}", peer=True)
        print(f"spd stage {k} (rank {rank}): {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as err:  # noqa: BLE001 -- any failure must reach the control rank
        board.fail(f"{type(err).__name__}: {err}", peer=False)
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        board.publish()
        board.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass


def worker_main(spec_json: str, rank: int, world_size: int, master: str) -> None:
    """Entry of a stage process started on this machine by spd.runtime.launch."""
    die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    host, port = master.rsplit(":", 1)
    store = connect_store(host, int(port), world_size, master=False)
    run_stage(RunSpec.from_json(spec_json), rank, world_size, store, rank, world_size)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True, help="host:port of rank 0's store")
    args = parser.parse_args(argv)
    worker_main(args.spec, args.rank, args.world_size, args.master)


if __name__ == "__main__":
    main()
