"""Guard against evaluation prompts leaking into training data.

Holds the overlap test used by ``make_chat_data.py`` while it generates, and a
command line checker for a finished chat JSONL:

    python scripts/check_no_eval_overlap.py data/chat_train.jsonl [--eval-dir DIR]

It exits 1 when any user turn equals, contains, is contained in, or shares a
long word n-gram with an evaluation prompt (every turn of
``{mt_bench,gsm8k,humaneval}/question.jsonl``), 2 when the eval data is
missing, 0 when the file is clean.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

EVAL_SETS = ("mt_bench", "gsm8k", "humaneval")
NGRAM = 12
# Very short strings are "contained in" almost any prompt; only longer ones count.
MIN_CONTAINED_CHARS = 20
# ../shared/eval_data relative to the repo root.
DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "eval_data"


def normalize(text: str) -> str:
    """Lower case with all whitespace runs collapsed to one space."""
    return " ".join(text.lower().split())


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


class EvalIndex:
    """Normalised eval prompts and their word n-grams, for fast lookups."""

    def __init__(self, prompts: list[str], n: int = NGRAM) -> None:
        self.prompts, self.n = list(prompts), n
        self.normalized = [normalize(p) for p in self.prompts]
        self.grams = set()
        for p in self.prompts:
            self.grams |= ngrams(words(p), self.n)

    def overlap(self, text: str) -> str | None:
        """Why ``text`` overlaps an eval prompt, or None when it does not."""
        q = normalize(text)
        if not q:
            return None
        for i, e in enumerate(self.normalized):
            if q == e:
                return f"equals eval prompt {i}"
            if e in q:
                return f"contains eval prompt {i}"
            if len(q) >= MIN_CONTAINED_CHARS and q in e:
                return f"is contained in eval prompt {i}"
        shared = ngrams(words(text), self.n) & self.grams
        if shared:
            return f"shares a {self.n}-word n-gram with an eval prompt: {' '.join(next(iter(shared)))!r}"
        return None


def load_eval_prompts(eval_dir: Path) -> list[str]:
    """Every turn of every eval question (turns[0] and any follow-ups)."""
    prompts = []
    for name in EVAL_SETS:
        path = Path(eval_dir) / name / "question.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"evaluation prompts not found: {path}")
        with path.open() as f:
            for line in f:
                if line.strip():
                    prompts.extend(json.loads(line)["turns"])
    return prompts


def check_file(path: Path, index: EvalIndex) -> list[tuple[int, str]]:
    """(line number, reason) for every conversation whose user turns overlap."""
    problems = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            for msg in json.loads(line)["messages"]:
                if msg["role"] != "user":
                    continue
                reason = index.overlap(msg["content"])
                if reason:
                    problems.append((lineno, reason))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("--eval-dir", type=Path, default=DEFAULT_EVAL_DIR)
    ap.add_argument("--ngram", type=int, default=NGRAM)
    args = ap.parse_args(argv)
    try:
        index = EvalIndex(load_eval_prompts(args.eval_dir), n=args.ngram)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problems = check_file(args.jsonl, index)
    for lineno, reason in problems:
        print(f"{args.jsonl}:{lineno}: {reason}")
    if problems:
        print(f"{len(problems)} overlapping conversation(s)", file=sys.stderr)
        return 1
    print(f"ok: no overlap with {len(index.prompts)} eval prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
