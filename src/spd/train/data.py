"""Training data: local files -> token sequences with a loss mask, stored on disk, in batches.

Readers stream records from plain text (one document per blank-line-separated paragraph),
JSONL (`text`, chat `messages`, or pre-tokenized `input_ids` with an optional `loss_mask`) and
Parquet (the same columns). Chat records are rendered with the target tokenizer's chat
template and only assistant tokens are scored; `regenerate` optionally replaces every
assistant turn with the target's own answer first, so the PDM learns the target's distribution.

Sequences longer than `max_len` are cut into pieces (or, with `pack`, all documents are
concatenated and cut into rows of exactly `max_len`). The `TokenStore` writes them as it reads
(flat int32 ids + uint8 mask + offsets), so nothing is held in memory but the lengths, and
`plan_batches` groups sequences of similar length (bucketing) into batches of at most
`batch_tokens` padded tokens, in an order fixed by (seed, epoch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


class DataError(ValueError):
    pass


@dataclass
class Example:
    ids: list[int]
    mask: list[bool]     # mask[t]: token t counts in the loss (the PDM predicts it from t-1)


def check_files(paths) -> list[Path]:
    """The data files, checked: they exist and have a known format."""
    out = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} does not exist")
        if not path.name.lower().endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES):
            raise DataError(f"data file {path}: unknown format; use .txt/.md (plain text), "
                            f".jsonl (text / messages / input_ids) or .parquet")
        out.append(path)
    if not out:
        raise DataError("no data files given")
    return out


def iter_records(paths) -> Iterator[dict]:
    """Stream records {"text"| "messages" | "input_ids"[, "loss_mask"]} from the files."""
    for path in check_files(paths):
        name = path.name.lower()
        if name.endswith(TEXT_SUFFIXES):
            yield from _text_records(path)
        elif name.endswith(JSONL_SUFFIXES):
            with open(path, encoding="utf-8") as fh:
                for line_no, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as err:
                            raise DataError(f"{path}:{line_no}: not valid JSON ({err})") from None
        else:
            yield from _parquet_records(path)


def _text_records(path: Path) -> Iterator[dict]:
    paragraph = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield {"text": "".join(paragraph).rstrip("\n")}
                paragraph = []
    if paragraph:
        yield {"text": "".join(paragraph).rstrip("\n")}


def _parquet_records(path: Path) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq  # Parquet training data (optional extra `spd[train]`)
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install 'spd[train]'") from None
    source = pq.ParquetFile(path)
    columns = [c for c in ("text", "messages", "input_ids", "loss_mask") if c in source.schema_arrow.names]
    if not columns:
        raise DataError(f"{path} has none of the columns text, messages, input_ids")
    for batch in source.iter_batches(batch_size=256, columns=columns):
        yield from batch.to_pylist()


# ----- records -> examples ------------------------------------------------------------------

def chat_example(messages: list[dict], tokenizer) -> Example:
    """Render a conversation with the chat template; score only the assistant turns' tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat data (`messages`) needs a tokenizer with a chat template, and this "
                        "model has none; give `text` or `input_ids` records instead")
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tokenize=False, add_generation_prompt=gen)
    text = render(messages)
    spans = []  # character spans of the assistant turns in `text`
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            before, upto = render(messages[:i], True), render(messages[:i + 1])
            if not (text.startswith(upto) and upto.startswith(before)):
                raise DataError("the chat template does not render conversations prefix by prefix, so "
                                "the assistant turns cannot be located; give pre-tokenized input_ids "
                                "with a loss_mask instead")
            spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(s <= a and b <= e and b > a for s, e in spans) for a, b in enc["offset_mapping"]]
    return Example(list(enc["input_ids"]), mask)


def record_example(record: dict, tokenizer) -> Example:
    """One record -> Example. `input_ids` (+ optional `loss_mask`), `messages`, or `text`."""
    if record.get("input_ids") is not None:
        ids = [int(x) for x in record["input_ids"]]
        mask = record.get("loss_mask")
        mask = [bool(x) for x in mask] if mask is not None else [True] * len(ids)
        if len(mask) != len(ids):
            raise DataError(f"loss_mask has {len(mask)} entries for {len(ids)} input_ids")
        return Example(ids, mask)
    if tokenizer is None:
        raise DataError("this model folder has no tokenizer: give pre-tokenized `input_ids` records")
    if record.get("messages") is not None:
        return chat_example(record["messages"], tokenizer)
    if record.get("text") is not None:
        ids = tokenizer(record["text"])["input_ids"]
        return Example(list(ids), [True] * len(ids))
    raise DataError(f"record has none of input_ids, messages, text: keys {sorted(record)}")


def regenerate(messages: list[dict], target, tokenizer, params, max_new_tokens: int) -> list[dict]:
    """The conversation with every assistant turn replaced by the target's own answer."""
    from ..baselines.ar import ar_generate

    out = []
    for message in messages:
        if message.get("role") == "assistant":
            prompt = tokenizer.apply_chat_template(out, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer, _ = ar_generate(target, ids, params, max_new_tokens)
            message = {**message, "content": tokenizer.decode(answer, skip_special_tokens=True)}
        out.append(message)
    return out


def cut(examples: Iterator[Example], max_len: int, pack: bool = False) -> Iterator[Example]:
    """Pieces of at most max_len tokens (packing: all documents joined, rows of exactly max_len)."""
    if max_len < 2:
        raise DataError(f"max length must be at least 2 (one token and the next), got {max_len}")
    if not pack:
        for ex in examples:
            for s in range(0, len(ex.ids), max_len):
                yield Example(ex.ids[s:s + max_len], ex.mask[s:s + max_len])
        return
    ids, mask = [], []
    for ex in examples:
        ids += ex.ids
        mask += ex.mask
        while len(ids) >= max_len:
            yield Example(ids[:max_len], mask[:max_len])
            ids, mask = ids[max_len:], mask[max_len:]
    if ids:
        yield Example(ids, mask)


# ----- the on-disk token store --------------------------------------------------------------

def data_fingerprint(paths, options: dict) -> str:
    """Hash of the files' bytes (in order) and the tokenisation options: a copied, moved or
    touched file keeps its token store; an edited one rebuilds it."""
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for path in check_files(paths):
        with open(path, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()[:16]


def tokens_digest(folder) -> str:
    """Hash of a token store's ids, mask and offsets: what the feature cache depends on."""
    h = hashlib.sha256()
    for name in ("ids.bin", "mask.bin", "offsets.npy"):
        with open(Path(folder) / name, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()[:16]


class TokenStore:
    """Token sequences on disk: ids.bin (int32), mask.bin (uint8), offsets.npy, meta.json."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.offsets = np.load(self.folder / "offsets.npy")
        n = int(self.offsets[-1])
        self.ids = np.memmap(self.folder / "ids.bin", dtype=np.int32, mode="r", shape=(n,)) if n else np.zeros(0, np.int32)
        self.mask = np.memmap(self.folder / "mask.bin", dtype=np.uint8, mode="r", shape=(n,)) if n else np.zeros(0, np.uint8)
        self.lengths = np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def offset(self, i: int) -> int:
        return int(self.offsets[i])

    def length(self, i: int) -> int:
        return int(self.lengths[i])

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.offsets[i], self.offsets[i + 1]
        return self.ids[s:e], self.mask[s:e]

    def padded(self, indices, device=None) -> tuple[torch.Tensor, list[int]]:
        """(B, S_max) right-padded ids (pad = 0) and the lengths."""
        lengths = [self.length(i) for i in indices]
        ids = np.zeros((len(indices), max(lengths)), dtype=np.int64)
        for row, i in enumerate(indices):
            ids[row, :lengths[row]] = self.sequence(i)[0]
        return torch.from_numpy(ids).to(device), lengths

    def scored(self, indices, width: int) -> torch.Tensor:
        """(B, width) bool: row t is scored iff token t+1 exists and counts in the loss."""
        out = np.zeros((len(indices), width), dtype=bool)
        for row, i in enumerate(indices):
            mask = self.sequence(i)[1]
            out[row, :len(mask) - 1] = mask[1:] > 0
        return torch.from_numpy(out)

    @classmethod
    def build(cls, folder, examples: Iterator[Example], fingerprint: str, vocab_size: int,
              options: dict) -> "TokenStore":
        """Write examples as they come (sequences with nothing to score are skipped)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        offsets, total, skipped = [0], 0, 0
        with open(folder / "ids.bin.tmp", "wb") as f_ids, open(folder / "mask.bin.tmp", "wb") as f_mask:
            for ex in examples:
                if len(ex.ids) < 2 or not any(ex.mask[1:]):
                    skipped += 1
                    continue
                ids = np.asarray(ex.ids, dtype=np.int64)
                if ids.min() < 0 or ids.max() >= vocab_size:
                    raise DataError(f"token id {int(ids.max()) if ids.max() >= vocab_size else int(ids.min())} "
                                    f"outside the model's vocabulary [0, {vocab_size})")
                f_ids.write(ids.astype(np.int32).tobytes())
                f_mask.write(np.asarray(ex.mask, dtype=np.uint8).tobytes())
                total += len(ids)
                offsets.append(total)
        if total == 0:
            raise DataError(f"the data holds no sequence with a scored token ({skipped} records, "
                            f"all empty, single-token, or without assistant tokens)")
        os.replace(folder / "ids.bin.tmp", folder / "ids.bin")
        os.replace(folder / "mask.bin.tmp", folder / "mask.bin")
        np.save(folder / "offsets.npy", np.asarray(offsets, dtype=np.int64))
        meta = {"fingerprint": fingerprint, "content": tokens_digest(folder), "sequences": len(offsets) - 1,
                "tokens": total, "scored_tokens": None, "skipped": skipped, "options": options}
        store_mask = np.memmap(folder / "mask.bin", dtype=np.uint8, mode="r", shape=(total,))
        meta["scored_tokens"] = int(store_mask.sum())
        (folder / "meta.json").write_text(json.dumps(meta, indent=1))
        log.info("token store %s: %d sequences, %d tokens (%d scored), %d skipped",
                 folder, meta["sequences"], total, meta["scored_tokens"], skipped)
        return cls(folder)


def open_token_store(folder, paths, tokenizer, vocab_size: int, max_len: int, pack: bool = False,
                     regen=None) -> TokenStore:
    """The token store for these files and options in `folder`, built if absent or stale.

    regen: None, or (target, SamplingParams, max_new_tokens) to regenerate assistant turns.
    """
    if max_len < 2:
        raise DataError(f"max length must be at least 2 (one token and the next), got {max_len}")
    options = {"max_len": max_len, "pack": pack,
               "regenerate": None if regen is None else [repr(regen[1]), regen[2]],
               "tokenizer": getattr(tokenizer, "name_or_path", None)}
    fingerprint = data_fingerprint(paths, options)
    folder = Path(folder)
    if (folder / "meta.json").is_file():
        store = TokenStore(folder)
        if store.meta["fingerprint"] == fingerprint:
            return store
        log.info("token store %s is stale (other data or options): rebuilding", folder)

    def examples():
        for record in iter_records(paths):
            if regen is not None and record.get("messages") is not None:
                target, params, max_new = regen
                record = {**record, "messages": regenerate(record["messages"], target, tokenizer, params, max_new)}
            yield record_example(record, tokenizer)

    return TokenStore.build(folder, cut(examples(), max_len, pack), fingerprint, vocab_size, options)


# ----- batches ------------------------------------------------------------------------------

def split_eval(lengths: np.ndarray, fraction: float, seed: int, eval_head: int = 0,
               train_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, eval indices) of the sequences with these lengths.

    Held out: a fixed random `fraction`, at least one if > 0; or, with `eval_head` K, the first K
    sequences (a split that stays the same while data is appended behind it). `train_tokens`
    keeps the leading training sequences (in data order) up to that many tokens: runs on
    growing shares of one token store and feature cache, against one held-out set."""
    n_sequences = len(lengths)
    if eval_head:
        if eval_head >= n_sequences:
            raise DataError(f"--eval-head {eval_head} leaves no training data ({n_sequences} sequences)")
        train, held = np.arange(eval_head, n_sequences), np.arange(eval_head)
    else:
        order = np.random.default_rng(seed).permutation(n_sequences)
        n_eval = 0 if fraction <= 0 else max(1, int(round(fraction * n_sequences)))
        if n_eval >= n_sequences:
            raise DataError(f"eval fraction {fraction} leaves no training data ({n_sequences} sequences)")
        train, held = np.sort(order[n_eval:]), np.sort(order[:n_eval])
    if train_tokens is not None:
        upto = np.cumsum(np.asarray(lengths)[train])
        if train_tokens < upto[0]:
            raise DataError(f"--train-tokens {train_tokens} is less than the first training sequence ({upto[0]} tokens)")
        train = train[:int(np.searchsorted(upto, train_tokens, side="right"))]
    return train, held


def plan_batches(indices: np.ndarray, lengths: np.ndarray, batch_tokens: int, seed: int | None,
                 pool: int = 64) -> list[list[int]]:
    """Batches of similar-length sequences, at most batch_tokens padded tokens each (bucketing).

    seed None: in order of length, no shuffling (eval). Otherwise shuffled, then sorted by
    length within pools of `pool` batches' worth, and the batches shuffled again.
    """
    indices = np.asarray(indices)
    rng = np.random.default_rng(seed) if seed is not None else None
    order = rng.permutation(indices) if rng is not None else indices[np.argsort(lengths[indices], kind="stable")]
    batches = []
    approx = max(1, batch_tokens // max(1, int(np.mean(lengths[indices])) if len(indices) else 1))
    step = approx * pool if rng is not None else len(order)
    for s in range(0, len(order), max(1, step)):
        chunk = order[s:s + step]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batch, longest = [], 0
        for i in chunk:
            longest_if = max(longest, int(lengths[i]))
            if batch and longest_if * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch, longest_if = [], int(lengths[i])
            batch.append(int(i))
            longest = longest_if
        if batch:
            batches.append(batch)
    if rng is not None:
        batches = [batches[k] for k in rng.permutation(len(batches))]
    return batches


def locate_batch(g: int, epoch_length: Callable[[int], int]) -> tuple[int, int]:
    """(epoch, k): the run's micro-batch g is batch k of that epoch's plan, epochs one after another.

    Each epoch is reshuffled before bucketing, so epochs hold slightly different numbers of
    batches and g // len(epoch 0) is not the epoch (it ran past a shorter epoch's end)."""
    epoch = 0
    while g >= (length := epoch_length(epoch)):
        g, epoch = g - length, epoch + 1
    return epoch, g
