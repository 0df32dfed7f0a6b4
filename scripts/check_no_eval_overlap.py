"""Guard against evaluation prompts leaking into training data.

A command line checker for a finished chat JSONL (the overlap test itself is
``spd.distill.prompts.EvalIndex``, which ``spd data`` applies while it generates):

    python scripts/check_no_eval_overlap.py data/chat_train.jsonl [--eval-dir DIR]

It exits 1 when any user turn equals, contains, is contained in, or shares a
long word n-gram with an evaluation prompt (every turn of
``{mt_bench,gsm8k,humaneval}/question.jsonl``), 2 when the eval data is
missing, 0 when the file is clean.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the overlap test lives in the library (`spd data` drops overlapping prompts as it goes)
from spd.distill.prompts import NGRAM, EvalIndex, load_eval_prompts, normalize  # noqa: F401

# ../shared/eval_data relative to the repo root.
DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "eval_data"


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
