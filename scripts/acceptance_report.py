"""Acceptance report for PDMs on the evaluation prompts (MT-Bench, GSM8K, HumanEval; issue 4).

For each prompt (first turn, chat template, greedy, --max-new-tokens):
1. the target's greedy continuation, made once with batched `generate` (OUT/ar_N.jsonl);
2. SPD's counts for every given PDM by `spd.bench.acceptance.replay` (one full forward, then the
   engine's schedule with the real PDM drafter): acceptance rate, per-draft acceptance,
   equivalent accept length n*N/C;
3. on the first --engine-check prompts of each dataset (index 0 of every dataset first), the
   real single-process engine too: its tokens must equal AR's (`spd.baselines.ar`, batch 1,
   cached in OUT/ar_exact_N.jsonl) and its counts the replay's over those tokens (near-ties
   between a full-sequence forward and token-by-token decoding can flip a draft, so a counts
   mismatch alone is not a bug).

Writes OUT/per_prompt.jsonl (rows named folder@weights-digest, so a retrained PDM of the same
name starts afresh) and OUT/summary.md. Resumable: replayed rows are skipped, and a later run
with a larger --engine-check adds the engine to rows that lack it (on a CPU the engine costs
~2-4x an AR decode per prompt and PDM, so a full check can be spread over several runs; the
shipped PDMs' rows live in data/acceptance-smollm2, pass it as --out to continue them).

    python scripts/acceptance_report.py --pdm src/spd/assets/pdm/smollm2-135m-n2-15-15 \
        --pdm src/spd/assets/pdm/smollm2-135m-n4-8-8-7-7 --out runs/acceptance
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from spd.baselines.ar import ar_generate
from spd.bench.acceptance import replay, sequence_snapshots
from spd.bench.report import by_source
from spd.checkpoint import WEIGHTS, load_pdm
from spd.engine import generate
from spd.loading import encode_prompt
from spd.retrieval import GATE_FILE, Gate, make_drafter
from spd.target import load_target, split_layers

DATASETS = ("mt_bench", "gsm8k", "humaneval")


def load_prompts(eval_dir: Path, limit: int | None) -> list[tuple[str, int, str]]:
    rows = []
    for name in DATASETS:
        with open(eval_dir / name / "question.jsonl") as f:
            for i, line in enumerate(f):
                if limit is not None and i >= limit:
                    break
                rows.append((name, i, json.loads(line)["turns"][0]))
    return rows


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()] if path.exists() else []


@torch.inference_mode()
def ar_continuations(model_path, tokenizer, prompts, ids, max_new, batch, cache_path: Path) -> dict:
    """Greedy continuations by batched generate (left padding), cached by (dataset, index)."""
    done = {(r["dataset"], r["index"]): r["continuation"] for r in read_jsonl(cache_path)}
    todo = [i for i, (name, index, _) in enumerate(prompts) if (name, index) not in done]
    if not todo:
        return done
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    todo.sort(key=lambda i: len(ids[i]))  # similar lengths together: less padding
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    with cache_path.open("a") as out:
        for start in tqdm(range(0, len(todo), batch), desc="AR continuations"):
            chunk = todo[start:start + batch]
            width = max(len(ids[i]) for i in chunk)
            input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk])
            mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk])
            gen = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new, pad_token_id=pad)
            for row, i in zip(gen[:, width:].tolist(), chunk):
                cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
                name, index, _ = prompts[i]
                done[(name, index)] = row[:cut]
                out.write(json.dumps({"dataset": name, "index": index, "continuation": row[:cut]}) + "\n")
                out.flush()
    return done


def pdm_label(folder) -> str:
    """Folder name @ weights digest: rows of a retrained PDM with the same name never mix in."""
    digest = hashlib.sha256((Path(folder) / WEIGHTS).read_bytes()).hexdigest()[:8]
    return f"{Path(folder).name}@{digest}"


def row_key(row: dict) -> tuple[str, str, int]:
    return row["pdm"], row["dataset"], row["index"]


def drafter_label(folder, kind: str) -> str:
    """pdm rows: folder@weights; hybrid rows also name the gate's digest (a refit starts afresh)."""
    if kind == "pdm":
        return pdm_label(folder)
    gate = Path(folder) / GATE_FILE
    digest = hashlib.sha256(gate.read_bytes()).hexdigest()[:8] if gate.is_file() else "default"
    return f"{pdm_label(folder)}+{kind}@{digest}"


def replay_rows(target, pdms, prompt_ids, continuation, anchors) -> list[dict]:
    """Replay counts of every (name, PDM, drafter kind, gate) over one continuation, from one
    shared target forward."""
    snapshots = sequence_snapshots(target, prompt_ids + continuation, anchors)
    rows = []
    for name, pdm, kind, gate in pdms:
        s = replay(target, make_drafter(kind, pdm, gate), prompt_ids, continuation, pdm.config.n_stages, snapshots)
        rows.append({"pdm": name, "n_stages": pdm.config.n_stages, "new_tokens": s.new_tokens,
                     "cycles": s.cycles, "accepted": s.accepted, "rejected": s.rejected,
                     "drafts_by_source": s.drafts_by_source})
    return rows


def summarize(rows: list[dict], pdm_names: list[str]) -> str:
    lines = ["| PDM | dataset | prompts | new tokens | cycles | acceptance rate | per-draft acceptance | "
             "equivalent accept length | drafts from retrieval | acceptance: pdm / retrieval / both | "
             "engine tokens == AR | engine counts == replay |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pdm in pdm_names:
        for name in (*DATASETS, "overall"):
            sel = [r for r in rows if r["pdm"] == pdm and (name == "overall" or r["dataset"] == name)]
            if not sel:
                continue
            n = sel[0]["n_stages"]
            tokens, cycles = sum(r["new_tokens"] for r in sel), sum(r["cycles"] for r in sel)
            acc, rej = sum(r["accepted"] for r in sel), sum(r["rejected"] for r in sel)
            checked = [r for r in sel if "engine_match" in r]
            same_tokens, same_counts = (sum(r[k] for r in checked) for k in ("engine_match", "counts_match"))
            sources = by_source(sel)
            share, acceptance = sources["retrieval_share"], sources["acceptance_by_source"]
            by = " / ".join(f"{acceptance[k]:.3f}" if acceptance.get(k) is not None else "-"
                            for k in ("pdm", "retrieval", "both"))
            lines.append(f"| {pdm} | {name} | {len(sel)} | {tokens} | {cycles} | {tokens / cycles:.3f} | "
                         f"{acc / max(1, acc + rej):.3f} | {n * tokens / cycles:.2f} | "
                         f"{'-' if share is None else f'{share:.3f}'} | {by if acceptance else '-'} | "
                         f"{same_tokens}/{len(checked)} | {same_counts}/{len(checked)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--pdm", action="append", required=True, help="PDM checkpoint folder (repeat)")
    ap.add_argument("--eval-dir", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "eval_data")
    ap.add_argument("--limit", type=int, default=None, help="prompts per dataset (default: all 80)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--engine-check", type=int, default=3, help="prompts per dataset also run by the engine")
    ap.add_argument("--shard", default="0/1", help="K/M: this process does every M-th prompt from "
                    "the K-th (run M processes, then once more without --shard for the whole table)")
    ap.add_argument("--drafter", action="append", choices=["pdm", "hybrid"],
                    help="drafter(s) per PDM (repeat; default pdm): hybrid = retrieval beside the PDM "
                         "with the gate saved in the PDM folder (spd gate)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/acceptance"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shard, shards = map(int, args.shard.split("/"))
    if not 0 <= shard < shards:
        ap.error(f"--shard {args.shard}: want K/M with 0 <= K < M")
    args.out.mkdir(parents=True, exist_ok=True)

    target, tokenizer = load_target(args.model)
    from spd.default_target import resolve_model_path
    prompts = load_prompts(args.eval_dir, args.limit)
    ids = [encode_prompt(tokenizer, text) for _, _, text in prompts]
    conts = ar_continuations(resolve_model_path(args.model), tokenizer, prompts, ids, args.max_new_tokens, args.batch,
                             args.out / f"ar_{args.max_new_tokens}.jsonl")

    rows_path = args.out / "per_prompt.jsonl"
    rows = {row_key(r): r for r in read_jsonl(rows_path)}  # a later line (with a check) wins
    pdms = [(drafter_label(folder, kind), load_pdm(folder, target), kind, Gate.load(folder))
            for folder in args.pdm for kind in args.drafter or ["pdm"]]
    anchors = sorted({a for _, pdm, _, _ in pdms for a in pdm.anchors})
    with rows_path.open("a") as out:
        def keep(row: dict) -> None:
            rows[row_key(row)] = row
            out.write(json.dumps(row) + "\n")
            out.flush()

        # 1. Replay every prompt on the batched continuation: cheap, gives the table's counts.
        for i, (dataset, index, _) in enumerate(tqdm(prompts, desc="replay")):
            if i % shards != shard:
                continue
            todo = [entry for entry in pdms if (entry[0], dataset, index) not in rows]
            if todo:
                for row in replay_rows(target, todo, ids[i], conts[(dataset, index)], anchors):
                    keep({"dataset": dataset, "index": index, **row})

        # 2. The real engine against plain AR decoding, prompt index 0 of every dataset first,
        # so a run cut short still covers all three; already checked rows are skipped.
        order = sorted(range(len(prompts)), key=lambda i: (prompts[i][1], DATASETS.index(prompts[i][0])))
        order = [i for i in order if prompts[i][1] < args.engine_check][shard::shards]
        order = [i for i in order if any("engine_match" not in rows.get((entry[0], *prompts[i][:2]), {})
                                         for entry in pdms)]
        exact_path = args.out / f"ar_exact_{args.max_new_tokens}.jsonl"
        exact = {(r["dataset"], r["index"]): r["continuation"] for r in read_jsonl(exact_path)}
        for i in tqdm(order, desc="engine check"):
            dataset, index, _ = prompts[i]
            if (dataset, index) not in exact:  # batch-1 AR, cached: later runs check other PDMs
                exact[(dataset, index)], _ = ar_generate(target, ids[i], max_new_tokens=args.max_new_tokens)
                with exact_path.open("a") as f:
                    f.write(json.dumps({"dataset": dataset, "index": index,
                                        "continuation": exact[(dataset, index)]}) + "\n")
            ar = exact[(dataset, index)]
            todo = [entry for entry in pdms if "engine_match" not in rows.get((entry[0], dataset, index), {})]
            replays = {row["pdm"]: row for row in replay_rows(target, todo, ids[i], ar, anchors)}
            for name, pdm, kind, gate in todo:
                stages = split_layers(target.num_layers, pdm.config.n_stages, list(pdm.config.stage_layers))
                real = generate(target, make_drafter(kind, pdm, gate), ids[i], stages,
                                max_new_tokens=args.max_new_tokens)
                counts = (real.stats.cycles, real.stats.accepted)
                keep({"dataset": dataset, "index": index, **replays[name],
                      "engine_match": real.tokens == ar, "batched_ar_match": ar == conts[(dataset, index)],
                      "counts_match": counts == (replays[name]["cycles"], replays[name]["accepted"]),
                      "engine_tokens_per_second": real.stats.decode_tokens_per_second})
    rows = {row_key(r): r for r in read_jsonl(rows_path)}  # the file also holds other shards' rows
    table = summarize(list(rows.values()), [entry[0] for entry in pdms])
    (args.out / "summary.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
