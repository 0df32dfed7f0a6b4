"""What a training process needs around the maths: device and DDP, signals, saved state.

- `Session`: one process's device, rank and world size; under torchrun (WORLD_SIZE > 1) it
  joins the process group (NCCL on GPUs, gloo on CPU) and wraps the module in DDP.
- `StopSignal`: Ctrl-C / SIGTERM ask the loop to stop after the current step (it checkpoints);
  a second Ctrl-C stops at once.
- `save_state` / `load_state`: optimizer state and step next to the PDM checkpoint; a resume
  with other settings that change the run fails naming the setting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from dataclasses import dataclass, fields
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STATE = "train_state.pt"


@dataclass
class Session:
    device: torch.device
    rank: int = 0
    world: int = 1

    @classmethod
    def start(cls, device: str) -> "Session":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls(torch.device(device))
        import torch.distributed as dist

        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.startswith("cuda"):
            device = f"cuda:{local}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return cls(torch.device(device), dist.get_rank(), dist.get_world_size())

    def wrap(self, module):
        if self.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def no_sync(self, module, last: bool):
        """Skip DDP's gradient all-reduce on every micro-batch but the last of a step."""
        if self.world == 1 or last:
            return contextlib.nullcontext()
        return module.no_sync()

    def all_sum(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(t)
        return int(t)

    def log_line(self, out: Path, record: dict) -> None:
        if self.rank == 0:
            with open(out / "train_log.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class StopSignal:
    """Context manager: `reason` becomes "SIGINT"/"SIGTERM" when one arrives."""

    def __init__(self):
        self.reason: str | None = None
        self._old = {}

    def _handle(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        log.warning("%s: stopping after this step and writing a checkpoint (Ctrl-C again to abort)", self.reason)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False


def save_state(out: Path, state: dict) -> None:
    tmp = out / (STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / STATE)


def run_state(out: Path, cfg, method: str = "pdm") -> dict:
    """The saved state of the run in `out` when `cfg.resume` ({} for a fresh run), after the checks
    every training run makes: a fresh run does not overwrite one, a resumed one exists and trains
    the same kind of model (`method`: "pdm", or a baseline head's name)."""
    has_state = (out / STATE).is_file()
    if has_state and not cfg.resume:
        raise FileExistsError(f"{out} already holds a training run; pass --resume to continue it or choose another --out")
    if cfg.resume and not has_state:
        raise FileNotFoundError(f"--resume: {out} holds no training state ({STATE})")
    state = load_state(out, cfg) if cfg.resume else {}
    was = state.get("method", "pdm")
    if state and was != method:
        trains = "a PDM" if was == "pdm" else f"an {was} head"
        raise ValueError(f"--resume: {out} trains {trains}, not {'a PDM' if method == 'pdm' else method}; "
                         f"pass --method {was}")
    return state


def load_state(out: Path, cfg) -> dict:
    """The saved state, after checking that the settings that shape the run are unchanged."""
    state = torch.load(out / STATE, map_location="cpu", weights_only=True)
    saved = state["config"]
    defaults = {f.name: f.default for f in fields(cfg)}   # a setting newer than the saved run: its default
    for name in cfg.FIXED:
        now = getattr(cfg, name)
        before = saved.get(name, defaults[name])
        if isinstance(now, tuple):
            now = list(now)
        if isinstance(before, tuple):
            before = list(before)
        if now != before:
            raise ValueError(f"--resume: {out} was trained with {name}={before!r}, now {name}={now!r}; "
                             f"resume with the same setting or train into another --out")
    return state
