"""A `Target` holding only some parts of a model, read from its safetensors files alone.

A stage process needs its decoder layers and the rotary embedding; the control process needs
the embedding, the final norm and the lm_head (plus stage 0's layers when it runs stage 0).
`load_partial_target` builds the model's skeleton on the meta device (no memory, no random
init), materialises only the parts asked for, and reads only their tensors with
`safetensors.safe_open`, so no process ever holds the full model.

This module knows file layouts and module names, nothing about stages or processes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open  # reads single tensors of a file without loading the rest
from torch import nn

from ..target import Target, check_supported

log = logging.getLogger(__name__)


def read_model_config(name_or_path: str):
    """(folder, transformers config) of a local model folder, 'default', or a cached hub id."""
    from transformers import AutoConfig

    from ..default_target import resolve_model_path

    folder = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    if not Path(folder).is_dir():  # a hub id: use the local snapshot transformers cached
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, allow_patterns=["*.json", "*.safetensors"])
    return Path(folder), config


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights; the distributed runtime "
                                f"reads only safetensors (re-save the model with save_pretrained)")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def read_tensors(where: dict[str, Path], prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with `prefix`, keyed by the rest of the name."""
    names = [name for name in where if name.startswith(prefix)]
    if not names:
        raise KeyError(f"no tensors named {prefix}* in the checkpoint")
    out = {}
    for file in sorted({where[name] for name in names}):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if where[name] == file:
                    out[name[len(prefix):]] = f.get_tensor(name)
    return out


def _materialise(module: nn.Module, state: dict[str, torch.Tensor], dtype, device) -> nn.Module:
    module.to_empty(device=device)
    module.load_state_dict(state, strict=True)
    return module.to(dtype=dtype).eval().requires_grad_(False)


def load_partial_target(name_or_path: str, layers, embed: bool, head: bool,
                        dtype: torch.dtype = torch.float32, device="cpu") -> Target:
    """A Target with decoder layers `layers` (global indices), plus the embedding when `embed`
    and the final norm + lm_head when `head`; every other part is None / absent."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder, config = read_model_config(name_or_path)
    where = weight_files(folder)
    with torch.device("meta"):  # module structure only: no memory, no random init
        skeleton = AutoModelForCausalLM.from_config(config)
    body = skeleton.model
    held = {i: _materialise(body.layers[i], read_tensors(where, f"model.layers.{i}."), dtype, device)
            for i in layers}
    rotary = type(body.rotary_emb)(config).to(device)
    tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in where
    embed_tokens = norm = lm_head = None
    if embed or (head and tied):
        embed_tokens = _materialise(body.embed_tokens, read_tensors(where, "model.embed_tokens."), dtype, device)
    if head:
        norm = _materialise(body.norm, read_tensors(where, "model.norm."), dtype, device)
        if tied:  # the lm_head is the embedding matrix: share it, as transformers does
            lm_head = skeleton.lm_head.to_empty(device=device)
            lm_head.weight = embed_tokens.weight
        else:
            lm_head = _materialise(skeleton.lm_head, read_tensors(where, "lm_head."), dtype, device)
    try:
        generation = GenerationConfig.from_pretrained(folder)
        eos = generation.eos_token_id
    except OSError:
        eos = None
    eos = config.eos_token_id if eos is None else eos
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    archs = getattr(config, "architectures", None) or [type(skeleton).__name__]
    return Target(config=config, embed_tokens=embed_tokens, layers=held, rotary_emb=rotary, norm=norm,
                  lm_head=lm_head, eos_token_ids=eos_ids, architecture=archs[0],
                  layer_type=type(body.layers[0]))


def parameter_count(target: Target) -> int:
    """Distinct parameters this Target holds (a tied lm_head counts once)."""
    parts = [target.embed_tokens, target.norm, target.lm_head, *target.layers.values()]
    params = {id(p): p for part in parts if part is not None for p in part.parameters()}
    return sum(p.numel() for p in params.values())
