"""A `Target` holding only some parts of a model, read from its safetensors files alone.

A stage process needs its decoder layers and the rotary embedding; the control process needs
the embedding, the final norm and the lm_head (plus stage 0's layers when it runs stage 0).
`load_partial_target` builds the model's skeleton on the meta device (no memory, no random
init), materialises only the parts asked for (their non-persistent buffers, such as Gemma's
embedding scale, set by transformers' own `_init_weights`), and reads only their tensors with
`safetensors.safe_open`, passed through transformers' own checkpoint conversion (per-expert
checkpoint keys -> the fused expert modules of transformers 5), so no process ever holds the
full model.

This module knows file layouts and module names, nothing about stages or processes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open  # reads single tensors of a file without loading the rest
from torch import nn

from ..target import Target, check_supported, family_of

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


def read_tensors(where: dict[str, Path], names) -> dict[str, torch.Tensor]:
    """The tensors `names` (checkpoint keys), each file opened once."""
    names = list(names)
    out = {}
    for file in sorted({where[name] for name in names}):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if where[name] == file:
                    out[name] = f.get_tensor(name)
    return out


def _load_converted(skeleton, where: dict[str, Path], parts: dict[str, nn.Module], dtype, device) -> None:
    """Materialise the modules `parts` (module path -> module of `skeleton`) from the checkpoint.

    Checkpoint keys are renamed and converted (e.g. per-expert weights stacked into fused expert
    tensors) by transformers' own conversion mapping for this model; only the keys that land in
    `parts` are read.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        convert_and_load_state_dict_in_model,
        rename_source_key,
    )
    from transformers.modeling_utils import LoadStateDictConfig

    for module in parts.values():   # real storage, buffers and parameters initialised as transformers does
        module.to_empty(device=device)
        module.apply(skeleton._init_weights)
    # some buffers are set from the parent (Falcon-H1's mup_vector, by the base model's init);
    # on the parts still on the meta device this is a no-op
    for ancestor in (skeleton.model, skeleton):
        skeleton._init_weights(ancestor)
    mapping = get_model_conversion_mapping(skeleton)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta_state = skeleton.state_dict()
    prefixes = tuple(f"{path}." for path in parts)
    wanted = [name for name in where
              if rename_source_key(name, renamings, converters, skeleton.base_model_prefix, meta_state)[0]
              .startswith(prefixes)]
    if not wanted:
        raise KeyError(f"no tensors for {sorted(parts)} in the checkpoint")
    config = LoadStateDictConfig(weight_mapping=mapping, dtype=dtype, device_map={"": str(device)})
    info, _ = convert_and_load_state_dict_in_model(skeleton, read_tensors(where, wanted), config)
    missing = sorted(k for k in info.missing_keys if k.startswith(prefixes) and k in dict(skeleton.named_parameters()))
    if missing or info.unexpected_keys or info.mismatched_keys or info.conversion_errors:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected "
                         f"{sorted(info.unexpected_keys)[:5]}, mismatched {sorted(info.mismatched_keys)[:5]}, "
                         f"conversion errors {info.conversion_errors}")
    for module in parts.values():
        module.to(dtype=dtype).eval().requires_grad_(False)


def load_partial_target(name_or_path: str, layers, embed: bool, head: bool,
                        dtype: torch.dtype = torch.float32, device="cpu") -> Target:
    """A Target with decoder layers `layers` (global indices), plus the embedding when `embed`
    and the final norm + lm_head when `head`; every other part is None / absent."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder, config = read_model_config(name_or_path)
    where = weight_files(folder)
    with torch.device("meta"):  # module structure only: no memory, no random init
        skeleton = AutoModelForCausalLM.from_config(config)
    body, family = skeleton.model, family_of(config)
    tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in where
    parts = {f"model.layers.{i}": body.layers[i] for i in layers}
    if embed or (head and tied):
        parts["model.embed_tokens"] = body.embed_tokens
    if head:
        parts[f"model.{family.norm}"] = getattr(body, family.norm)
        if not tied:
            parts["lm_head"] = skeleton.lm_head
    if parts:
        _load_converted(skeleton, where, parts, dtype, device)
    held = {i: body.layers[i] for i in layers}
    rotary = type(body.rotary_emb)(config).to(device)
    embed_tokens = body.embed_tokens if "model.embed_tokens" in parts else None
    norm = lm_head = None
    if head:
        norm = getattr(body, family.norm)
        if tied:  # the lm_head is the embedding matrix: share it, as transformers does
            lm_head = skeleton.lm_head.to_empty(device=device)
            lm_head.weight = embed_tokens.weight
        else:
            lm_head = skeleton.lm_head
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
