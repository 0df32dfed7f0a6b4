"""Summary rows (one per method x dataset x temperature, plus "overall") from per-prompt records.

Every number is a ratio of sums over the group's prompts (token-weighted), computed from the
records alone plus each method's measured draft-cost fraction (run.json), so a test can
recompute them:

- decode_tokens = sum(new_tokens - 1); tokens_per_second = decode_tokens / sum(decode_seconds)
- per_draft_acceptance = accepted drafts / verified drafts
- mean_accepted_length = decode tokens per target forward of target work: AR 1, EAGLE-style
  decode_tokens / target_forwards, SPD / PPSD n * decode_tokens / cycles
- equivalent_accept_length (SPD / PPSD, SPEC section 6) = n * new_tokens / cycles
- theoretical_speedup = decode_tokens / sum(decode cost) on the common cost model (costs.py)
- measured_cost_speedup = the same with each verification forward of T tokens priced at its
  measured v_T (costs.measured_decode_cost; None where not measured)
- mean_tree_size (EAGLE-style) = drafts sent to the target per target forward (chain: up to k,
  tree: up to its budget B)
- wall_clock_ratio = tokens_per_second / AR's tokens_per_second over the same prompts (records
  with timings only: replayed ones have none)
- replayed = records from a replay over AR's tokens (`spd bench run --replay`; sampled: AR's sample);
  replay_checked / replay_agreed = decoded records whose replay was also run / gave equal counts
- acceptance_by_position[i] = accepted / verified drafts at position i+1 (fill or chain index)

The run folder's files are named here too (OUT/per_prompt.jsonl, run.json, summary.json,
summary.md), with `read_records` and `write_json`, so the harness that writes them and the
report that reads them share one definition (the harness imports this module, not the reverse).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path

from . import OVERALL, costs

log = logging.getLogger(__name__)

RECORDS, RUN, SUMMARY_JSON, SUMMARY_MD = "per_prompt.jsonl", "run.json", "summary.json", "summary.md"
FIELDS = ("method", "kind", "n", "k", "dataset", "temperature", "prompts", "new_tokens", "decode_tokens",
          "cycles", "target_forwards", "draft_forwards", "verified_drafts", "accepted_drafts",
          "per_draft_acceptance", "mean_accepted_length", "equivalent_accept_length",
          "draft_cost_fraction", "decode_cost", "theoretical_speedup", "verify_cost_fraction",
          "measured_cost_speedup", "mean_tree_size", "decode_seconds",
          "tokens_per_second", "ar_tokens_per_second", "wall_clock_ratio", "greedy_checked",
          "greedy_mismatches", "verified_by_position", "acceptance_by_position", "untrained",
          "retrieval_share", "acceptance_by_source", "retrieval_ms", "replayed", "replay_checked",
          "replay_agreed")


def _ratio(a, b):
    return a / b if b else None


def _sum_lists(lists) -> list[int]:
    width = max((len(x) for x in lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(width)]


def summarize_group(records: list[dict], dataset: str, fraction: float, ar_records: list[dict],
                    verify: dict | None = None) -> dict:
    """One summary row from one method's records of one group (and AR's of the same group);
    `verify`: the method's measured verification cost (run.json), if any."""
    first = records[0]
    kind, n = first["kind"], first["n"]
    decode_tokens = sum(r["decode_tokens"] for r in records)
    new_tokens = sum(r["new_tokens"] for r in records)
    timed = [r for r in records if r["decode_seconds"] is not None]
    seconds = sum(r["decode_seconds"] for r in timed)
    cycles = sum(r["cycles"] for r in records) if kind in ("spd", "ppsd") else None
    forwards = sum(r["target_forwards"] for r in records) if kind in ("ar", "eagle") else None
    verified, accepted = sum(r["verified"] for r in records), sum(r["accepted"] for r in records)
    cost = sum(costs.decode_cost(r, fraction) for r in records)
    measured = [costs.measured_decode_cost(r, fraction, verify) for r in records]
    measured = None if any(m is None for m in measured) else sum(measured)
    drafted = sum(r.get("draft_tokens") or 0 for r in records) if kind == "eagle" else None
    if kind == "ar":
        mean_len = 1.0 if decode_tokens else None
    elif kind == "eagle":
        mean_len = _ratio(decode_tokens, forwards)
    else:
        mean_len = _ratio(n * decode_tokens, cycles)
    by_verified = _sum_lists([r["verified_by_position"] for r in records])
    by_accepted = _sum_lists([r["accepted_by_position"] for r in records])
    tps = _ratio(sum(r["decode_tokens"] for r in timed), seconds)
    asked = {str(r["question_id"]) for r in timed}
    same = [r for r in ar_records if str(r["question_id"]) in asked]
    ar_tps = _ratio(sum(r["decode_tokens"] for r in same), sum(r["decode_seconds"] for r in same))
    checked = [r for r in records if r.get("matches_ar") is not None]
    return {
        "method": first["method"], "kind": kind, "n": n, "k": first["k"], "dataset": dataset,
        "temperature": first["temperature"], "prompts": len(records), "new_tokens": new_tokens,
        "decode_tokens": decode_tokens, "cycles": cycles, "target_forwards": forwards,
        "draft_forwards": sum(r["draft_forwards"] for r in records), "verified_drafts": verified,
        "accepted_drafts": accepted,
        "per_draft_acceptance": _ratio(accepted, verified) if kind != "ar" else None,
        "mean_accepted_length": mean_len,
        "equivalent_accept_length": _ratio(n * new_tokens, cycles) if cycles is not None else None,
        "draft_cost_fraction": fraction, "decode_cost": cost,
        "theoretical_speedup": _ratio(decode_tokens, cost),
        "verify_cost_fraction": verify["fraction"] if verify else None,
        "measured_cost_speedup": _ratio(decode_tokens, measured) if measured is not None else None,
        "mean_tree_size": _ratio(drafted, forwards) if drafted is not None else None,
        "decode_seconds": seconds,
        "tokens_per_second": tps, "ar_tokens_per_second": ar_tps,
        "wall_clock_ratio": _ratio(tps, ar_tps) if tps is not None else None,
        "greedy_checked": len(checked), "greedy_mismatches": sum(1 for r in checked if not r["matches_ar"]),
        "verified_by_position": by_verified,
        "acceptance_by_position": [_ratio(a, v) for a, v in zip(by_accepted, by_verified)],
        "untrained": any(r.get("untrained") for r in records),
        "replayed": sum(1 for r in records if r.get("replayed")),
        "replay_checked": sum(1 for r in records if r.get("replay_agrees") is not None),
        "replay_agreed": sum(1 for r in records if r.get("replay_agrees")),
        **by_source(records),
    }


def by_source(records: list[dict]) -> dict:
    """Share of verified drafts from retrieval, and acceptance of each draft source."""
    counts = defaultdict(lambda: [0, 0])
    for r in records:
        for source, (verified, accepted) in (r.get("drafts_by_source") or {}).items():
            counts[source][0] += verified
            counts[source][1] += accepted
    total = sum(v for v, _ in counts.values())
    return {"retrieval_share": _ratio(counts["retrieval"][0], total) if "retrieval" in counts else None,
            "acceptance_by_source": {s: _ratio(a, v) for s, (v, a) in sorted(counts.items())}}


def summarize(records: list[dict], methods: dict) -> list[dict]:
    """Rows per (method, dataset, temperature) and per (method, "overall", temperature)."""
    groups = defaultdict(list)
    method_order, dataset_order = [], []
    for r in records:
        for dataset in (r["dataset"], OVERALL):
            groups[(r["method"], dataset, r["temperature"])].append(r)
        if r["method"] not in method_order:
            method_order.append(r["method"])
        if r["dataset"] not in dataset_order:
            dataset_order.append(r["dataset"])
    dataset_order.append(OVERALL)
    rows = []
    temperatures = sorted({r["temperature"] for r in records})
    for t in temperatures:
        for method in method_order:
            for dataset in dataset_order:
                group = groups.get((method, dataset, t))
                if not group:
                    continue
                fraction = methods.get(method, {}).get("draft_fraction", 0.0)
                row = summarize_group(group, dataset, fraction, groups.get(("ar", dataset, t), []),
                                      methods.get(method, {}).get("verify_cost"))
                rows.append({**row, "retrieval_ms": methods.get(method, {}).get("retrieval_ms")})
    return rows


def _fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(rows: list[dict]) -> str:
    """The full table, then theoretical / wall-clock speedup per dataset (SPEC section 9 style)."""
    head = ("| method | dataset | T | prompts | new tokens | cycles / target fwd | per-draft acc. | "
            "from retrieval | acc. by source | tree size | mean acc. len | draft cost | retrieval ms | "
            "theor. speedup | verify cost | speedup at measured verify cost | tok/s | wall-clock vs AR | greedy = AR |")
    lines = [head, "|" + "---|" * 19]
    for r in rows:
        steps = r["cycles"] if r["cycles"] is not None else r["target_forwards"]
        greedy = f"{r['greedy_checked'] - r['greedy_mismatches']}/{r['greedy_checked']}" if r["greedy_checked"] else "-"
        if r.get("replayed"):
            greedy += f" (+{r['replayed']} replayed; replay = decode {r['replay_agreed']}/{r['replay_checked']})"
        name = r["method"] + (" (untrained)" if r["untrained"] else "")
        by_source = ", ".join(f"{k} {_fmt(v)}" for k, v in (r.get("acceptance_by_source") or {}).items()) or "-"
        lines.append(f"| {name} | {r['dataset']} | {r['temperature']:g} | {r['prompts']} | {r['new_tokens']} | "
                     f"{steps} | {_fmt(r['per_draft_acceptance'])} | {_fmt(r.get('retrieval_share'))} | "
                     f"{by_source} | {_fmt(r.get('mean_tree_size'))} | {_fmt(r['mean_accepted_length'])} | "
                     f"{_fmt(r['draft_cost_fraction'], 3)} | {_fmt(r.get('retrieval_ms'), 3)} | "
                     f"{_fmt(r['theoretical_speedup'])} | {_fmt(r.get('verify_cost_fraction'))} | "
                     f"{_fmt(r.get('measured_cost_speedup'))} | "
                     f"{_fmt(r['tokens_per_second'], 1)} | {_fmt(r['wall_clock_ratio'])} | {greedy} |")
    lines += ["", paper_table(rows)]
    for t in sorted({r["temperature"] for r in rows}):
        datasets = [d for d in dict.fromkeys(r["dataset"] for r in rows if r["temperature"] == t)]
        datasets = [OVERALL] + [d for d in datasets if d != OVERALL]
        lines += ["", f"theoretical / wall-clock speedup vs AR, T={t:g}", "",
                  "| method | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
        by = {(r["method"], r["dataset"]): r for r in rows if r["temperature"] == t}
        for method in dict.fromkeys(r["method"] for r in rows if r["temperature"] == t):
            cells = [f"{_fmt(by[(method, d)]['theoretical_speedup'])} / {_fmt(by[(method, d)]['wall_clock_ratio'])}"
                     if (method, d) in by else "-" for d in datasets]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paper_table(rows: list[dict]) -> str:
    """The paper's form: per temperature, method and dataset the theoretical speedup, the mean
    accepted length tau and the per-draft acceptance alpha; overall also at the measured verify cost."""
    lines = []
    for t in sorted({r["temperature"] for r in rows}):
        mine = [r for r in rows if r["temperature"] == t]
        datasets = [d for d in dict.fromkeys(r["dataset"] for r in mine) if d != OVERALL] + [OVERALL]
        by = {(r["method"], r["dataset"]): r for r in mine}
        lines += [f"speedup (common cost model) / mean accepted length tau / per-draft acceptance alpha, T={t:g}", "",
                  "| method | " + " | ".join(datasets) + " | overall at measured verify cost |",
                  "|---|" + "---|" * (len(datasets) + 1)]
        for method in dict.fromkeys(r["method"] for r in mine):
            cells = []
            for d in datasets:
                r = by.get((method, d))
                cells.append("-" if r is None else f"{_fmt(r['theoretical_speedup'])}x / "
                             f"{_fmt(r['mean_accepted_length'])} / {_fmt(r['per_draft_acceptance'])}")
            overall = by.get((method, OVERALL))
            measured = _fmt(overall.get("measured_cost_speedup")) + "x" if overall and overall.get("measured_cost_speedup") else "-"
            untrained = " (untrained)" if overall and overall["untrained"] else ""
            lines.append(f"| {method}{untrained} | " + " | ".join(cells) + f" | {measured} |")
        lines.append("")
    return "\n".join(lines)


def read_records(path: Path) -> list[dict]:
    """Every complete record; a torn last line (a run killed mid-write) is dropped from the file."""
    if not path.is_file():
        return []
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    if bad:
        log.warning("%s: dropping %d unreadable line(s) (an interrupted write)", path, bad)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        os.replace(tmp, path)
    return records


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def write_report(out: Path, rows: list[dict], plots: bool = True) -> None:
    write_json(out / SUMMARY_JSON, rows)
    (out / SUMMARY_MD).write_text(markdown(rows))
    if plots and rows:
        from .plots import plot_all
        plot_all(rows, out)


def report_from_disk(out) -> list[dict]:
    """Rebuild summary + plots from OUT/per_prompt.jsonl and OUT/run.json (no decoding)."""
    out = Path(out)
    if not (out / RECORDS).is_file():
        raise FileNotFoundError(f"{out} holds no {RECORDS}; run `spd bench run --out {out}` first")
    methods = json.loads((out / RUN).read_text())["methods"] if (out / RUN).is_file() else {}
    rows = summarize(read_records(out / RECORDS), methods)
    write_report(out, rows)
    return rows
