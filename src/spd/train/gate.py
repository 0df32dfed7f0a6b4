"""Fitting the hybrid drafter's gate (`spd.retrieval.Gate`) on training conversations.

The gate decides, per draft, between the retrieved token and the PDM's top-1 from the match
length L and the PDM's top-1 probability p. It only matters where the two disagree, so for each L
we look at the training positions where both exist and disagree, and pick the threshold t_L that
maximises right drafts: retrieval when p < t_L, else the PDM (t_L = 0: never retrieval; t_L > 1:
always, and the PDM forward is skipped). The positions come from the target's own greedy
continuations of training prompts (never the evaluation prompts), walked with the engine's
schedule by `spd.bench.acceptance.replay`, so the PDM sees exactly the features it sees when
decoding.

`spd gate --model M --pdm FOLDER --data chat.jsonl` writes the fitted gate beside the PDM
(`retrieval_gate.json`); checkpoints without one use `Gate()`'s documented defaults.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import typer
from tqdm import tqdm

from ..retrieval import Gate, SuffixIndex

log = logging.getLogger(__name__)


@dataclass
class GateRecord:
    match_len: int        # length of the retrieval match (>= 1)
    pdm_top1: float       # the PDM's top-1 probability
    retrieval_right: bool
    pdm_right: bool


class RecordingDrafter:
    """Drafts like the PDM alone and notes, per draft, what retrieval and the PDM proposed."""

    after_stages = False
    last_source = "pdm"

    def __init__(self, pdm, max_len: int):
        from ..drafters import PDMDrafter

        self.pdm_drafter, self.anchors = PDMDrafter(pdm), pdm.anchors
        self.index, self.max_len = SuffixIndex(max_len), max_len
        self.notes: list[tuple[int, int | None, int, int, float]] = []  # position, r, L, top1, p

    def begin(self, prompt_len: int) -> None:
        self.pdm_drafter.begin(prompt_len)
        self.index, self.notes = SuffixIndex(self.max_len), []

    def draft(self, state, params, gen):
        self.index.sync(state.tokens, state.first_inflight)
        retrieved, match_len = self.index.lookup()
        p, top1 = torch.softmax(self.pdm_drafter.logits(state), -1).max(-1)
        self.notes.append((state.newest + 1, retrieved, match_len, int(top1), float(p)))
        return int(top1), None


def gate_records(target, pdm, prompt_ids: list[int], continuation: list[int], max_len: int = 8
                 ) -> list[GateRecord]:
    """Disagreements between retrieval and the PDM along one greedy continuation."""
    from ..bench.acceptance import replay

    drafter = RecordingDrafter(pdm, max_len)
    replay(target, drafter, prompt_ids, continuation, pdm.config.n_stages)
    sequence = list(prompt_ids) + list(continuation)
    return [GateRecord(length, p, r == sequence[pos], top1 == sequence[pos])
            for pos, r, length, top1, p in drafter.notes if r is not None and r != top1]


def fit_gate(records: list[GateRecord], max_len: int = 8, min_count: int = 20, fitted_on: str = "") -> Gate:
    """Per match length, the threshold on the PDM's top-1 probability that maximises right drafts.

    Lengths with fewer than `min_count` disagreements take the threshold of the next shorter
    length (longer matches are at least as trustworthy); retrieval needs a match of at least the
    shortest length whose threshold is above 0."""
    thresholds = []
    for length in range(1, max_len + 1):
        sel = sorted((r for r in records if min(r.match_len, max_len) == length), key=lambda r: r.pdm_top1)
        if len(sel) < min_count:
            thresholds.append(thresholds[-1] if thresholds else 0.0)
            continue
        # retrieval for the first i records (lowest p), the PDM for the rest: right drafts for each i
        right = best = sum(r.pdm_right for r in sel)
        best_i = 0
        for i, r in enumerate(sel, start=1):
            right += r.retrieval_right - r.pdm_right
            if right > best and (i == len(sel) or sel[i].pdm_top1 > r.pdm_top1):
                best, best_i = right, i
        if best_i == 0:
            thresholds.append(0.0)
        elif best_i == len(sel):
            thresholds.append(1.01)   # retrieval whatever the PDM says: skip its forward
        else:
            thresholds.append((sel[best_i - 1].pdm_top1 + sel[best_i].pdm_top1) / 2)
    min_len = next((i + 1 for i, t in enumerate(thresholds) if t > 0), max_len)
    return Gate(min_len=min_len, max_len=max_len, threshold=[round(t, 4) for t in thresholds],
                fitted_on=fitted_on)


@torch.inference_mode()
def greedy_continuations(model_path: str, prompts: list[list[int]], max_new_tokens: int, eos,
                         batch: int = 16, pad_id: int = 0) -> list[list[int]]:
    """The target's greedy continuation of every prompt (batched `generate`, left padding),
    cut after the first EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))   # similar lengths together
    out: list[list[int] | None] = [None] * len(prompts)
    for start in tqdm(range(0, len(order), batch), desc="greedy continuations"):
        chunk = order[start:start + batch]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.tensor([[pad_id] * (width - len(prompts[i])) + prompts[i] for i in chunk])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk])
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id)
        for row, i in zip(gen[:, width:].tolist(), chunk):
            out[i] = row[:next((j + 1 for j, t in enumerate(row) if t in eos), len(row))]
    return out


def first_user_turns(path: Path, skip: int, count: int) -> list[str]:
    """User prompts of lines skip..skip+count of a chat JSONL file ({"messages": [...]})."""
    prompts = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < skip:
                continue
            if len(prompts) == count:
                break
            messages = json.loads(line).get("messages") or []
            user = next((m["content"] for m in messages if m.get("role") == "user"), None)
            if user:
                prompts.append(user)
    if not prompts:
        raise ValueError(f"{path} has no user turns after line {skip}: give a chat JSONL file with "
                         f'{{"messages": [{{"role": "user", ...}}]}} lines, or a smaller --skip')
    return prompts


def gate(
    model: str = typer.Option(..., help="The target: folder, hub id, or 'default'."),
    pdm: list[str] = typer.Option(..., help="PDM checkpoint folder; the fitted gate is saved into it "
                                  "(repeat for several PDMs of the same target: one set of continuations)."),
    data: Path = typer.Option(..., help="Chat JSONL of TRAINING conversations (never evaluation prompts)."),
    skip: int = typer.Option(0, help="Skip this many lines first (e.g. the ones the PDM trained on)."),
    prompts: int = typer.Option(160, min=1, help="Prompts to decode and fit on."),
    max_new_tokens: int = typer.Option(256, min=1, help="Greedy tokens per prompt."),
    max_len: int = typer.Option(8, min=1, help="Longest match length the gate tells apart."),
    min_count: int = typer.Option(20, min=1, help="Fewest disagreements to fit a length on its own."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    dry_run: bool = typer.Option(False, help="Print the gate without saving it."),
):
    """Fit the hybrid drafter's retrieval gate for a PDM on training conversations and save it
    beside the PDM (retrieval_gate.json). Prints the gate and its right-draft rate on the data."""
    from ..checkpoint import load_pdm
    from ..cli import fail
    from ..default_target import resolve_model_path
    from ..loading import encode_prompt
    from ..target import load_target

    if threads:
        torch.set_num_threads(threads)
    try:
        texts = first_user_turns(data, skip, prompts)
        target, tokenizer = load_target(model)
        nets = {Path(folder): load_pdm(folder, target) for folder in pdm}
    except (ValueError, OSError) as err:
        fail(str(err))
    ids = [encode_prompt(tokenizer, text) for text in texts]
    continuations = greedy_continuations(resolve_model_path(model), ids, max_new_tokens, set(target.eos_token_ids))
    for folder, net in nets.items():
        records = []
        for prompt, cont in tqdm(list(zip(ids, continuations)), desc=f"replaying {folder.name}"):
            records += gate_records(target, net, prompt, cont, max_len)
        fitted = fit_gate(records, max_len, min_count, fitted_on=f"{data.name} lines {skip}..{skip + len(texts) - 1}"
                          f" (greedy, {max_new_tokens} tokens), {len(records)} disagreements")
        gated = sum(r.retrieval_right if fitted.takes_retrieval(r.match_len, r.pdm_top1) else r.pdm_right
                    for r in records)
        typer.echo(f"{folder}: {json.dumps(fitted.__dict__)}")
        typer.echo(f"  where retrieval and the PDM disagree ({len(records)} drafts): PDM right "
                   f"{sum(r.pdm_right for r in records)}, retrieval right {sum(r.retrieval_right for r in records)}, "
                   f"gated right {gated}")
        if not dry_run:
            typer.echo(f"  saved {fitted.save(folder)}")
