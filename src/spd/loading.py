"""From user-facing names to ready objects: model + tokenizer, stage split, drafter, prompt ids.

The CLI, the server and the benchmarks all start here, so a flag means the same thing in each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .checkpoint import load_pdm, read_config
from .pdm import PDM
from .retrieval import Gate, drafter_kind, make_drafter
from .shipped import describe_shipped, shipped_pdm
from .target import Target, load_target, split_layers

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_int_list(text: str | None, what: str) -> list[int] | None:
    """'8,8,7,7' -> [8, 8, 7, 7]; None/'' -> None; a clear error for anything else."""
    if text is None or not text.strip():
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like 8,8,7,7; got {text!r}") from None


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


@dataclass
class Decoder:
    """Everything one SPD decode needs."""

    target: Target
    tokenizer: object | None
    stages: list[range]
    pdm: PDM | None            # None with the retrieval drafter (it needs no PDM)
    drafter_kind: str = "pdm"  # hybrid | pdm | retrieval (spd.retrieval.DRAFTERS)
    gate: Gate | None = None   # the hybrid's gate: the PDM checkpoint's, else the default

    @property
    def stage_layers(self) -> list[int]:
        return [len(s) for s in self.stages]

    def drafter(self):
        """A fresh drafter for one sequence stream."""
        return make_drafter(self.drafter_kind, self.pdm, self.gate)


def resolve_split(num_layers: int, stages: int | None, split: list[int] | None,
                  pdm_path: str | None) -> list[range]:
    """Stage split from --stages/--split, defaulting to the PDM checkpoint's own split."""
    if pdm_path is not None and stages is None and split is None:
        trained = read_config(pdm_path).stage_layers
        return split_layers(num_layers, len(trained), list(trained))
    if split is not None and stages is not None and len(split) != stages:
        raise ValueError(f"--split has {len(split)} counts but --stages is {stages}")
    n = len(split) if split is not None else (stages if stages is not None else 2)
    return split_layers(num_layers, n, split)


def build_decoder(model: str, stages: int | None = None, split: list[int] | None = None,
                  pdm_path: str | None = None, dtype: torch.dtype = torch.float32,
                  device: str = "cpu", pdm_layers: int = 1, drafter: str | None = None) -> Decoder:
    """Load the target and what the drafter needs: `drafter` None means hybrid when a PDM is
    given or ships, else retrieval; pdm or hybrid without a PDM get a random one (warned)."""
    if pdm_path is None:
        pdm_path = shipped_pdm(model, stages, split)
    kind = drafter_kind(drafter, pdm_path is not None)
    if pdm_path is not None:
        read_config(pdm_path)  # a bad checkpoint path fails before the model loads
    gate = Gate.load(pdm_path) if pdm_path is not None else Gate()
    target, tokenizer = load_target(model, dtype=dtype, device=device)
    layer_split = resolve_split(target.num_layers, stages, split, pdm_path)
    if kind == "retrieval":
        pdm = None
    elif pdm_path is not None:
        pdm = load_pdm(pdm_path, target, [len(s) for s in layer_split])
    else:
        shipped = (f" none ships for the default target at split "
                   f"{','.join(str(len(s)) for s in layer_split)} (shipped: {describe_shipped()});"
                   if model == "default" else "")
        log.warning(f"no --pdm given:{shipped} drafting with a randomly initialised PDM. Output is "
                    "still exact, but almost every draft is rejected; train one with `spd train`.")
        pdm = PDM.create(target, [len(s) for s in layer_split], num_layers=pdm_layers).eval()
    return Decoder(target, tokenizer, layer_split, pdm, kind, gate)


def encode_prompt(tokenizer, text: str, raw: bool = False) -> list[int]:
    """Prompt text -> ids; chat models get their chat template unless raw."""
    if tokenizer is None:
        raise ValueError("this model folder has no tokenizer: give the prompt as ids (--prompt-ids 5,17,33)")
    check_utf8(text, "--prompt")
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def check_utf8(text: str, what: str) -> None:
    """ValueError naming the first character that is no Unicode scalar (a byte that was not UTF-8,
    which Python keeps as a lone surrogate) before a tokenizer fails on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(text[err.start])
        shown = f"the byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"a lone surrogate U+{char:04X}"
        raise ValueError(f"{what} is not valid UTF-8 text: {shown} at character {err.start}; "
                         f"re-encode it as UTF-8 (e.g. with iconv -t UTF-8)") from None


def check_prompt(ids: list[int], vocab_size: int, context: int, max_new_tokens: int) -> None:
    """Refuse a prompt that is empty, holds ids outside the vocabulary, or does not fit the
    model's context together with the tokens asked for (as the server does)."""
    if not ids:
        raise ValueError("the prompt is empty (no tokens): give some text with --prompt or ids with --prompt-ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt ids must lie in [0, {vocab_size}); got {bad[:5]}")
    if len(ids) >= context:
        raise ValueError(f"the prompt is {len(ids)} tokens, but the model's context is {context} tokens "
                         f"(prompt plus new tokens); shorten the prompt")
    if len(ids) + max_new_tokens > context:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus --max-new-tokens {max_new_tokens} is "
                         f"{len(ids) + max_new_tokens} tokens, beyond the model's context of {context}; "
                         f"use --max-new-tokens {context - len(ids)} or less")


def context_length(config, fallback: int = 2048) -> int:
    """The target's own context length (prompt plus new tokens) from its config."""
    return int(getattr(config, "max_position_embeddings", None) or fallback)


def check_device(name: str) -> None:
    """ValueError for a device torch does not know or this machine lacks (before any weights load)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device: use cpu, cuda, cuda:0, mps, ...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch build or machine has no CUDA device; use --device cpu")
