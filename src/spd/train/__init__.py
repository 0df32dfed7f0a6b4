"""Training a Pipeline Draft Module (SPEC section 4): data, the multi-depth layout, the loop.

    from spd.train import TrainConfig, train
    summary = train(TrainConfig(model="default", data=("chat.jsonl",), out="runs/pdm-n2", stages=2))

- `layout`: the block layout and structural mask (pure functions; what inference will see).
- `objective`: the PDM over the layout, teacher logits, KL + agreement.
- `features`: the frozen target's pass and the on-disk feature cache.
- `data`: file readers, chat rendering with assistant-only loss, token store, bucketing.
- `loop`: TrainConfig, train(), checkpoints and resume; `session`: DDP, signals, saved state.
"""

from .layout import Layout, make_layout, pdm_layout, sample_fills, structural_mask
from .loop import TrainConfig, TrainSummary, build_pdm, train
from .objective import DraftForward, distill

__all__ = ["Layout", "make_layout", "pdm_layout", "sample_fills", "structural_mask", "TrainConfig",
           "TrainSummary", "build_pdm", "train", "DraftForward", "distill"]
