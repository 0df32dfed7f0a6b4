"""How diverse a chat data file is: distinct token n-grams per 1,000 tokens, questions and answers apart.

Distinct counts grow more slowly than the text, so files compare only at the same size: each file is
read from its start until `--tokens` tokens of the side being measured (the target's tokenizer),
and the conversations read are the same for both sides' counts.

    python scripts/data_diversity.py data/chat_train.jsonl data/distill/chat.jsonl --tokens 100000
"""

from __future__ import annotations

import argparse
import json
import sys


def side_tokens(path: str, tokenizer, limit: int) -> dict[str, list[list[int]]]:
    """{'questions': [...], 'answers': [...]}: token lists of the file's user and assistant turns,
    each side cut once it holds `limit` tokens."""
    sides = {"questions": [], "answers": []}
    counts = dict.fromkeys(sides, 0)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if all(c >= limit for c in counts.values()):
                break
            for message in json.loads(line)["messages"]:
                side = "questions" if message["role"] == "user" else "answers"
                if counts[side] < limit:
                    ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"][:limit - counts[side]]
                    sides[side].append(ids)
                    counts[side] += len(ids)
    return sides


def distinct_per_1k(sequences: list[list[int]], n: int) -> float:
    grams, total = set(), 0
    for ids in sequences:
        grams.update(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
        total += len(ids)
    return 1000 * len(grams) / max(total, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--tokens", type=int, default=100_000, help="tokens per side and file")
    ap.add_argument("--model", default="default")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from spd.default_target import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    print(f"distinct n-grams per 1k tokens (first {args.tokens:,} tokens of each side)")
    print(f"{'file':<36} {'side':<10} {'tokens':>8} {'1-gram':>7} {'2-gram':>7} {'3-gram':>7} {'4-gram':>7}")
    for path in args.files:
        for side, seqs in side_tokens(path, tokenizer, args.tokens).items():
            total = sum(map(len, seqs))
            row = " ".join(f"{distinct_per_1k(seqs, n):7.1f}" for n in (1, 2, 3, 4))
            print(f"{path:<36} {side:<10} {total:>8,} {row}")
            if total < args.tokens:
                print(f"  ({path} holds only {total:,} {side} tokens: not comparable at --tokens {args.tokens:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
