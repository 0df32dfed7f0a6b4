"""Which process does what: stage ranks, the control rank, devices and the backend.

n stages need n+1 processes with `draft_rank="separate"` (rank 0 controls: embedding, final
norm, lm_head, PDM, verification; rank k+1 runs stage k) or n processes with
`draft_rank="with-first-stage"` (rank 0 controls and runs stage 0; rank k runs stage k).
`head` places the final norm + lm_head: on the last stage's rank ("last", the default: it
balances the ranks when rank 0 also runs stage 0 and the drafter) or on the control rank.
Everything here is a pure function of the arguments, checked before any weights load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..target import split_layers

CONTROL_RANK = 0
DRAFT_RANKS = ("separate", "with-first-stage")
HEADS = ("last", "control")   # where final norm + lm_head run: the last stage's rank, or rank 0


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    stages: tuple[range, ...]       # global layer indices of each stage
    draft_rank: str = "separate"
    head: str = "last"

    def __post_init__(self):
        if self.draft_rank not in DRAFT_RANKS:
            raise LayoutError(f"--draft-rank must be one of {', '.join(DRAFT_RANKS)}; got {self.draft_rank!r}")
        if self.head not in HEADS:
            raise LayoutError(f"--head must be one of {', '.join(HEADS)}; got {self.head!r}")

    @classmethod
    def of(cls, num_layers: int, n_stages: int, counts: list[int] | None = None,
           draft_rank: str = "separate", head: str = "last") -> "Layout":
        try:
            stages = split_layers(num_layers, n_stages, counts)
        except ValueError as err:
            raise LayoutError(str(err)) from None
        return cls(tuple(stages), draft_rank, head)

    @property
    def head_on_last(self) -> bool:
        """True when the last stage's process (not rank 0) applies norm + lm_head and sends rank 0
        only what verification needs (the argmax, or the logits when sampling)."""
        return self.head == "last" and self.stage_rank(self.n_stages - 1) != CONTROL_RANK

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].stop

    @property
    def colocated(self) -> bool:
        """True when the control rank also runs stage 0."""
        return self.draft_rank == "with-first-stage"

    @property
    def world_size(self) -> int:
        return self.n_stages + (not self.colocated)

    def stage_rank(self, k: int) -> int:
        return k if self.colocated else k + 1

    def stage_of(self, rank: int) -> int | None:
        """The stage a rank runs (None: the control rank of a separate layout)."""
        k = rank if self.colocated else rank - 1
        return k if 0 <= k < self.n_stages else None

    def role(self, rank: int) -> str:
        k = self.stage_of(rank)
        if rank == CONTROL_RANK:
            return "control" + (f" + stage {k}" if k is not None else "")
        return f"stage {k}"

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            need = ("n+1 (rank 0 drafts and verifies, ranks 1..n run the stages)" if not self.colocated
                    else "n (rank 0 drafts, verifies and runs stage 0)")
            other = ("--draft-rank with-first-stage needs one process fewer" if not self.colocated
                     else "--draft-rank separate needs one process more")
            raise LayoutError(f"world size {world_size} does not fit n={self.n_stages} stages with "
                              f"--draft-rank {self.draft_rank}: that needs {need} = {self.world_size} "
                              f"processes. Launch {self.world_size} processes in total (torchrun "
                              f"--nnodes x --nproc-per-node), or change --stages; {other}.")


def parse_devices(text: str | None) -> list[str] | None:
    """'cuda:0,cuda:1,cpu' -> one device per rank; None/'' -> None (pick by LOCAL_RANK)."""
    if not text:
        return None
    return [d.strip() for d in text.split(",") if d.strip()]


def pick_device(rank: int, local_rank: int, devices: list[str] | None, world_size: int) -> torch.device:
    """A rank's device: the explicit list, else cuda:LOCAL_RANK when CUDA exists, else cpu."""
    if devices is not None:
        if len(devices) != world_size:
            raise LayoutError(f"--devices lists {len(devices)} devices ({','.join(devices)}) but "
                              f"{world_size} processes run; give one device per rank, rank 0 first")
        return torch.device(devices[rank])
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ranks (every rank of a run must be of one kind)."""
    return "nccl" if device.type == "cuda" else "gloo"


def default_threads(local_world_size: int) -> int:
    """torch threads per process so that the processes of one machine share its cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
