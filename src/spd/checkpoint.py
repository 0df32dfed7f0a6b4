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


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: missing, truncated, not JSON, a field missing."""


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
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); restore it from the training run's "
                              f"output or retrain with `spd train`") from None
    return config_from_json(data, path)


def config_from_json(data, path) -> PDMConfig:
    """PDMConfig from the parsed JSON, or CheckpointError naming the missing or malformed field."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    required = {"target": TargetFingerprint.__dataclass_fields__, "stage_layers": None, "anchors": None}
    for name, inner in required.items():
        if name not in data:
            raise CheckpointError(f"{path} lacks the field {name!r}; it is not a complete PDM config "
                                  f"(restore it, or retrain with `spd train`)")
        missing = [f for f in inner or () if not isinstance(data[name], dict) or f not in data[name]]
        if missing:
            raise CheckpointError(f"{path}: field 'target' lacks {', '.join(map(repr, missing))} "
                                  f"(restore it, or retrain with `spd train`)")
    try:
        return PDMConfig.from_json(data)
    except (TypeError, ValueError) as err:   # a wrong type or an unknown field
        raise CheckpointError(f"{path} has a malformed field: {err} (restore it, or retrain with "
                              f"`spd train`)") from None


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


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or CheckpointError naming the file when it is missing,
    truncated or corrupt (safetensors raises its own error type, with no file name)."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the PDM checkpoint has its config but no weights "
                              f"(copy the whole folder, or retrain with `spd train`)")
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 -- SafetensorError is not exported under one stable name
        raise CheckpointError(f"{path} cannot be read ({err}); the file is truncated or corrupt: copy it "
                              f"again, or retrain with `spd train`") from None


def load_pdm(folder, target: Target, stage_layers: list[int] | None = None) -> PDM:
    """Load a PDM for `target`; checks the fingerprint (and the stage split when given)."""
    folder = Path(folder)
    config = read_config(folder)
    check_matches(config, target, f"PDM checkpoint {folder}", stage_layers)
    pdm = PDM(config, target)
    state = read_weights(folder / WEIGHTS)
    missing, unexpected = pdm.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointMismatchError(f"PDM checkpoint {folder} does not fit its own config: "
                                      f"missing {missing}, unexpected {unexpected}")
    return pdm.to(device=target.device, dtype=target.dtype).eval()
