"""Loading a baseline draft head from its folder, whichever method made it (EAGLE-style or PPSD).

Above eagle.py and ppsd.py (which import heads.py for what they share); the checkpoint format,
saving and the target check are in heads.py.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from torch import nn

from ..target import Target
from .eagle import EagleConfig, EagleHead
from .heads import LM_HEAD, WEIGHTS, HeadCheckpointError, check_target, read_head_meta
from .ppsd import PPSDConfig, PPSDHead


def load_head(folder, target: Target, method: str | None = None) -> nn.Module:
    """Load an EAGLE-style or PPSD head for `target` (checking the fingerprint and the method)."""
    kinds = {"eagle": (EagleConfig, EagleHead), "ppsd": (PPSDConfig, PPSDHead)}
    meta = read_head_meta(folder)
    found, data = meta["method"], meta["config"]
    if method is not None and found != method:
        raise HeadCheckpointError(f"{folder} holds a {found!r} head, but a {method!r} head was asked for")
    if found not in kinds:
        raise HeadCheckpointError(f"{folder}: unknown head method {found!r} (known: {', '.join(kinds)})")
    config_cls, head_cls = kinds[found]
    config = config_cls.from_json(data)
    check_target(config.target, target, f"{found} head {folder}")
    head = head_cls(config, target)
    missing, unexpected = head.load_state_dict(load_file(str(Path(folder) / WEIGHTS)), strict=False)
    if meta.get("lm_head") == "target" and missing == [LM_HEAD]:   # stored without the target's rows
        missing = []
        head.lm_head.proj.weight.data.copy_(target.lm_head.weight[head.lm_head.draft_ids.to(target.device)])
    if missing or unexpected:
        raise HeadCheckpointError(f"{folder} does not fit its own config: missing {missing}, "
                                  f"unexpected {unexpected}")
    return head.to(device=target.device, dtype=target.dtype).eval()
