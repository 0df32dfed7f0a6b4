"""Self-distillation: the target answers prompts, and its answers become PDM training data.

`distill(cfg)` writes JSONL, one conversation a line (`{"messages": [..., user, assistant]}`;
`--raw`: `{"text", "input_ids", "loss_mask"}` with only the continuation scored), and a sidecar
`<out>.meta.json` with the parameters and progress. Prompts come from a file, or the target
writes its own questions from topic x task x format openers (`prompts.opener`).

Work goes in rounds of `batch_size` prompts; everything random in round r depends on (seed, r)
alone, and the meta file is written after each round's lines. A run stopped anywhere and
continued with `resume` cuts the file back to its last complete round and goes on from the next:
no prompt is answered twice and, on the same device, the file is the one an uninterrupted run
writes. Prompts that overlap an evaluation set are dropped before anything is generated.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import multiprocessing
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .prompts import EvalIndex, default_eval_dir, load_eval_prompts, normalize, opener, read_prompts
from .sample import ATTENTION, SampleConfig, sample_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataConfig:
    """What `spd data` makes. The fields down to `dtype` define the data: a resumed run must match."""

    model: str
    out: str
    prompts: str | None = None          # None: the target writes its own questions from openers
    num_conversations: int | None = None  # None: every prompt of the file (required without --prompts)
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int = 0
    raw: bool = False                   # no chat template: continue the prompt text
    batch_size: int = 128
    question_tokens: int = 64           # openers: a question's length at most
    question_temperature: float = 1.0
    min_distinct_4gram: float = 0.35    # answers that loop (fewer distinct word 4-grams) are dropped
    dtype: str = "bfloat16"
    eval_dir: str | None = None         # None: ../shared/eval_data when present
    eval_filter: bool = True
    device: str = "cpu"
    workers: int = 1                    # processes sampling rounds side by side (CPU), each with
    worker_threads: int = 1             # this many torch threads
    resume: bool = False

    def data_params(self) -> dict:
        keys = ("model", "prompts", "max_new_tokens", "temperature", "top_p", "seed", "raw", "batch_size",
                "question_tokens", "question_temperature", "min_distinct_4gram", "dtype")
        return {k: getattr(self, k) for k in keys}


@dataclass
class Progress:
    rounds: int = 0
    lines: int = 0
    answer_tokens: int = 0
    prompt_tokens: int = 0
    answers_unfinished: int = 0
    rejected: dict = field(default_factory=dict)

    def reject(self, why: str, count: int = 1) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + count

    def keep(self, answered: list[tuple], counted: "Progress", room: int, seen: set[str] | None) -> list[dict]:
        """The records of one round's (record, answer tokens, finished) to write, at most `room`, none
        whose prompt is in `seen` (an earlier round's; None: no check); counts them and the round."""
        records = []
        for record, tokens, finished in answered:
            if len(records) == room:
                break
            if seen is not None:
                key = normalize(_user_text(record))
                if key in seen:
                    self.reject("duplicate")
                    continue
                seen.add(key)
            records.append(record)
            self.answer_tokens += tokens
            self.answers_unfinished += not finished
        self.prompt_tokens += counted.prompt_tokens
        for why, count in counted.rejected.items():
            self.reject(why, count)
        return records


def distinct_4gram_ratio(text: str) -> float:
    """Share of distinct word 4-grams; low values mean the text loops."""
    w = re.findall(r"\w+", text.lower())
    grams = [tuple(w[i:i + 4]) for i in range(len(w) - 3)]
    return len(set(grams)) / len(grams) if len(grams) >= 40 else 1.0


def chat_frame(tok) -> tuple[str, int]:
    """(head, end-of-turn id): the text before a user turn's content, and the special token that
    ends a turn, where the target's own questions stop."""
    marker = "\u2063SPD-QUESTION\u2063"
    rendered = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in rendered:
        raise ValueError(f"{tok.name_or_path}: its chat template changes the user's text, so the target "
                         "cannot write its own questions; give --prompts")
    head, tail = rendered.split(marker, 1)
    tail_ids = tok(tail, add_special_tokens=False)["input_ids"]
    if not tail_ids or tail_ids[0] not in tok.all_special_ids:
        raise ValueError(f"{tok.name_or_path}: its chat template does not end a user turn with a special "
                         f"token (it writes {tail!r}), so a question's end cannot be found; give --prompts")
    return head, tail_ids[0]


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, path)


def _restore(out: Path, keep: int) -> list[dict]:
    """Cut `out` back to its first `keep` lines (a stop may leave part of a round) and return them."""
    lines = [ln for ln in out.read_bytes().split(b"\n") if ln.strip()]
    if len(lines) < keep:
        raise ValueError(f"{out} has {len(lines)} lines but its meta file records {keep}; cannot resume "
                         "(start a new --out)")
    out.write_bytes(b"".join(ln + b"\n" for ln in lines[:keep]))
    return [json.loads(ln) for ln in lines[:keep]]


def _user_text(record: dict) -> str:
    return record["messages"][-2]["content"] if "messages" in record else record["prompt"]


def eos_ids(model, tok) -> set[int]:
    """The ids that end a continuation: the tokenizer's and the generation config's end of sequence."""
    return {i for i in [tok.eos_token_id, *_as_list(model.generation_config.eos_token_id)] if i is not None}


def pad_id(tok, stop) -> int:
    """The id batches are padded with: the tokenizer's pad, else the smallest stop id (0 without one)."""
    return tok.pad_token_id if tok.pad_token_id is not None else min(stop, default=0)


class Distiller:
    """The model, tokenizer and filters of one `spd data` run."""

    def __init__(self, cfg: DataConfig, model, tok, index: EvalIndex | None):
        self.cfg, self.model, self.tok, self.index = cfg, model, tok, index
        self.special = set(tok.all_special_ids)
        self.stop = eos_ids(model, tok)
        self.head = None
        if not cfg.raw:
            try:   # the turn's end token ends answers too (Llama 3's <|eot_id|> is not its eos)
                head, end_of_turn = chat_frame(tok)
                self.stop.add(end_of_turn)
                self.head = head if cfg.prompts is None else None
            except ValueError:
                if cfg.prompts is None:   # the target cannot write its own questions
                    raise
        if not self.stop:
            log.warning("%s names no end-of-sequence token: every continuation runs to --max-new-tokens", cfg.model)
        self.pad = pad_id(tok, self.stop)
        self.answer = SampleConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_p)

    def keep_prompt(self, text: str, seen: set[str], progress: Progress) -> bool:
        """Whether to answer `text`; a kept one joins `seen`, so it is not answered twice."""
        why = ("empty" if not text.strip() else "duplicate" if normalize(text) in seen
               else "eval_overlap" if self.index is not None and self.index.overlap(text) else None)
        if why:
            progress.reject(why)
        else:
            seen.add(normalize(text))
        return why is None

    def questions(self, r: int, gen: torch.Generator, seen: set[str], progress: Progress) -> list[list[dict]]:
        """Round r's prompts written by the target from openers (raw: the openers themselves), none
        twice in `seen`."""
        rng = random.Random(f"{self.cfg.seed}-{r}")
        starts = [opener(rng) for _ in range(self.cfg.batch_size)]
        if self.cfg.raw:   # the openers are the prompts: each answered once
            return [[{"role": "user", "content": s}] for s in starts if self.keep_prompt(s, seen, progress)]
        ids = [self.tok(self.head + s, add_special_tokens=False)["input_ids"] for s in starts]
        written = sample_batch(self.model, ids, SampleConfig(self.cfg.question_tokens, self.cfg.question_temperature,
                                                             0.95), self.stop, self.pad, gen)
        out = []
        for start, q in zip(starts, written):
            progress.prompt_tokens += len(q.tokens)
            text = (start + self.tok.decode(q.tokens, skip_special_tokens=True)).strip()
            if not q.finished or any(t in self.special for t in q.tokens):
                progress.reject("question_unfinished")
            elif not 4 <= len(text.split()) <= 120:
                progress.reject("question_length")
            elif self.keep_prompt(text, seen, progress):
                out.append([{"role": "user", "content": text}])
        return out

    def answers(self, prompts: list[list[dict]], gen: torch.Generator, progress: Progress) -> list[tuple]:
        """(JSONL record, answer tokens, ended by itself) for each prompt; looping answers dropped."""
        if self.cfg.raw:
            ids = [self.tok(p[-1]["content"])["input_ids"] for p in prompts]
        else:
            ids = [list(self.tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]) for p in prompts]
        answered = []
        for p, prompt_ids, a in zip(prompts, ids, sample_batch(self.model, ids, self.answer, self.stop, self.pad, gen)):
            text = self.tok.decode(a.tokens, skip_special_tokens=True)
            if not text.strip():
                progress.reject("empty_answer")
                continue
            if distinct_4gram_ratio(text) < self.cfg.min_distinct_4gram:
                progress.reject("degenerate_answer")
                continue
            if self.cfg.raw:
                record = {"prompt": p[-1]["content"], "text": p[-1]["content"] + text,
                          "input_ids": prompt_ids + a.tokens, "loss_mask": [0] * len(prompt_ids) + [1] * len(a.tokens)}
            else:
                record = {"messages": p + [{"role": "assistant", "content": text.strip()}]}
            answered.append((record, len(a.tokens), a.finished))
        return answered

    def round(self, r: int, prompts: list[list[dict]] | None) -> tuple[list[tuple], Progress]:
        """Round r: its answered prompts and what it counted. Depends on (seed, r) alone, not on earlier
        rounds, so rounds can run in parallel (duplicates across rounds are dropped as they are written)."""
        counted = Progress()
        gen = torch.Generator(device=self.cfg.device).manual_seed(self.cfg.seed * 1_000_003 + r)
        batch = (prompts[r * self.cfg.batch_size:(r + 1) * self.cfg.batch_size] if prompts is not None
                 else self.questions(r, gen, set(), counted))
        return (self.answers(batch, gen, counted) if batch else []), counted


_WORKER: tuple | None = None   # (Distiller, prompts) of the running pool, inherited by its forked workers


def _round_in_worker(r: int) -> tuple[list[tuple], Progress]:
    job, prompts = _WORKER
    return job.round(r, prompts)


def rounds_in_order(job: Distiller, prompts, first: int, workers: int, threads: int):
    """(r, round r's result) for r = first, first + 1, ...: in this process, or computed ahead by
    `workers` forked processes of `threads` torch threads each and yielded in order."""
    global _WORKER
    if workers <= 1:
        for r in itertools.count(first):
            yield r, job.round(r, prompts)
        return
    _WORKER = (job, prompts)
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=torch.set_num_threads,
                                                      initargs=(threads,)) as pool:
            pending, rounds = collections.deque(), itertools.count(first)
            while True:
                while len(pending) < workers:
                    r = next(rounds)
                    pending.append((r, pool.apply_async(_round_in_worker, (r,))))
                r, result = pending.popleft()
                yield r, result.get()
    finally:
        _WORKER = None


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _resumed(cfg: DataConfig, out: Path, meta_path: Path, head: str | None) -> tuple[Progress, set[str]]:
    """The progress of the run in `out` and its prompts so far, after checking that it may go on."""
    if not (cfg.resume and out.exists()):
        return Progress(), set()
    if not meta_path.is_file():
        raise ValueError(f"--resume: {meta_path} is missing, so where {out} stopped is unknown; start a new --out")
    meta = json.loads(meta_path.read_text())
    if meta["params"] != cfg.data_params():
        changed = {k: (meta["params"].get(k), v) for k, v in cfg.data_params().items() if meta["params"].get(k) != v}
        raise ValueError(f"--resume with other data parameters (recorded, given): {changed}")
    if meta.get("head", head) != head:   # e.g. a template that writes today's date
        raise ValueError(f"--resume: the chat template now starts a question differently from when {out} "
                         "was begun; start a new --out")
    if torch.device(meta["device"]).type != torch.device(cfg.device).type:
        raise ValueError(f"--resume: {out} was made on {meta['device']}; pass --device {meta['device']} "
                         "(samples differ across devices) or start a new --out")
    progress = Progress(**meta["progress"])
    seen = {normalize(_user_text(r)) for r in _restore(out, progress.lines)}
    log.info("resuming %s at round %d with %d conversations", out, progress.rounds, progress.lines)
    return progress, seen


def distill(cfg: DataConfig, show_progress: bool = True) -> Progress:
    """Write `cfg.out` (see the module docstring); returns the run's totals."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..default_target import resolve_model_path
    from ..loading import parse_dtype

    if cfg.prompts is None and cfg.num_conversations is None:
        raise ValueError("without --prompts, say how many conversations to write: --num-conversations K")
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1 or (cfg.num_conversations is not None and cfg.num_conversations < 1):
        raise ValueError("--batch-size, --max-new-tokens and --num-conversations must be at least 1")
    if not 0 < cfg.top_p <= 1 or cfg.temperature < 0:
        raise ValueError(f"--top-p must be in (0, 1] and --temperature >= 0; got {cfg.top_p}, {cfg.temperature}")
    dtype = parse_dtype(cfg.dtype)
    prompts = read_prompts(cfg.prompts) if cfg.prompts is not None else None
    out, meta_path = Path(cfg.out), Path(cfg.out + ".meta.json")
    if out.exists() and out.stat().st_size and not cfg.resume:
        raise ValueError(f"--out {out} exists and is not empty: pass --resume to go on with it, or another --out")
    eval_dir = cfg.eval_dir or (default_eval_dir() if cfg.eval_filter else None)
    index = None
    if cfg.eval_filter and eval_dir is not None:
        index = EvalIndex(load_eval_prompts(eval_dir))
    elif cfg.eval_filter:
        log.warning("no evaluation prompts found (../shared/eval_data, $SPD_EVAL_DIR): nothing is filtered; "
                    "pass --eval-dir DIR")

    path = resolve_model_path(cfg.model)
    tok = AutoTokenizer.from_pretrained(path)
    if not cfg.raw and not getattr(tok, "chat_template", None):
        raise ValueError(f"{cfg.model} has no chat template: pass --raw to continue plain text (a base model), "
                         "or use a chat model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(cfg.device).eval()
    model.set_attn_implementation(ATTENTION)
    job = Distiller(cfg, model, tok, index)

    progress, seen = _resumed(cfg, out, meta_path, job.head)
    if prompts is not None:  # filter once, in file order: round r is the r-th slice of what is kept
        kept, file_seen, scratch = [], set(), Progress()
        for p in prompts:
            if job.keep_prompt(p[-1]["content"], file_seen, scratch):
                kept.append(p)
        if not kept:
            raise ValueError(f"--prompts {cfg.prompts}: every prompt was dropped ({scratch.rejected})")
        prompts = kept
    goal = cfg.num_conversations or len(prompts)
    meta = {"params": cfg.data_params(), "device": cfg.device, "head": job.head, "model_path": str(path),
            "eval_dir": str(eval_dir), "workers": cfg.workers, "worker_threads": cfg.worker_threads,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "progress": asdict(progress)}
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_meta(meta_path, meta)

    from tqdm import tqdm

    bar = tqdm(total=goal, initial=progress.lines, unit="conv", disable=not show_progress, smoothing=0.05)
    t0, tokens0, idle_rounds = time.time(), progress.answer_tokens, 0
    rounds = rounds_in_order(job, prompts, progress.rounds, cfg.workers, cfg.worker_threads)
    try:
        while progress.lines < goal and not (prompts is not None and progress.rounds * cfg.batch_size >= len(prompts)):
            r, (answered, counted) = next(rounds)
            records = progress.keep(answered, counted, goal - progress.lines, seen if prompts is None else None)
            with out.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records))
                f.flush()
                os.fsync(f.fileno())
            progress.lines += len(records)
            progress.rounds = r + 1
            meta["progress"] = asdict(progress)
            _write_meta(meta_path, meta)   # after the lines: a stop in between is cut back on resume
            idle_rounds = 0 if records else idle_rounds + 1
            if idle_rounds == 20:
                raise ValueError(f"no conversation kept in 20 rounds in a row (rejected: {progress.rejected}); "
                                 f"does the model end its turns with one of the ids {sorted(job.stop)}?")
            bar.update(len(records))
            bar.set_postfix(answer_tok_s=f"{(progress.answer_tokens - tokens0) / (time.time() - t0):.0f}",
                            tokens=progress.answer_tokens)
    finally:
        rounds.close()   # ends the worker processes
    bar.close()
    return progress
