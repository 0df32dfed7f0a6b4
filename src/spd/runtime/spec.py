"""What every rank of a distributed run shares: the `RunSpec` (decided on rank 0 before any weights
load, JSON for the workers) and the steps each rank takes to join: its device, the store, the
process group. launch.py (rank 0, plan and start) and worker.py (a stage process) both import
this module; neither imports the other's internals.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .layout import Layout, backend_for, default_threads, pick_device
from .protocol import command_size


@dataclass(frozen=True)
class RunSpec:
    """What every rank needs, decided before any weights load (JSON-able for the workers)."""

    model: str                       # model folder
    stage_layers: tuple[int, ...]
    draft_rank: str = "separate"
    anchors: tuple[int, ...] = ()    # hidden-state indices the stages report to rank 0
    dtype: str = "float32"
    devices: tuple[str, ...] | None = None
    timeout: float = 30.0            # bound on every message wait during a sequence
    idle_timeout: float = 600.0      # how long a stage waits for the next sequence
    threads: int | None = None       # torch threads per process (None: cores / local processes)
    pdm: str | None = None           # PDM checkpoint folder; None: a random PDM (rank 0 only)
    pdm_layers: int = 1
    lookahead: str = "off"           # off / on / auto: issue the next cycle before verifying
    drafter: str = "hybrid"          # rank 0's drafter: hybrid / pdm / retrieval (spd.retrieval)
    head: str = "last"               # final norm + lm_head on the last stage's rank, or "control" (rank 0)
    prefill_chunk: int = 32          # prompt positions per pipelined prefill message
    tree_width: int = 1              # W candidates per pipeline level (spd.tree; 1 = the chain)

    @property
    def command_size(self) -> int:
        return command_size(len(self.stage_layers), self.tree_width)

    @property
    def layout(self) -> Layout:
        return Layout.of(sum(self.stage_layers), len(self.stage_layers), list(self.stage_layers), self.draft_rank,
                         self.head)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        data = json.loads(text)
        data["stage_layers"], data["anchors"] = tuple(data["stage_layers"]), tuple(data["anchors"])
        data["devices"] = tuple(data["devices"]) if data["devices"] else None
        return cls(**data)


def rank_names(layout: Layout) -> dict[int, str]:
    return {rank: layout.role(rank) for rank in range(layout.world_size)}


READY = "loaded its weights"


def pick_rank_device(spec: RunSpec, rank: int, world_size: int, local_rank: int) -> torch.device:
    device = pick_device(rank, local_rank, list(spec.devices) if spec.devices else None, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_rank(spec: RunSpec, rank: int, world_size: int, store, local_rank: int, local_world: int):
    """Threads, device and process group of one rank; returns its device."""
    torch.set_num_threads(spec.threads or default_threads(local_world))
    device = pick_rank_device(spec, rank, world_size, local_rank)
    dist.init_process_group(backend_for(device), store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=spec.idle_timeout))
    return device


def connect_store(host: str, port: int, world_size: int, master: bool, timeout: float = 60.0):
    return dist.TCPStore(host, port, world_size, is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))
