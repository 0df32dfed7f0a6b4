"""PDM checkpoints that ship inside the spd package, for the embedded default target."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent / "assets" / "pdm"


def shipped_pdm_dir(stage_layers: list[int]) -> Path:
    return ASSETS / ("smollm2-135m-n%d-%s" % (len(stage_layers), "-".join(map(str, stage_layers))))


def shipped_pdm(model: str, stages: int | None, split: list[int] | None) -> str | None:
    """The shipped PDM for `--model default` and the asked split (n=2 when none asked), or None."""
    if model != "default":
        return None
    from .target import split_layers

    n = len(split) if split is not None else (stages or 2)
    folder = shipped_pdm_dir([len(s) for s in split_layers(30, n, split)])
    return str(folder) if (folder / "pdm_config.json").is_file() else None
