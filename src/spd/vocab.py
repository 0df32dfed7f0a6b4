"""Draft vocabularies: the K most frequent token ids of the training data, as a JSON file.

A PDM with a draft vocabulary predicts only those ids (a smaller lm_head: faster drafting and
training); positions where the target's argmax falls outside it are certain rejections, so the
file records the coverage of the scored tokens it was counted on. `spd train --draft-vocab FILE`
builds the PDM over it, and the PDM checkpoint carries the ids to the engine.

File format: {"ids": [sorted ids], "vocab_size": V, "coverage": c, "counted_tokens": N, ...};
a plain text file with one id per line (or comma-separated) is read as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def count_tokens(sequences, vocab_size: int, scored_only: bool = True) -> np.ndarray:
    """(V,) int64 counts over (ids, mask) sequences: scored tokens only, or every token."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in sequences:
        ids = np.asarray(ids, dtype=np.int64)
        if scored_only:
            ids = ids[np.asarray(mask, dtype=bool)]
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def top_ids(counts: np.ndarray, size: int, always=()) -> list[int]:
    """The `size` most frequent ids (ties: smaller id first), always including `always`; sorted."""
    if size < 1:
        raise ValueError(f"draft vocabulary size must be at least 1, got {size}")
    size = min(size, len(counts))
    keep = [int(i) for i in always if 0 <= int(i) < len(counts)]
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    chosen = set(keep)
    for i in order:
        if len(chosen) >= max(size, len(keep)):
            break
        chosen.add(int(i))
    return sorted(chosen)


def coverage(counts: np.ndarray, ids) -> float:
    total = int(counts.sum())
    return float(counts[list(ids)].sum()) / total if total else 0.0


def save_vocab(path, ids, counts: np.ndarray, **provenance) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"ids": sorted(int(i) for i in ids), "vocab_size": int(len(counts)),
            "coverage": coverage(counts, ids), "counted_tokens": int(counts.sum()), **provenance}
    path.write_text(json.dumps(data) + "\n")
    return path


def load_vocab(path, vocab_size: int | None = None) -> list[int]:
    """Sorted distinct ids from a vocab JSON (or a text file of ids); checked against vocab_size."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"draft vocabulary file {path} does not exist (make one with `spd vocab`)")
    text = path.read_text()
    try:
        data = json.loads(text)
        ids = data["ids"] if isinstance(data, dict) else data
        recorded = data.get("vocab_size") if isinstance(data, dict) else None
    except json.JSONDecodeError:
        ids, recorded = [int(x) for x in text.replace(",", " ").split()], None
    ids = sorted({int(i) for i in ids})
    if not ids:
        raise ValueError(f"draft vocabulary {path} is empty")
    if vocab_size is not None:
        if recorded is not None and recorded != vocab_size:
            raise ValueError(f"draft vocabulary {path} was made for a vocabulary of {recorded} tokens, "
                             f"the model has {vocab_size}")
        if ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"draft vocabulary {path} holds ids outside [0, {vocab_size})")
    return ids


def build_vocab(model: str, data, out, size: int, max_len: int = 2048, scored_only: bool = True
                ) -> dict:
    """`spd vocab`: count the training data's tokens with the model's tokenizer; write the top ids."""
    from .target import load_target
    from .train.data import cut, iter_records, record_example

    target, tokenizer = load_target(model)
    sequences = ((ex.ids, ex.mask) for ex in cut((record_example(r, tokenizer) for r in iter_records(data)), max_len))
    counts = count_tokens(sequences, target.vocab_size, scored_only)
    if counts.sum() == 0:
        raise ValueError("the data holds no tokens to count")
    ids = top_ids(counts, size, always=target.eos_token_ids)
    save_vocab(out, ids, counts, model=model, data=[str(d) for d in data], scored_only=scored_only)
    return {"out": str(out), "size": len(ids), "coverage": coverage(counts, ids),
            "counted_tokens": int(counts.sum()), "distinct_tokens": int((counts > 0).sum())}
