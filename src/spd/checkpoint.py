"""PDM checkpoints: a folder with `pdm.safetensors` (weights) and `pdm_config.json`.

The JSON records the target the PDM belongs to (architecture, hidden size, layers, vocab size)
and the stage split and anchors; loading onto another target or another n fails with an error
that names the field and the fix instead of a shape error deep inside torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .pdm import PDM, PDMConfig, TargetFingerprint
from .target import Target

WEIGHTS, CONFIG = "pdm.safetensors", "pdm_config.json"


class CheckpointMismatchError(ValueError):
    pass


def save_pdm(pdm: PDM, folder, dtype: torch.dtype | None = None) -> Path:
    """Write the PDM's weights (optionally cast, e.g. bf16 to ship small) and config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
             for k, v in pdm.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(pdm.config.to_json(), indent=2) + "\n")
    return folder


def read_config(folder) -> PDMConfig:
    folder = Path(folder)
    path = folder / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a PDM checkpoint: {CONFIG} is missing "
                                f"(make one with `spd train ... --out {folder}`)")
    return PDMConfig.from_json(json.loads(path.read_text()))


def check_matches(config: PDMConfig, target: Target, where="the PDM checkpoint",
                  stage_layers: list[int] | None = None) -> None:
    """Raise CheckpointMismatchError naming the first field where checkpoint and target differ."""
    have = asdict(TargetFingerprint.of(target))
    for name, want in asdict(config.target).items():
        if have[name] != want:
            raise CheckpointMismatchError(
                f"{where} was made for a target with {name}={want!r}, but the loaded model has "
                f"{name}={have[name]!r}. Load the model it was trained for, or train a PDM for "
                f"this model with `spd train`.")
    if stage_layers is not None and tuple(stage_layers) != tuple(config.stage_layers):
        raise CheckpointMismatchError(
            f"{where} was trained for n={config.n_stages} stages split {list(config.stage_layers)}, "
            f"but {len(stage_layers)} stages split {list(stage_layers)} were asked for. Use "
            f"--stages {config.n_stages} --split {','.join(map(str, config.stage_layers))}, "
            f"or train a PDM for this split.")


def load_pdm(folder, target: Target, stage_layers: list[int] | None = None) -> PDM:
    """Load a PDM for `target`; checks the fingerprint (and the stage split when given)."""
    folder = Path(folder)
    config = read_config(folder)
    check_matches(config, target, f"PDM checkpoint {folder}", stage_layers)
    pdm = PDM(config, target)
    state = load_file(str(folder / WEIGHTS))
    missing, unexpected = pdm.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointMismatchError(f"PDM checkpoint {folder} does not fit its own config: "
                                      f"missing {missing}, unexpected {unexpected}")
    return pdm.to(device=target.device, dtype=target.dtype).eval()
