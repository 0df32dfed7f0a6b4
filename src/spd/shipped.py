"""PDM checkpoints (and baseline draft heads) that ship inside the spd package, for the embedded
default target."""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).parent / "assets" / "pdm"
HEAD_ASSETS = Path(__file__).parent / "assets" / "heads"   # smollm2-135m-eagle, smollm2-135m-ppsd-n<N>


def shipped_pdm_dir(stage_layers: list[int]) -> Path:
    return ASSETS / ("smollm2-135m-n%d-%s" % (len(stage_layers), "-".join(map(str, stage_layers))))


def shipped_splits() -> dict[int, list[int]]:
    """{n: layers per stage} of every PDM that ships, e.g. {2: [15, 15], 4: [8, 8, 7, 7]}."""
    configs = sorted(ASSETS.glob("*/pdm_config.json")) if ASSETS.is_dir() else []
    splits = [json.loads(c.read_text())["stage_layers"] for c in configs]
    return {len(split): split for split in sorted(splits, key=len)}


def describe_shipped() -> str:
    """'n=2 (15,15), n=4 (8,8,7,7)': for messages that say what ships."""
    return ", ".join(f"n={n} ({','.join(map(str, s))})" for n, s in shipped_splits().items()) or "none"


def shipped_pdm(model: str, stages: int | None, split: list[int] | None) -> str | None:
    """The shipped PDM for `--model default` and the asked split (n=2 when none asked), or None."""
    if model != "default":
        return None
    from .pdm import fits_split
    from .target import split_layers

    n = len(split) if split is not None else (stages if stages is not None else 2)
    counts = [len(s) for s in split_layers(30, n, split)]
    folder = shipped_pdm_dir(counts)
    if (folder / "pdm_config.json").is_file():
        return str(folder)
    for trained in shipped_splits().values():   # one trained for another split that drafts alike on this one
        config = json.loads((shipped_pdm_dir(trained) / "pdm_config.json").read_text())
        if fits_split(trained, config["anchors"], counts):
            return str(shipped_pdm_dir(trained))
    return None


def shipped_head(model: str, method: str, stages: int | None = None) -> str | None:
    """The shipped baseline head for `--model default`: "eagle", or "ppsd" for n = `stages`; None
    when none ships (the benchmark then runs an untrained head and says so)."""
    if model != "default":
        return None
    name = "smollm2-135m-eagle" if method == "eagle" else f"smollm2-135m-ppsd-n{stages}"
    folder = HEAD_ASSETS / name
    return str(folder) if (folder / "head_config.json").is_file() else None


def demo_pdm(stages: int) -> str:
    """The shipped PDM `spd demo --stages` runs, or FileNotFoundError saying what ships instead."""
    if stages not in shipped_splits():
        raise FileNotFoundError(
            f"no PDM ships for --stages {stages}; shipped: {describe_shipped()}. For another n, train one "
            f"(`spd train`) and decode with `spd generate --model default --pdm FOLDER`")
    return str(shipped_pdm_dir(shipped_splits()[stages]))
