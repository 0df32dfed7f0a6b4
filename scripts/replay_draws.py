"""Several sampled replay draws of spd-n<N> against spd-n<N>+retrieval over the same AR samples.

`spd bench run --replay` at T > 0 records ONE draw of each draft's acceptance given AR's sampled
tokens; two methods that differ by less than that draw's noise cannot be ranked from it. This
replays both methods K times over the AR tokens of a bench folder (draw k = 0 is the bench's own:
the records of replayed prompts are reproduced exactly) and prints n*N/C and per-draft acceptance
per draw, and the paired difference (retrieval - PDM) over the draws.

    python scripts/replay_draws.py --stages 2 --dataset gsm8k --draws 5 \
        --bench data/bench-smollm2-t1 --out runs/draws-n2-gsm8k.jsonl      # resumable by prompt
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from spd.bench.acceptance import sequence_snapshots
from spd.bench.harness import encode, prompt_seed, read_questions, read_records
from spd.bench.methods import MethodSpec, build_runner
from spd.sampling import SamplingParams
from spd.target import load_target


def summarize(rows: list[dict], n: int) -> str:
    methods = sorted({r["method"] for r in rows})
    totals = {}   # (draw, method) -> [decode tokens, cycles, accepted, verified]
    for r in rows:
        t = totals.setdefault((r["draw"], r["method"]), [0, 0, 0, 0])
        for i, name in enumerate(("decode_tokens", "cycles", "accepted", "verified")):
            t[i] += r[name]
    lines, diffs = [], []
    for draw in sorted({d for d, _ in totals}):
        nnc = {m: n * totals[draw, m][0] / totals[draw, m][1] for m in methods}
        lines.append(f"draw {draw}: " + "  ".join(
            f"{m} n*N/C {nnc[m]:.4f} per-draft {totals[draw, m][2] / totals[draw, m][3]:.4f}" for m in methods))
        diffs.append(nnc[methods[1]] - nnc[methods[0]])
    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    lines.append(f"{methods[1]} - {methods[0]}: mean {statistics.mean(diffs):+.4f}, sd {spread:.4f}, "
                 f"min {min(diffs):+.4f} over {len(diffs)} draws, {len({r['q'] for r in rows})} prompts")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--bench", type=Path, default=Path("data/bench-smollm2-t1"))
    parser.add_argument("--eval-dir", type=Path, default=Path("/work/shared/eval_data"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in args.out.open()] if args.out.exists() else []
    done = {r["q"] for r in rows}
    target, tokenizer = load_target("default")
    methods = [f"spd-n{args.stages}", f"spd-n{args.stages}+retrieval"]
    runners = {m: build_runner(MethodSpec.parse(m), target, "default") for m in methods}
    anchors = sorted({a for r in runners.values() for a in r.replay_anchors})
    ar = {str(r["question_id"]): r["tokens"] for r in read_records(args.bench / "per_prompt.jsonl")
          if r["method"] == "ar" and r["dataset"] == args.dataset and r["temperature"] == args.temperature}
    with args.out.open("a") as out:
        for prompt in read_questions(args.eval_dir / args.dataset / "question.jsonl", args.dataset, None):
            qid = str(prompt.question_id)
            if qid in done or qid not in ar:
                continue
            ids, tokens = encode(prompt, tokenizer), ar[qid]   # as the bench encoded it
            snapshots = sequence_snapshots(target, ids + tokens, anchors)
            base = prompt_seed(0, args.dataset, prompt.question_id, args.temperature)
            for draw in range(args.draws):
                params = SamplingParams(temperature=args.temperature, seed=(base + 7919 * draw) % 2**31)
                for m in methods:
                    f = runners[m].replay(ids, tokens, len(tokens), snapshots, params)
                    row = {"q": qid, "draw": draw, "method": m, "cycles": f["cycles"], "verified": f["verified"],
                           "accepted": f["accepted"], "decode_tokens": max(0, len(tokens) - 1)}
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
            out.flush()
    print(summarize(rows, args.stages))


if __name__ == "__main__":
    main()
