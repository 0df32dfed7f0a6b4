"""The generator of data/chat_train.jsonl, kept so that file can be rebuilt line for line.

New data: `spd data` (spd.distill), which samples 2-3x faster and takes prompt files.

The default target (SmolLM2-135M-Instruct) writes both sides: it first
samples user questions from its own chat template's user turn, seeded with
varied short openers (chat, writing, coding, math), then answers each one.
Output is JSONL, one ``{"messages": [user, assistant]}`` per line, appended as
it goes; parameters and progress live in a sidecar ``<output>.meta.json``.

Work proceeds in rounds, each seeded from (--seed, round index) alone, so a
run stopped at any point and continued with --resume writes exactly the file
an uninterrupted run would have. Questions overlapping the evaluation prompts
are dropped (see check_no_eval_overlap.py).

    python scripts/make_chat_data.py --output data/chat_train.jsonl \
        --num-conversations 1000 --batch-size 32 --threads 1 [--resume]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_no_eval_overlap import DEFAULT_EVAL_DIR, EvalIndex, load_eval_prompts, normalize  # noqa: E402
from spd.distill.run import chat_frame as distill_chat_frame  # noqa: E402
from spd.distill.run import distinct_4gram_ratio

logger = logging.getLogger("make_chat_data")

# Openers for the user turn; the target continues each into a full question.
PREFIXES = [
    # general chat and explanations
    "Explain", "Explain in simple terms", "Explain why", "Explain how", "What is", "What are",
    "What is the difference between", "Why do", "Why is", "How does", "How do I", "How can I",
    "How can we", "Can you help me", "Can you explain", "Tell me about", "Tell me a fun fact about",
    "Describe", "Compare", "What are the benefits of", "What are the risks of",
    "What are some common mistakes when", "Give me some tips", "Give me three ideas for",
    "Give me a list of", "Suggest", "Recommend", "I need advice on", "I am feeling",
    "My friend says", "Is it true that", "Should I", "What would happen if", "Imagine",
    "What do you think about", "Help me plan", "Help me understand", "Teach me",
    "What is the best way to", "List the steps to", "Summarize", "Summarize the history of",
    "Translate", "Rewrite this sentence", "Correct the grammar in", "Define",
    "What is the meaning of", "Who was", "When did", "Where can I",
    # topics, as a user might type them
    "Photosynthesis", "Black holes", "The French Revolution", "Climate change", "Vaccines",
    "The stock market", "Machine learning", "Healthy eating", "Sleep", "Meditation",
    "Learning a new language", "Job interviews", "Personal finance", "Renewable energy",
    "The human brain", "Volcanoes", "Ancient Rome", "The solar system", "Gardening",
    "Cooking pasta", "Traveling to Japan", "Time management", "Public speaking", "Dogs",
    "Electric cars", "The internet", "Democracy", "Music theory", "Chess", "Coffee",
    # writing
    "Write a short poem", "Write a haiku about", "Write a story", "Write a short story about",
    "Write an email", "Write a letter to", "Write a product description for",
    "Write a blog post about", "Write a speech", "Write a tweet about", "Write a dialogue between",
    "Write a cover letter", "Write a review of", "Write a limerick", "Write a slogan for",
    "Draft a message", "Create a recipe for", "Create a workout plan", "Come up with a name for",
    "Brainstorm",
    # coding
    "Write a Python function", "Write a Python function that takes a list", "Write a Python script",
    "Write a Python class", "Write a function in JavaScript", "Write a SQL query",
    "Write a bash command", "Write a C program", "Write a Java method", "Write a regular expression",
    "Implement", "Implement a function", "Implement binary search", "Implement a stack",
    "Fix this code:", "Debug the following Python code:", "What does this code do?",
    "Explain this Python code:", "How do I read a file in Python", "How do I sort a dictionary",
    "What is the time complexity of", "What is the difference between a list and a tuple",
    "How do I use git", "How do I install", "Why am I getting this error:", "Optimize this function:",
    "Write unit tests for", "Convert this code to", "def ", "Given a string s,",
    "Given an array of integers,", "Write a recursive function", "Write a function to check if",
    "Write a program that prints", "How do I handle exceptions in Python", "What is a closure",
    "Explain object-oriented programming", "What is an API", "How does a hash table work",
    "Write a Python function to compute",
    # math
    "Solve for x:", "Calculate", "What is 15% of", "A farmer has", "If a train travels",
    "A store sells", "John has", "Mary bought", "A rectangle has", "A car travels",
    "There are 24 students", "Tom is twice as old as", "A recipe needs", "Sarah earns",
    "A tank holds", "If 3 workers", "The sum of two numbers is", "A shop offers a discount",
    "Find the area of", "Find the derivative of", "What is the probability that",
    "Simplify", "Prove that", "Is 221 a prime number?", "How many ways can",
    "What is the square root of", "Convert 3/8 to", "A baker makes", "Lisa reads",
    "A bus leaves at", "Each box contains", "A school has", "The price of a shirt",
    "Jake saves", "A pool is being filled", "Two trains leave", "A pizza is cut into",
    "An investment of", "A number is increased by", "The average of five numbers",
    "Solve the equation", "What is the next number in the sequence", "Factor",
    "How many minutes are in", "If a = 3 and b = 5,", "A bag contains red and blue marbles",
    "A cyclist rides", "Half of the students", "What is the least common multiple of",
    "Word problem:", "Math question:",
]

# Parameters that define the data; a resumed run must match them exactly.
DATA_PARAMS = (
    "model", "seed", "batch_size", "q_max_new_tokens", "q_temperature", "q_top_p",
    "a_max_new_tokens", "a_temperature", "a_top_p", "min_words", "max_words", "ngram",
    "min_active_frac", "min_distinct_4gram", "dtype",
)


class _StopWhenFew:
    """Stopping criterion: rows that produced EOS are done; once fewer than
    ``frac`` of the rows are still running, end them all (keeping their
    truncated text), since each step still costs the whole batch."""

    def __init__(self, prompt_len: int, eos_id: int, frac: float):
        self.prompt_len, self.eos_id, self.frac = prompt_len, eos_id, frac

    def __call__(self, input_ids, scores, **kwargs):
        done = (input_ids[:, self.prompt_len :] == self.eos_id).any(dim=1)
        if self.frac > 0 and (~done).float().mean().item() < self.frac:
            return torch.ones_like(done)
        return done


def _generate(model, tok, texts, max_new, temperature, top_p, eos_id, min_active_frac=0.0):
    """Batched sampling; returns (text, n_tokens, finished, has_special) per prompt."""
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    plen = enc["input_ids"].shape[1]
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=max_new, do_sample=True, temperature=temperature,
            top_p=top_p, top_k=0, eos_token_id=eos_id, pad_token_id=tok.pad_token_id,
            stopping_criteria=[_StopWhenFew(plen, eos_id, min_active_frac)],
        )
    special = set(tok.all_special_ids)
    results = []
    for row in out[:, plen:].tolist():
        finished = eos_id in row
        row = row[: row.index(eos_id)] if finished else row
        has_special = any(i in special for i in row)
        results.append((tok.decode(row, skip_special_tokens=True), len(row), finished, has_special))
    return results


def chat_frame(tok) -> tuple[str, int]:
    """(head, end-of-turn id) of the tokenizer's chat template (spd.distill.run.chat_frame)."""
    if tok.chat_template is None:
        raise SystemExit(f"{tok.name_or_path}: the tokenizer has no chat template; use an instruct/chat model")
    try:
        return distill_chat_frame(tok)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _question_ok(q: str, args, seen: set[str], index: EvalIndex) -> str | None:
    """Why question ``q`` is rejected, or None to keep it."""
    n = len(q.split())
    if n < args.min_words:
        return "short"
    if n > args.max_words:
        return "long"
    if normalize(q) in seen:
        return "duplicate"
    if index.overlap(q):
        return "eval_overlap"
    return None


def _load_meta(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, path)


def _restore(out: Path, meta: dict) -> list[str]:
    """Cut ``out`` back to the lines the last completed round recorded
    (a crash may leave a partial round) and return their questions."""
    keep = meta["progress"]["lines"]
    with out.open("rb") as f:
        lines = [ln for ln in f.read().split(b"\n") if ln.strip()]
    complete = []
    for ln in lines[:keep]:
        complete.append(json.loads(ln))  # raises on a corrupt line inside the kept part
    if len(complete) < keep:
        raise SystemExit(f"{out} has {len(complete)} lines but its meta records {keep}; cannot resume")
    with out.open("wb") as f:
        f.write(b"".join(ln + b"\n" for ln in lines[:keep]))
    return [c["messages"][0]["content"] for c in complete]


def parse_args(argv=None):
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description="Self-distilled chat data from the default target.")
    ap.add_argument("--output", type=Path, default=root / "data" / "chat_train.jsonl")
    ap.add_argument("--num-conversations", type=int, default=1000)
    ap.add_argument("--model", default="default", help="'default' or a model folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=48,
                    help="questions sampled per round (about 2/3 survive to be answered)")
    ap.add_argument("--q-max-new-tokens", type=int, default=64)
    ap.add_argument("--q-temperature", type=float, default=1.0)
    ap.add_argument("--q-top-p", type=float, default=0.95)
    ap.add_argument("--a-max-new-tokens", type=int, default=256)
    ap.add_argument("--a-temperature", type=float, default=0.7)
    ap.add_argument("--a-top-p", type=float, default=1.0)
    ap.add_argument("--min-words", type=int, default=4)
    ap.add_argument("--max-words", type=int, default=120)
    ap.add_argument("--ngram", type=int, default=12, help="eval n-gram overlap length (words)")
    ap.add_argument("--min-active-frac", type=float, default=0.0,
                    help="end an answer batch early once fewer rows than this are still running")
    ap.add_argument("--min-distinct-4gram", type=float, default=0.35,
                    help="drop answers that loop (share of distinct word 4-grams below this)")
    # bf16 runs ~2x faster than fp32 on AVX512-BF16 CPUs; its logits agree with
    # fp32 on ~98% of argmaxes (KL ~1e-3), negligible next to T=0.7 sampling.
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--eval-dir", type=Path, default=DEFAULT_EVAL_DIR)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu",
                    help="cpu (default) or e.g. cuda; sampling differs across devices, so a "
                         "resumed run must stay on the device it started on")
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    out = args.output
    meta_path = out.with_suffix(".meta.json")
    params = {k: getattr(args, k) for k in DATA_PARAMS}
    params["prefixes"] = len(PREFIXES)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spd.default_target import resolve_model_path

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # batched generation continues from the right edge
    head, eos_id = chat_frame(tok)
    if tok.pad_token is None:  # e.g. Llama 3; padded positions are masked, any id will do
        tok.pad_token_id = eos_id

    seen: set[str] = set()
    progress = {"rounds": 0, "lines": 0, "answer_tokens": 0, "question_tokens": 0,
                "answers_unfinished": 0, "rejected": {}}
    if args.resume and out.exists():
        meta = _load_meta(meta_path)
        if not meta:
            raise SystemExit(f"--resume: {meta_path} is missing")
        if meta["params"] != params:
            diff = {k: (meta["params"].get(k), v) for k, v in params.items()
                    if meta["params"].get(k) != v}
            raise SystemExit(f"--resume with different data parameters (recorded, given): {diff}")
        made_on = meta.get("device", "cpu")  # files made before --device existed: cpu
        if torch.device(made_on).type != torch.device(args.device).type:
            raise SystemExit(f"--resume: {out} was made on {made_on!r}; pass --device {made_on} "
                             "(samples differ across devices) or start a new --output")
        if meta.get("head", head) != head:  # e.g. a template that writes today's date
            raise SystemExit(f"--resume: the chat template now starts a question differently "
                             f"from when {out} was begun; start a new --output")
        progress = meta["progress"]
        seen = {normalize(q) for q in _restore(out, meta)}
        logger.info("resuming at round %d with %d conversations", progress["rounds"], progress["lines"])
    elif out.exists() and out.stat().st_size > 0:
        raise SystemExit(f"{out} exists; pass --resume to continue it or delete it")

    index = EvalIndex(load_eval_prompts(args.eval_dir), n=args.ngram)
    logger.info("loaded %d eval prompts to exclude", len(index.prompts))

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()

    meta = {"params": params, "eval_dir": str(args.eval_dir), "model_path": str(path),
            "device": args.device, "head": head,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "command": sys.argv, "progress": progress}
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_meta(meta_path, meta)

    from tqdm import tqdm

    bar = tqdm(total=args.num_conversations, initial=progress["lines"], unit="q", smoothing=0.1)
    t0, ans0 = time.time(), progress["answer_tokens"]
    empty_rounds = 0
    tokens0 = ans0 + progress["question_tokens"]
    while progress["lines"] < args.num_conversations:
        r = progress["rounds"]
        # Everything random in a round depends on (seed, round) only.
        rng = random.Random(f"{args.seed}-{r}")
        torch.manual_seed(args.seed * 1_000_003 + r)
        prefixes = [rng.choice(PREFIXES) for _ in range(args.batch_size)]
        qs = _generate(model, tok, [head + p for p in prefixes], args.q_max_new_tokens,
                       args.q_temperature, args.q_top_p, eos_id)
        questions = []
        for p, (text, n, finished, special) in zip(prefixes, qs):
            progress["question_tokens"] += n
            q = (p + text).strip()
            why = ("unfinished" if not finished else "special" if special
                   else _question_ok(q, args, seen, index))
            if why:
                progress["rejected"][why] = progress["rejected"].get(why, 0) + 1
                continue
            seen.add(normalize(q))
            questions.append(q)
        questions = questions[: args.num_conversations - progress["lines"]]
        lines = []
        if questions:
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=False)
                       for q in questions]
            answers = _generate(model, tok, prompts, args.a_max_new_tokens, args.a_temperature,
                                args.a_top_p, eos_id, args.min_active_frac)
            for q, (a, n, finished, special) in zip(questions, answers):
                a = a.strip()
                why = ("empty_answer" if not a else "special_answer" if special
                       else "degenerate_answer" if distinct_4gram_ratio(a) < args.min_distinct_4gram
                       else None)
                if why:
                    progress["rejected"][why] = progress["rejected"].get(why, 0) + 1
                    # A resumed run rebuilds `seen` from the file; stay consistent with it.
                    seen.discard(normalize(q))
                    continue
                progress["answer_tokens"] += n
                progress["answers_unfinished"] += not finished
                lines.append(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]},
                                        ensure_ascii=False))
        with out.open("a") as f:
            f.write("".join(ln + "\n" for ln in lines))
            f.flush()
            os.fsync(f.fileno())
        progress["lines"] += len(lines)
        progress["rounds"] = r + 1
        empty_rounds = 0 if lines else empty_rounds + 1
        if empty_rounds == 20:
            raise SystemExit(f"no conversation kept in 20 rounds in a row (rejected so far: "
                             f"{progress['rejected']}); does the model end its turns with "
                             f"{tok.convert_ids_to_tokens(eos_id)!r}?")
        _write_meta(meta_path, meta)  # after the lines: a crash in between is cut back on resume
        dt = time.time() - t0
        toks = progress["answer_tokens"] + progress["question_tokens"] - tokens0
        bar.update(len(lines))
        bar.set_postfix(round=r, ans_tok=progress["answer_tokens"], tok_s=f"{toks / dt:.1f}",
                        ans_tok_s=f"{(progress['answer_tokens'] - ans0) / dt:.1f}")
    bar.close()
    logger.info("done: %s", json.dumps(progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
