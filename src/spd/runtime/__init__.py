"""The distributed SPD runtime (SPEC section 7): one process per stage, a control rank, torch.distributed.

    spec = plan("default", stages=2, draft_rank="with-first-stage")   # checks; loads no weights
    with start(spec) as session:                                       # spawns (or joins torchrun)
        result = session.generate(prompt_ids, max_new_tokens=64)

Modules: layout (who runs what), weights (load only a process's own tensors), protocol (the
per-cycle command and point-to-point messages with deadlines), stage (a stage's cycle and loop),
controller (rank 0: the engine's schedule with remote stages), faults (status boards, blaming a
stage), spec (RunSpec and joining a rank), launch (plan/start/Session), worker (a stage
process's entry point).
"""

from .faults import StageFailure
from .launch import Session, plan, start, under_torchrun
from .layout import DRAFT_RANKS, Layout, LayoutError
from .spec import RunSpec

__all__ = ["DRAFT_RANKS", "Layout", "LayoutError", "RunSpec", "Session", "StageFailure", "plan", "start",
           "under_torchrun"]
