"""What the baseline draft heads (EAGLE-style, PPSD) share: draft vocabulary and checkpoints.

A head checkpoint is a folder with `head.safetensors` and `head_config.json`; the JSON names the
method ("eagle" or "ppsd"), the head's config and the target fingerprint, so loading a head onto
another target fails with the field that differs instead of a shape error inside torch. A head
whose lm_head rows are still the target's (frozen in training, the default) may leave them out
(`"lm_head": "target"`): loading copies them from the target again, so a shipped head is ~half
the size. `load_head` (load.py, above eagle.py and ppsd.py) builds a head of whichever method.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..pdm import TargetFingerprint
from ..sampling import SamplingParams, draw, probs
from ..target import Target

WEIGHTS, CONFIG = "head.safetensors", "head_config.json"


class HeadCheckpointError(ValueError):
    pass


class DraftVocabHead(nn.Module):
    """An lm_head over a sorted subset of the target vocabulary (or all of it), ids mapped back."""

    def __init__(self, hidden: int, target_vocab: int, draft_vocab: int | None):
        super().__init__()
        vocab = draft_vocab or target_vocab
        self.target_vocab, self.subset = target_vocab, draft_vocab is not None
        self.proj = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("draft_ids", torch.arange(vocab), persistent=True)

    def init_from(self, target: Target, draft_ids: list[int] | None) -> None:
        """Copy the target lm_head's rows (of the draft vocabulary when one is given)."""
        with torch.no_grad():
            if draft_ids is not None:
                ids = torch.tensor(sorted(set(draft_ids)), dtype=torch.long)
                if len(ids) != len(draft_ids) or ids[0] < 0 or ids[-1] >= target.vocab_size:
                    raise ValueError("draft vocabulary must hold distinct ids in [0, vocab_size)")
                self.draft_ids.copy_(ids)
            self.proj.weight.copy_(target.lm_head.weight[self.draft_ids.to(target.lm_head.weight.device)])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) normed hidden -> (..., V) float32 logits, -inf outside the draft vocabulary."""
        logits = self.proj(hidden).float()
        if not self.subset:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, logits)


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """A draft from (V,) full-vocabulary logits: (argmax, None) greedy, else (x ~ q, q)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = probs(logits, params)
    return draw(q, gen), q


def check_target(fingerprint: TargetFingerprint, target: Target, where: str) -> None:
    have = asdict(TargetFingerprint.of(target))
    for name, want in asdict(fingerprint).items():
        if have[name] != want:
            raise HeadCheckpointError(
                f"{where} was made for a target with {name}={want!r}, but the loaded model has "
                f"{name}={have[name]!r}. Load the model it was trained for, or train a head for "
                f"this model (spd.baselines.train_heads).")


LM_HEAD = "lm_head.proj.weight"


def save_head(head: nn.Module, folder, dtype: torch.dtype | None = None, target: Target | None = None) -> Path:
    """Write a head's weights (cast to `dtype` if given) and {"method", "config"} JSON. With the
    `target`, lm_head rows equal to the target's own are not written (loading restores them)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    from_target = target is not None and torch.equal(
        state[LM_HEAD], target.lm_head.weight[head.lm_head.draft_ids.to(target.device)].to(state[LM_HEAD]))
    if from_target:
        del state[LM_HEAD]
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(folder / WEIGHTS))
    meta = {"method": head.METHOD, "config": head.config.to_json(), **({"lm_head": "target"} if from_target else {})}
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def read_head_meta(folder) -> dict:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a draft-head checkpoint: {CONFIG} is missing")
    return json.loads(path.read_text())


def read_head_config(folder) -> tuple[str, dict]:
    meta = read_head_meta(folder)
    return meta["method"], meta["config"]
