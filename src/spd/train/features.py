"""The frozen target's pass over training batches, and an on-disk cache of its results.

`target_pass` runs a right-padded (B, S) batch through the target's own decoder layers (public
modules, no KV cache, causal mask) and keeps only the hidden states at the anchors asked for and
the pre-norm last hidden state h_L (teacher logits are lm_head(norm(h_L)), recomputed when
needed), never all L layers.

`FeatureStore` keeps those results for every sequence of a `TokenStore` in numpy memmaps
(float16 by default), together with the target's full-vocabulary argmax per position, so the
target runs once over the data and later epochs and other runs (other n, other anchors that
the cache covers) read features from disk instead. The embedding (anchor 0) is never stored:
looking it up again is cheaper than reading it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..pdm import TargetFingerprint
from ..target import Target, attention_mask
from .objective import full_argmax

log = logging.getLogger(__name__)

STORE_DTYPES = {"float16": np.float16, "float32": np.float32}


@torch.no_grad()
def target_pass(target: Target, ids: torch.Tensor, anchors) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """(B, S) ids -> ({anchor: (B, S, H)} for `anchors` (0 included if asked), (B, S, H) h_L).

    Rows past a sequence's end (right padding) hold garbage; real rows are exact, because
    padding only follows them and the mask is causal.
    """
    assert ids.dim() == 2, ids.shape
    wanted, last = set(anchors), target.num_layers
    S = ids.shape[1]
    hidden = target.embed(ids)   # with the family's embedding multiplier
    out = {0: hidden} if 0 in wanted else {}
    positions = torch.arange(S, device=ids.device)
    ropes = {}   # per layer kind where the family has one rotary embedding per kind (gemma3)
    sdpa = getattr(target.config, "_attn_implementation", None) == "sdpa"
    masks = {}
    for layer_idx in range(last):
        kind = target.kinds[layer_idx]
        rope_key = kind if target.family.rope_per_kind else None
        if rope_key not in ropes:
            ropes[rope_key] = target.rotary_emb(hidden, positions[None], layer_type=kind)
        window = target.layer_window(layer_idx)
        if window not in masks:  # sdpa without a mask runs its fused causal kernel
            masks[window] = None if sdpa and window is None else attention_mask(positions, S, hidden.dtype, window)
        mask = None if kind in ("linear_attention", "conv") else masks[window]   # recurrent: causal by nature
        hidden = target.layers[layer_idx](hidden, attention_mask=mask, position_ids=positions[None],
                                          position_embeddings=ropes[rope_key])
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if layer_idx + 1 in wanted:
            out[layer_idx + 1] = hidden
    return out, hidden


def _fingerprint(target: Target) -> dict:
    return asdict(TargetFingerprint.of(target))


class FeatureStore:
    """Anchor hidden states, h_L and the teacher argmax for every token of a TokenStore.

    Files: features.bin ((tokens, A, H) memmap; A = stored anchors, the last one is L),
    argmax.bin ((tokens,) int32; -1 at rows that are not scored), done.bin ((sequences,)
    uint8), meta.json.
    """

    def __init__(self, folder, tokens, meta: dict):
        self.folder, self.tokens, self.meta = Path(folder), tokens, meta
        self.anchors = list(meta["anchors"])
        self.column = {a: i for i, a in enumerate(self.anchors)}
        shape = (tokens.num_tokens, len(self.anchors), meta["hidden_size"])
        dtype = STORE_DTYPES[meta["dtype"]]
        mode = "r" if meta.get("complete") else "r+"
        self.features = np.memmap(self.folder / "features.bin", dtype=dtype, mode=mode, shape=shape)
        self.argmax = np.memmap(self.folder / "argmax.bin", dtype=np.int32, mode=mode, shape=(tokens.num_tokens,))
        self.done = np.memmap(self.folder / "done.bin", dtype=np.uint8, mode=mode, shape=(len(tokens),))

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    def covers(self, anchors) -> bool:
        return all(a == 0 or a in self.column for a in anchors)

    @classmethod
    def open_or_create(cls, folder, tokens, target: Target, anchors, dtype: str = "float16") -> "FeatureStore":
        """Open the store in `folder` (checking target and coverage) or create an empty one."""
        folder = Path(folder)
        stored = sorted({a for a in anchors if a != 0} | {target.num_layers})
        meta_path = folder / "meta.json"
        want = {"target": _fingerprint(target), "tokens": tokens.meta["content"]}
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
        if meta is not None and meta.get("target") != want["target"]:
            raise ValueError(f"feature cache {folder} belongs to another target ({meta.get('target')}); "
                             f"use another --cache folder")
        # keyed on the token ids themselves, so moving or copying the data keeps the cache; a cache
        # for other tokens is hours of target forwards: refuse rather than overwrite it
        if meta is not None and meta.get("tokens") != want["tokens"]:
            raise ValueError(f"feature cache {folder} holds features of other token data (tokens "
                             f"{meta.get('tokens')}, this data's {want['tokens']}): the data, --max-len or "
                             f"--pack changed. Use another --cache folder, or delete {folder} to rebuild it")
        if meta is not None:
            store = cls(folder, tokens, meta)
            if not store.covers(stored):
                raise ValueError(
                    f"feature cache {folder} holds anchors {store.anchors}, this run needs {stored}. "
                    f"Use another --cache folder, or build this one with --cache-anchors listing "
                    f"every anchor of every run (e.g. {','.join(map(str, sorted(set(stored) | set(store.anchors))))})")
            return store
        if dtype not in STORE_DTYPES:
            raise ValueError(f"cache dtype must be one of {', '.join(STORE_DTYPES)}; got {dtype!r}")
        folder.mkdir(parents=True, exist_ok=True)
        meta = {**want, "anchors": stored, "hidden_size": target.hidden_size, "dtype": dtype, "complete": False}
        shape = (tokens.num_tokens, len(stored), target.hidden_size)
        nbytes = int(np.prod(shape)) * np.dtype(STORE_DTYPES[dtype]).itemsize
        log.info("feature cache %s: %d tokens x anchors %s -> %.2f GB", folder, tokens.num_tokens, stored, nbytes / 1e9)
        for name, size in (("features.bin", nbytes), ("argmax.bin", 4 * tokens.num_tokens), ("done.bin", len(tokens))):
            with open(folder / name, "wb") as fh:
                fh.truncate(size)
        meta_path.write_text(json.dumps(meta, indent=1))
        return cls(folder, tokens, meta)

    def build(self, target: Target, batch_tokens: int = 8192, progress: bool = True) -> None:
        """Run the target over every sequence not yet done (resumable), then mark complete."""
        if self.complete:
            return
        todo = [i for i in np.flatnonzero(self.done == 0)]
        todo.sort(key=lambda i: self.tokens.length(i))  # similar lengths together: little padding
        batches, batch = [], []
        for i in todo:
            if batch and (len(batch) + 1) * self.tokens.length(i) > batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
        total = sum(self.tokens.length(i) for i in todo)
        bar = _progress(total, "target features", progress)
        t0, done_tokens = time.perf_counter(), 0
        for k, batch in enumerate(batches):
            ids, lengths = self.tokens.padded(batch, device=target.device)
            snaps, last = target_pass(target, ids, self.anchors[:-1])
            snaps[target.num_layers] = last
            stacked = torch.stack([snaps[a] for a in self.anchors], dim=2).float().cpu().numpy()
            scored = self.tokens.scored(batch, ids.shape[1]).to(ids.device)  # only those are read
            argmax = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
            argmax[scored] = full_argmax(target, last[scored])
            argmax = argmax.cpu().numpy()
            if self.meta["dtype"] == "float16" and np.abs(stacked).max() > 65000:
                raise ValueError("target hidden states overflow float16; rebuild the cache with --cache-dtype float32")
            for row, i in enumerate(batch):
                start, n = self.tokens.offset(i), lengths[row]
                self.features[start:start + n] = stacked[row, :n]
                self.argmax[start:start + n] = argmax[row, :n]
            self.done[batch] = 1
            done_tokens += int(sum(lengths))
            bar.update(int(sum(lengths)))
            bar.set_postfix(tok_s=f"{done_tokens / (time.perf_counter() - t0):.0f}")
            if k % 20 == 19:
                self._flush()
        bar.close()
        self._flush()
        self.meta["complete"] = True
        self.meta["pass_dtype"] = str(target.dtype).removeprefix("torch.")   # provenance: the pass's precision
        (self.folder / "meta.json").write_text(json.dumps(self.meta, indent=1))
        log.info("feature cache complete: %d tokens in %.0fs", done_tokens, time.perf_counter() - t0)

    def _flush(self) -> None:
        self.features.flush()
        self.argmax.flush()
        self.done.flush()

    def read(self, index: int, anchors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One sequence: ((len, len(anchors without 0), H), (len, H) h_L, (len,) argmax)."""
        start, n = self.tokens.offset(index), self.tokens.length(index)
        cols = [self.column[a] for a in anchors if a != 0]
        block = self.features[start:start + n]
        return block[:, cols], block[:, -1], self.argmax[start:start + n]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm  # progress bars for long work (core dependency)
    return tqdm(total=total, desc=desc, unit="tok", disable=not enabled, dynamic_ncols=True)


@dataclass
class Batch:
    """One training batch at the PDM's anchors; teacher parts only for the scored rows."""

    features: torch.Tensor   # (B, S, m, H) hidden states at the PDM's anchors
    score: torch.Tensor      # (B, S) bool: row t predicts a token that counts
    last: torch.Tensor       # (N, H) pre-norm h_L of the scored rows (teacher logits from it)
    argmax: torch.Tensor     # (N,) the target's full-vocabulary argmax at the scored rows
    tokens: int              # real (unpadded) tokens in the batch


class BatchLoader:
    """Sequence indices -> Batch, from the feature cache when given, else by running the target."""

    def __init__(self, target: Target, tokens, anchors, store: FeatureStore | None = None,
                 dtype=torch.float32):
        self.target, self.tokens, self.anchors, self.store, self.dtype = target, tokens, list(anchors), store, dtype
        if store is not None and not (store.complete and store.covers(self.anchors)):
            raise ValueError("the feature cache is incomplete or does not cover the PDM's anchors")

    def __call__(self, indices) -> Batch:
        device = self.target.device
        ids, lengths = self.tokens.padded(indices, device=device)
        score = self.tokens.scored(indices, ids.shape[1]).to(device)
        if self.store is None:
            snaps, last = target_pass(self.target, ids, self.anchors)
            features = torch.stack([snaps[a] for a in self.anchors], dim=2)
            last = last[score]
            argmax = full_argmax(self.target, last)
        else:
            features, last, argmax = self._from_store(indices, ids, lengths, score)
        return Batch(features.to(self.dtype), score, last, argmax, int(sum(lengths)))

    @torch.no_grad()
    def _from_store(self, indices, ids, lengths, score):
        B, S = ids.shape
        deeper = [a for a in self.anchors if a != 0]
        stored = np.zeros((B, S, len(deeper), self.target.hidden_size), dtype=np.float32)
        last = np.zeros((B, S, self.target.hidden_size), dtype=np.float32)
        argmax = np.zeros((B, S), dtype=np.int64)
        for row, i in enumerate(indices):
            feats, h_last, top = self.store.read(i, deeper)
            stored[row, :lengths[row]], last[row, :lengths[row]], argmax[row, :lengths[row]] = feats, h_last, top
        device = self.target.device
        parts = torch.from_numpy(stored).to(device)
        if 0 in self.anchors:  # the embedding is looked up, not stored
            embed = self.target.embed(ids).float()[:, :, None]
            parts = torch.cat([embed, parts], dim=2)
        last = torch.from_numpy(last).to(device)[score]
        return parts, last.to(self.target.dtype), torch.from_numpy(argmax).to(device)[score]
