"""Fitting the hybrid drafter's gate (`spd.retrieval.Gate`) on training conversations.

The gate decides, per draft, between the retrieved token and the PDM's top-1 from the match
length L and the PDM's top-1 probability p. It only matters where the two disagree, so for each L
we look at the training positions where both exist and disagree, and pick the threshold t_L that
maximises right drafts: retrieval when p < t_L, else the PDM (t_L = 0: never retrieval; t_L > 1:
always, and the PDM forward is skipped). The positions come from the target's own greedy
next tokens along training conversations (never the evaluation prompts): one target forward
gives the features of every position and the token the target would emit after each prefix,
and the PDM drafts each position from the saturated pipeline's features, as when decoding.

`spd gate --model M --pdm FOLDER --data chat.jsonl` writes the fitted gate beside the PDM
(`retrieval_gate.json`); checkpoints without one use `Gate()`'s documented defaults.

Greedy decoding can also follow each sequence (`Gate.adapt`): every record carries retrieval's lead
over the PDM at the conversation's earlier disagreements already verified behind the pipeline, and
`spd gate` fits the weight on it (ADAPT_GRID) with the thresholds.

Sampling gets thresholds of its own, fitted the same way at `--temperature` (default 1), with
expected acceptances in place of right drafts: p(retrieved token) for the retrieved point mass,
sum_x min(p, q) for the PDM's sampled draft (p, q processed at that temperature, as verification
sees them). Their positions are the target's OWN answers to the training prompts, sampled at that
temperature (`--own-answers`): a dataset's answers repeat earlier text more than the model's own
samples do, so a fit on them takes retrieval too often when sampling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import typer
from tqdm import tqdm

from ..console import fail
from ..retrieval import Disputes, Gate, SuffixIndex, retrieval_prior


@dataclass
class GateRecord:
    match_len: int        # length of the retrieval match (>= 1)
    pdm_top1: float       # the PDM's top-1 probability
    retrieval_right: bool
    pdm_right: bool
    agree: bool = False   # retrieval == the PDM's top-1 (no choice to make: the fit skips these)
    retrieval_p: float = 0.0   # sampling: the chance the retrieved token is accepted, p(token)
    pdm_overlap: float = 0.0   # sampling: the chance the PDM's sampled draft is, sum_x min(p, q)
    lead: float = 0.0          # retrieval's lead over the PDM at the conversation's finished disagreements


ADAPT_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)   # the greedy gate's adaptation weights `spd gate` tries


@torch.inference_mode()
def gate_records(target, pdm, prompt_ids: list[int], answer_ids: list[int], max_len: int = 8,
                 temperature: float = 0.0) -> list[GateRecord]:
    """Every retrieval match along one training conversation, and whether the PDM agreed.

    One target forward over prompt + answer gives the anchor features of every position and the
    target's own next token after each prefix (what verification would accept). Each answer
    position is then drafted as in the saturated pipeline (n in flight), as the engine would
    draft it after that prefix. With `temperature` > 0 also the sampled acceptances (see GateRecord)."""
    from ..bench.acceptance import sequence_features
    from ..drafters import DraftState, PDMDrafter
    from ..sampling import SamplingParams, probs

    n, sequence = pdm.config.n_stages, list(prompt_ids) + list(answer_ids)
    features, last_hidden = sequence_features(target, sequence, pdm.anchors)
    logits = target.logits(last_hidden)
    target_next = logits.argmax(-1).tolist()   # target's token after each prefix
    params = SamplingParams(temperature=temperature)
    p = probs(logits, params) if temperature > 0 else None   # (S, V) the target's law after each prefix
    drafter, index = PDMDrafter(pdm), SuffixIndex(max_len)
    drafter.begin(len(prompt_ids))
    records, disputes = [], Disputes()   # the hybrid's own bookkeeping: the same lead as when decoding
    for t in range(len(prompt_ids), len(sequence) - 1):
        state = DraftState(sequence[:t + 1], max(len(prompt_ids), t - n + 1), n, features)
        index.sync(state.tokens, t)
        retrieved, length = index.lookup()
        if retrieved is None:
            continue
        pdm_logits = drafter.logits(state)
        top1_p, top1 = torch.softmax(pdm_logits, -1).max(-1)
        record = GateRecord(length, float(top1_p), retrieved == target_next[t], int(top1) == target_next[t],
                            agree=retrieved == int(top1),
                            lead=disputes.lead(t + 1, state.first_inflight, lambda p: target_next[p - 1]))
        if not record.agree:
            disputes.add(t + 1, retrieved, int(top1))
        if p is not None:
            record.retrieval_p = float(p[t, retrieved])
            record.pdm_overlap = float(torch.minimum(p[t], probs(pdm_logits, params)).sum())
        records.append(record)
    return records


def fit_gate(records: list[GateRecord], max_len: int = 8, min_count: int = 20, fitted_on: str = "",
             temperature: float = 0.0, sampled_records: list[GateRecord] | None = None,
             adapt: float | None = 0.0) -> Gate:
    """Per match length, where retrieval and the PDM's top-1 disagree: the threshold on the PDM's
    top-1 probability that maximises right drafts, and how often the retrieved token was right
    (the score a token tree gives a retrieved candidate beside the PDM's own); with `temperature`
    > 0 also the sampled thresholds, maximising the expected accepted drafts (over
    `sampled_records` when given: positions of the target's own sampled answers).

    `adapt`: the greedy thresholds' weight on each sequence's lead (`Gate.adapt`); None fits it too,
    the weight of ADAPT_GRID whose thresholds get the most drafts right (ties: the smaller).

    Lengths with fewer than `min_count` records take the threshold (accuracy) of the next shorter
    length (longer matches are at least as trustworthy); retrieval needs a match of at least the
    shortest length whose threshold is above 0 (above -adapt when adapting)."""
    by_length = _disagreements(records, max_len)
    accuracy = []
    for length, sel in enumerate(by_length, start=1):
        if len(sel) < min_count:
            accuracy.append(accuracy[-1] if accuracy else retrieval_prior(length))
        else:
            accuracy.append(round(sum(r.retrieval_right for r in sel) / len(sel), 4))
    fits = []
    for weight in ADAPT_GRID if adapt is None else (adapt,):
        shifted = [sorted((replace(r, pdm_top1=r.pdm_top1 - weight * r.lead) for r in sel), key=lambda r: r.pdm_top1)
                   for sel in by_length]
        min_len, thresholds = _thresholds(shifted, min_count, lambda r: r.retrieval_right, lambda r: r.pdm_right, weight)
        candidate = Gate(min_len=min_len, max_len=max_len, threshold=thresholds, adapt=weight)
        right = sum(r.retrieval_right if candidate.takes_retrieval(r.match_len, r.pdm_top1, lead=r.lead) else r.pdm_right
                    for sel in by_length for r in sel)
        fits.append((right, weight, min_len, thresholds))
    _, weight, min_len, thresholds = max(fits, key=lambda fit: (fit[0], -fit[1]))   # ties: the smaller weight
    sampled = {}
    if temperature > 0:
        sampled_by_length = by_length if sampled_records is None else _disagreements(sampled_records, max_len)
        sampled_min_len, sampled_thresholds = _thresholds(sampled_by_length, min_count, lambda r: r.retrieval_p,
                                                          lambda r: r.pdm_overlap)
        sampled = dict(sampled_min_len=sampled_min_len, sampled_threshold=sampled_thresholds,
                       sampled_temperature=temperature)
    return Gate(min_len=min_len, max_len=max_len, threshold=thresholds, fitted_on=fitted_on, accuracy=accuracy,
                adapt=weight, **sampled)


def _disagreements(records: list[GateRecord], max_len: int) -> list[list[GateRecord]]:
    """Per match length 1..max_len, the records where retrieval and the PDM disagree, by PDM top-1."""
    return [sorted((r for r in records if min(r.match_len, max_len) == length and not r.agree),
                   key=lambda r: r.pdm_top1) for length in range(1, max_len + 1)]


def own_answers(target, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int = 0
                ) -> list[list[int]]:
    """The target's own answers to `prompts`, sampled at `temperature` (seed + i for prompt i)."""
    from ..baselines.ar import ar_generate
    from ..sampling import SamplingParams

    return [ar_generate(target, prompt, SamplingParams(temperature=temperature, seed=seed + i), max_new_tokens)[0]
            for i, prompt in enumerate(tqdm(prompts, desc=f"sampling own answers at T={temperature:g}"))]


def _thresholds(by_length: list[list[GateRecord]], min_count: int, retrieval_value, pdm_value, shift: float = 0.0
                ) -> tuple[int, list[float]]:
    """(min_len, a threshold per length): retrieval below the threshold, the PDM above, chosen to
    maximise the summed value of the drafts taken (records sorted by the PDM's top-1, which is
    lowered by up to `shift` when adapting: "never" is then below -shift, "always" above 1 + shift)."""
    never, always = (-round(shift + 0.01, 4) if shift else 0.0), round(1.01 + shift, 4)
    thresholds = []
    for sel in by_length:
        if len(sel) < min_count:
            thresholds.append(thresholds[-1] if thresholds else never)
            continue
        # retrieval for the first i records (lowest p), the PDM for the rest: the value for each i
        value = best = sum(pdm_value(r) for r in sel)
        best_i = 0
        for i, r in enumerate(sel, start=1):
            value += retrieval_value(r) - pdm_value(r)
            if value > best + 1e-9 and (i == len(sel) or sel[i].pdm_top1 > r.pdm_top1):
                best, best_i = value, i
        if best_i == 0:
            thresholds.append(never)
        elif best_i == len(sel):
            thresholds.append(always)   # retrieval whatever the PDM says: skip its forward
        else:
            low, high = sel[best_i - 1].pdm_top1, sel[best_i].pdm_top1
            cut = round((low + high) / 2, 4)
            thresholds.append(cut if low < cut <= high else (low + high) / 2)   # rounding must not cross a record
    min_len = next((i + 1 for i, t in enumerate(thresholds) if t > never), len(thresholds))
    return min_len, thresholds


def conversations(path: Path, skip: int, count: int) -> list[list[dict]]:
    """Messages of lines skip..skip+count of a chat JSONL file ({"messages": [...]}) that hold a
    user turn followed by an assistant turn (the first two turns are used)."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < skip:
                continue
            if len(out) == count:
                break
            messages = json.loads(line).get("messages") or []
            roles = [m.get("role") for m in messages[:2]]
            if roles == ["user", "assistant"]:
                out.append(messages[:2])
    if not out:
        raise ValueError(f"{path} has no user + assistant conversations after line {skip}: give a chat "
                         f'JSONL file of {{"messages": [{{"role": "user", ...}}, {{"role": "assistant", ...}}]}} '
                         f"lines, or a smaller --skip")
    return out


def split_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids as the engine gets them, answer ids) of one user + assistant exchange."""
    from ..loading import encode_prompt

    prompt = encode_prompt(tokenizer, messages[0]["content"])
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer.encode(full, add_special_tokens=False)
    if ids[:len(prompt)] != prompt:
        raise ValueError("the chat template renders the user turn differently inside a conversation; "
                         "spd gate needs a template whose prompt is a prefix of the conversation")
    return prompt, ids[len(prompt):]


def gate(
    model: str = typer.Option(..., help="The target: folder, hub id, or 'default'."),
    pdm: list[str] = typer.Option(..., help="PDM checkpoint folder; the fitted gate is saved into it "
                                  "(repeat for several PDMs of the same target)."),
    data: Path = typer.Option(..., help="Chat JSONL of TRAINING conversations (never evaluation prompts)."),
    skip: int = typer.Option(0, help="Skip this many lines first (e.g. the ones the PDM trained on)."),
    conversations_count: int = typer.Option(300, "--conversations", min=1, help="Conversations to fit on."),
    max_len: int = typer.Option(8, min=1, help="Longest match length the gate tells apart."),
    min_count: int = typer.Option(20, min=1, help="Fewest disagreements to fit a length on its own."),
    temperature: float = typer.Option(1.0, min=0.0, help="Sampling temperature of the sampled thresholds "
                                      "(used at every T > 0); 0 fits the greedy ones only, keeping the sampled "
                                      "ones of the gate already beside each PDM."),
    own_answers_tokens: int = typer.Option(256, "--own-answers", min=0, help="Fit the sampled thresholds on the "
                                           "target's own answers to the training prompts, sampled at "
                                           "--temperature, up to this many tokens each (0: the dataset's answers)."),
    adapt: Optional[float] = typer.Option(None, min=0.0, max=1.0, help="Weight of each sequence's retrieval lead "
                                          "on the greedy thresholds (0: off); by default fitted from "
                                          + ", ".join(f"{w:g}" for w in ADAPT_GRID) + "."),
    sampled_only: bool = typer.Option(False, help="Refit only the sampled thresholds, keeping the greedy ones "
                                      "of the gate already beside each PDM."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    dry_run: bool = typer.Option(False, help="Print the gate without saving it."),
):
    """Fit the hybrid drafter's retrieval gate for a PDM on training conversations and save it
    beside the PDM (retrieval_gate.json). Along each conversation the target's own next token is
    the truth; prints the gate and how many drafts it gets right where retrieval and PDM disagree.
    Sampling gets thresholds of its own, fitted at --temperature on expected acceptance."""
    from ..checkpoint import load_pdm
    from ..retrieval import Gate
    from ..target import load_target

    if threads:
        torch.set_num_threads(threads)
    if sampled_only and temperature <= 0:
        fail("--sampled-only refits the sampled thresholds: give a --temperature above 0")
    try:
        chats = conversations(data, skip, conversations_count)
        target, tokenizer = load_target(model)
        if tokenizer is None:
            raise ValueError(f"{model} has no tokenizer: spd gate renders conversations with it")
        nets = {Path(folder): load_pdm(folder, target) for folder in pdm}
        pairs = [split_conversation(tokenizer, messages) for messages in chats]
    except (ValueError, OSError) as err:
        fail(str(err))
    sampled_pairs = pairs
    if temperature > 0 and own_answers_tokens:
        answers = own_answers(target, [prompt for prompt, _ in pairs], temperature, own_answers_tokens)
        sampled_pairs = [(prompt, answer) for (prompt, _), answer in zip(pairs, answers) if answer]
    source = f"{data.name} lines {skip}.. ({len(pairs)} conversations"
    for folder, net in nets.items():
        replayed = lambda chosen, t: [r for prompt, answer in tqdm(chosen, desc=f"replaying {folder.name}")  # noqa: E731
                                     for r in gate_records(target, net, prompt, answer, max_len, t)]
        shared = temperature > 0 and sampled_pairs is pairs   # one replay serves both fits
        records = [] if sampled_only else replayed(pairs, temperature if shared else 0.0)
        if temperature <= 0:
            sampled = []
        elif shared and records:
            sampled = records
        else:
            sampled = replayed(sampled_pairs, temperature)
        disagree = [r for r in records if not r.agree]
        fitted = fit_gate(records, max_len, min_count, temperature=temperature, sampled_records=sampled, adapt=adapt,
                          fitted_on=f"{source}, {len(records)} matches, {len(disagree)} disagreements)")
        saved = Gate.load(folder)
        if sampled_only:
            fitted = replace(saved, sampled_min_len=fitted.sampled_min_len,
                             sampled_threshold=fitted.sampled_threshold, sampled_temperature=temperature)
        elif temperature <= 0 and saved.max_len == max_len:   # greedy only: the sampled thresholds stay
            fitted = replace(fitted, sampled_min_len=saved.sampled_min_len, sampled_threshold=saved.sampled_threshold,
                             sampled_temperature=saved.sampled_temperature)
        typer.echo(f"{folder}: {json.dumps(fitted.__dict__)}")
        if disagree:
            gated = sum(r.retrieval_right if fitted.takes_retrieval(r.match_len, r.pdm_top1, lead=r.lead) else r.pdm_right
                        for r in disagree)
            typer.echo(f"  where retrieval and the PDM disagree ({len(disagree)} drafts): PDM right "
                       f"{sum(r.pdm_right for r in disagree)}, retrieval right "
                       f"{sum(r.retrieval_right for r in disagree)}, gated right {gated}")
        if sampled:
            own = "own answers" if sampled_pairs is not pairs else "the dataset's answers"
            sampled_disagree = [r for r in sampled if not r.agree]
            taken = lambda r: fitted.takes_retrieval(r.match_len, r.pdm_top1, sampling=True)  # noqa: E731
            gated = sum(r.retrieval_p if taken(r) else r.pdm_overlap for r in sampled_disagree)
            typer.echo(f"  sampled at T={temperature:g} on {own} ({len(sampled_disagree)} disagreements), expected "
                       f"accepted drafts there: PDM {sum(r.pdm_overlap for r in sampled_disagree):.1f}, retrieval "
                       f"{sum(r.retrieval_p for r in sampled_disagree):.1f}, gated {gated:.1f}")
        if not dry_run:
            typer.echo(f"  saved {fitted.save(folder)}")
