"""Tree SPD on the evaluation prompts with the shipped PDMs (issue 20): the real engine, per width.

For the first --limit prompts of each dataset (first turn, chat template, greedy), runs
`spd.engine.generate` with the hybrid drafter of the shipped PDM for n = --stages at every
--width, checks the tokens against the cached batch-1 AR continuation (data/acceptance-smollm2/
ar_exact_256.jsonl), and records cycles, per-position acceptance, mean width, stage tokens and
decode seconds. Rows go to OUT/tree_rows.jsonl (resumable); OUT/tree_summary.md sums them.

    python scripts/tree_report.py --stages 4 --width 1 --width 2 --width 4 --limit 10 \
        --max-new-tokens 128 --out runs/tree
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from spd.checkpoint import load_pdm
from spd.engine import generate
from spd.loading import encode_prompt
from spd.retrieval import Gate, make_drafter
from spd.shipped import shipped_pdm
from spd.target import load_target, split_layers
from spd.tree import TreeConfig

DATASETS = ("mt_bench", "gsm8k", "humaneval")


def load_prompts(eval_dir: Path, limit: int, datasets=DATASETS) -> list[tuple[str, int, str]]:
    rows = []
    for name in datasets:
        with open(eval_dir / name / "question.jsonl") as f:
            rows += [(name, i, json.loads(line)["turns"][0]) for i, line in enumerate(f) if i < limit]
    return sorted(rows, key=lambda r: (r[1], DATASETS.index(r[0])))   # datasets in turn: a partial run is balanced


def summarize(rows: list[dict]) -> str:
    lines = ["| n | W | prompts | tokens == AR | per-position acceptance | mean width | n*N/C | "
             "stage tokens per cycle | decode tok/s (engine, this CPU) |", "|---" * 9 + "|"]
    for key in sorted({(r["n"], r["width"]) for r in rows}):
        sel = [r for r in rows if (r["n"], r["width"]) == key]
        total = lambda name: sum(r[name] for r in sel)  # noqa: E731
        verified = total("accepted") + total("rejected")
        n = key[0]
        lines.append(f"| {n} | {key[1]} | {len(sel)} | {sum(r['match'] for r in sel)}/{len(sel)} | "
                     f"{total('accepted') / verified:.3f} | {total('verified_candidates') / verified:.2f} | "
                     f"{n * total('new_tokens') / total('cycles'):.3f} | {total('stage_tokens') / total('cycles'):.2f} | "
                     f"{(total('new_tokens') - len(sel)) / total('decode_seconds'):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--width", type=int, action="append", required=True)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eval-dir", type=Path, default=Path("/work/shared/eval_data"))
    parser.add_argument("--ar", type=Path, default=Path("data/acceptance-smollm2/ar_exact_256.jsonl"))
    parser.add_argument("--out", type=Path, default=Path("runs/tree"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--datasets", default=",".join(DATASETS),
                        help="comma-separated subset (one process per set shares the cores: give each its own --out)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "tree_rows.jsonl"
    rows = [json.loads(line) for line in rows_path.open()] if rows_path.exists() else []
    done = {(r["n"], r["width"], r["dataset"], r["index"]) for r in rows}
    ar = {(r["dataset"], r["index"]): r["continuation"] for r in map(json.loads, args.ar.open())}

    target, tokenizer = load_target("default")
    folder = shipped_pdm("default", args.stages, None)
    pdm, gate = load_pdm(folder, target), Gate.load(folder)
    stages = split_layers(target.num_layers, args.stages, list(pdm.config.stage_layers))
    with rows_path.open("a") as out:
        for name, index, text in load_prompts(args.eval_dir, args.limit, args.datasets.split(",")):
            ids = encode_prompt(tokenizer, text)
            for width in args.width:
                if (args.stages, width, name, index) in done:
                    continue
                r = generate(target, make_drafter("hybrid", pdm, gate), ids, stages,
                             max_new_tokens=args.max_new_tokens, tree=TreeConfig(width))
                s = r.stats
                row = {"n": args.stages, "width": width, "dataset": name, "index": index,
                       "match": r.tokens == ar[(name, index)][:len(r.tokens)], "new_tokens": s.new_tokens,
                       "cycles": s.cycles, "accepted": s.accepted, "rejected": s.rejected,
                       "verified_candidates": s.verified_candidates, "stage_tokens": s.stage_tokens,
                       "decode_seconds": s.decode_seconds, "pdm_seconds": s.pdm_seconds,
                       "stage_seconds": s.stage_seconds, "drafts_by_source": s.drafts_by_source,
                       "cycles_by_width": s.cycles_by_width}
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(name, index, width, row["match"], s.cycles, s.accepted, s.rejected, flush=True)
    text = summarize(rows) + "\n\nPer dataset:\n\n" + "\n\n".join(
        f"{name}:\n" + summarize([r for r in rows if r["dataset"] == name]) for name in DATASETS)
    (args.out / "tree_summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
