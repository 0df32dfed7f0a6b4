"""`spd bench wallclock`: AR vs distributed SPD decode tokens/s, same run, same prompts, same cores.

Per prompt, in turn (so a change in machine load hits both alike): AR decoding in this process
with `--ar-threads` (default: every core), then distributed SPD with each drafter, its
processes pinned to `--threads` each (default: cores / processes). The oracle drafter (the AR
continuation: every draft accepted) is the upper bound of a perfect PDM; `pdm` is the shipped
PDM for the split when there is one, else a random one (nearly every draft rejected). The AR
model lives only in this harness process, for the baseline; the SPD control rank's own Target
holds only embedding, norm and lm_head (+ stage 0 when co-located).
`--split auto` (the default) first times the parts on this device (`planner.measure_costs`:
one layer alone and with the other cores busy, the head, each drafter, one message) and picks,
per drafter, the split with the shortest predicted cycle for that drafter's draft cost, keeping
the PDM's anchors at every depth; drafters with the same split share one set of processes.
`--questions FILE` takes the prompts from EAGLE-format question files instead of the built-ins.
Every drafter's result carries `predicted_tokens_per_second` from that cost model, the run's
acceptance by fill and the drafter's mean draft time, next to the measured one.
Two ratios everywhere: against AR on the same total cores (every thread) and against AR on one
thread (one device: the paper's framing, n devices against one). `--tree-width W` runs every
drafter as a token tree of W candidates per level (spd.tree; the oracle's first candidate is
AR's token); lookahead is off then, and the cost model, which prices one token per stage, makes
no prediction.
This is a benchmark, not a test: it prints what it measured, and the ratio can fall short.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import typer

log = logging.getLogger(__name__)

PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python lists and tuples?",
    "Give me three tips for staying focused while studying.",
]


@dataclass(frozen=True)
class WallclockOptions:
    """What `spd bench wallclock` runs (the CLI's options)."""

    model: str = "default"
    stages: int = 2
    split: list[int] | str | None = "auto"   # layers per stage, or "auto" (balanced per drafter)
    draft_rank: str = "with-first-stage"
    drafters: tuple[str, ...] = ("oracle", "pdm", "hybrid")
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    source: str = "built-in"                 # where the prompts came from, for the report
    max_new_tokens: int = 64
    ar_threads: tuple[int, ...] = ()          # default: every core, and 1
    threads: int | None = None                # per SPD process (default: cores / processes)
    pdm: str | None = None
    dtype: str = "float32"
    lookahead: str = "auto"
    head: str = "last"
    tree_width: int = 1


def weighted_breakdown(runs: list[dict]) -> dict:
    """Cycle-weighted mean of per-run breakdowns."""
    total = sum(b["cycles"] for b in runs)
    keys = ["cycle_ms", "pdm_ms", "slowest_stage_ms", "verify_ms", "communication_ms", "idle_ms"]
    out = {key: sum(b[key] * b["cycles"] for b in runs) / total for key in keys}
    out["stage_ms"] = [sum(b["stage_ms"][k] * b["cycles"] for b in runs) / total for k in range(len(runs[0]["stage_ms"]))]
    out["cycles"] = total
    return out


def choose_split(costs, stages: int, draft_rank: str, head: str, drafters, pdm: str | None) -> list[int]:
    """`--split auto`: the balanced split for the mean draft cost of the given drafters, where the
    PDM (which the processes load whatever the drafter) sees the anchors it was trained with."""
    from ..checkpoint import read_config
    from ..pdm import types_by_depth
    from .planner import balanced_split

    allowed = None
    if pdm is not None:
        config = read_config(pdm)
        want = types_by_depth(list(config.stage_layers), config.anchors)
        allowed = lambda d, b: sum(a <= b for a in config.anchors) == want[d]  # noqa: E731
    draft = sum(costs.draft_ms.get(d, 0.0) for d in drafters) / len(drafters)
    return list(balanced_split(costs, stages, draft_rank, head, draft, allowed))


def measure_device_costs(model: str, stages: int, dtype: str, drafters, pdm: str | None, target, context: int = 64):
    """Time layer, head, message and each drafter's call on this device (planner.measure_costs),
    after `context` positions (a layer's attention, and so its cost, grows with the context)."""
    from ..checkpoint import load_pdm
    from ..retrieval import Gate, make_drafter
    from .costs import pipeline_draft_step
    from .planner import measure_costs

    calls = {}
    if pdm is not None:
        loaded = load_pdm(pdm, target)
        for name in drafters:
            if name != "oracle":
                calls[name] = pipeline_draft_step(target, make_drafter(name, loaded, Gate.load(pdm)), stages, context)
    costs = measure_costs(target, calls, context)
    return costs


def measure(options: WallclockOptions) -> dict:
    """Run the benchmark; returns {ar: {...}, <drafter>: {...}, costs: {...}, settings: {...}}."""
    from dataclasses import asdict

    from ..loading import encode_prompt, parse_dtype
    from ..runtime import plan
    from ..target import load_target

    o = options
    model, stages, split, draft_rank, drafters = o.model, o.stages, o.split, o.draft_rank, o.drafters
    max_new_tokens, threads, dtype, head, width = o.max_new_tokens, o.threads, o.dtype, o.head, o.tree_width
    lookahead = "off" if width > 1 and o.lookahead == "auto" else o.lookahead   # a tree verifies before it drafts on
    auto = split == "auto"
    run_options = dict(dtype=dtype, threads=threads, timeout=60.0, lookahead=lookahead, head=head, tree_width=width)
    spec = plan(model, stages, None if auto else split, draft_rank, o.pdm, **run_options)
    target, tokenizer = load_target(spec.model, dtype=parse_dtype(dtype))
    texts = o.prompts
    ids = [encode_prompt(tokenizer, text) if tokenizer is not None else [1, 2, 3] for text in texts]
    # costs at the mean context of the decode (prompt + half the new tokens), where the run spends its time
    context = round(sum(map(len, ids)) / len(ids) + max_new_tokens / 2)
    costs = measure_device_costs(model, stages, dtype, drafters, spec.pdm, target, context)
    split_of, specs = session_specs(costs, spec, o, run_options)
    cores = os.cpu_count() or 1
    ar_threads = tuple(o.ar_threads) or tuple(sorted({cores, 1}, reverse=True))
    spd_threads = spec.threads or max(1, cores // spec.layout.world_size)
    results = {"ar": {t: {"threads": t, "tokens": 0, "seconds": 0.0} for t in ar_threads}}
    results.update({name: {"tokens": 0, "seconds": 0.0, "cycles": 0, "accepted": 0, "rejected": 0,
                           "identical": True, "breakdowns": [], "split": list(split_of[name]),
                           "verified_candidates": 0} for name in drafters})

    for t in ar_threads:
        run_ar(target, ids[0], 8, t)   # warm-up
    load_before = load_average()
    run_prompts(target, specs, ids, results, drafters=drafters, split_of=split_of, ar_threads=ar_threads,
                spd_threads=spd_threads, max_new_tokens=max_new_tokens, stages=stages)
    add_rates(results, costs, o, prompts=len(ids), head=spec.head, lookahead=lookahead)
    results["settings"] = {"model": model, "stage_layers": sorted({tuple(r) for r in split_of.values()}), "draft_rank": draft_rank,
                           "processes": spec.layout.world_size, "cores": cores, "ar_threads": list(ar_threads),
                           "load_average_before": load_before, "load_average_after": load_average(),
                           "spd_threads_per_process": spd_threads, "prompts": len(ids), "prompt_source": o.source,
                           "max_new_tokens": max_new_tokens, "dtype": dtype, "lookahead": lookahead,
                           "pdm": spec.pdm or "random (no shipped PDM for this split)",
                           "split": "auto" if auto else "given", "head": spec.head, "cost_context": context,
                           "tree_width": width}
    results["costs"] = asdict(costs)
    return results


def session_specs(costs, spec, o: WallclockOptions, run_options: dict) -> tuple[dict, dict]:
    """({drafter: its split}, {split: the runtime spec its processes start from}).

    --split auto: each drafter gets the split balanced for its own draft cost (the oracle's rank 0
    has no PDM to run); drafters that share a split share one set of processes."""
    from ..runtime import plan

    auto = o.split == "auto"
    split_of = {name: tuple(choose_split(costs, o.stages, o.draft_rank, o.head, [name], spec.pdm) if auto
                            else spec.stage_layers) for name in o.drafters}
    specs = {}
    for chosen in dict.fromkeys(split_of.values()):
        specs[chosen] = spec if not auto else plan(o.model, o.stages, list(chosen), o.draft_rank, spec.pdm, **run_options)
        log.warning("--split auto: %s for %s (%s), head on %s", list(chosen), o.draft_rank,
                    ", ".join(d for d in o.drafters if split_of[d] == chosen), o.head)
    return split_of, specs


def load_average() -> float | None:
    """The 1-minute load average, where the OS has one (for the report)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def run_ar(target, prompt: list[int], new: int, threads: int):
    """AR decoding in this process with `threads` torch threads, EOS ignored: (tokens, stats)."""
    import torch

    from ..baselines.ar import ar_generate

    torch.set_num_threads(threads)
    return ar_generate(target, prompt, max_new_tokens=new, eos_token_ids=())


def run_prompts(target, specs: dict, ids: list[list[int]], results: dict, *, drafters, split_of: dict,
                ar_threads: tuple[int, ...], spd_threads: int, max_new_tokens: int, stages: int) -> None:
    """Decode every prompt with AR at each thread count and with each drafter, adding the counts
    and times to `results`; every drafter's tokens are compared with AR's."""
    import torch

    from ..drafters import OracleDrafter
    from ..runtime import start

    # one set of processes at a time (one process group per process); AR runs beside every set,
    # prompt by prompt, so a change in load hits both alike
    for chosen, session_spec in specs.items():
        with start(session_spec) as session:
            torch.set_num_threads(spd_threads)
            session.generate(ids[0], OracleDrafter([]), max_new_tokens=8, eos_token_ids=())   # warm-up
            for prompt in ids:
                for t in ar_threads:
                    reference, ar_stats = run_ar(target, prompt, max_new_tokens, t)
                    results["ar"][t]["tokens"] += ar_stats.new_tokens - 1
                    results["ar"][t]["seconds"] += ar_stats.decode_seconds
                torch.set_num_threads(spd_threads)
                for name in (d for d in drafters if split_of[d] == chosen):
                    drafter = OracleDrafter(reference) if name == "oracle" else session.drafter(name)
                    out = session.generate(prompt, drafter, max_new_tokens=max_new_tokens, eos_token_ids=())
                    add_run(results[name], out, reference, stages)
                    log.info("%s: %d tokens in %.2f s", name, out.stats.new_tokens, out.stats.decode_seconds)


def add_rates(results: dict, costs, o: WallclockOptions, *, prompts: int, head: str, lookahead: str) -> None:
    """Turn the running totals into rates, in place: AR's tokens/s per thread count (a list from
    here on); each drafter's tokens/s, ratios against AR, acceptance, cycle breakdown and, for
    the chain, the cost model's prediction."""
    for r in results["ar"].values():
        r["tokens_per_second"] = r["tokens"] / r["seconds"]
    best = max(results["ar"].values(), key=lambda r: r["tokens_per_second"])
    results["ar"] = list(results["ar"].values())
    ar_rate, all_cores = best["tokens_per_second"], results["ar"][0]["tokens_per_second"]
    one_thread = min(results["ar"], key=lambda r: r["threads"])["tokens_per_second"]
    for name in o.drafters:
        r = results[name]
        r["tokens_per_second"] = r["tokens"] / r["seconds"]
        r["ratio_vs_ar"] = r["tokens_per_second"] / ar_rate   # against the fastest AR setting
        r["ratio_vs_ar_first_setting"] = r["tokens_per_second"] / all_cores
        r["ratio_vs_ar_all_cores"] = r["tokens_per_second"] / all_cores      # same total cores
        r["ratio_vs_ar_one_thread"] = r["tokens_per_second"] / one_thread    # one device
        r["tokens_per_cycle"] = (r["tokens"] + prompts) / r["cycles"] if r["cycles"] else 0.0
        r["per_draft_acceptance"] = r["accepted"] / max(1, r["accepted"] + r["rejected"])   # per position in a tree
        r["mean_width"] = r["verified_candidates"] / max(1, r["accepted"] + r["rejected"])
        r["breakdown"] = weighted_breakdown(r.pop("breakdowns"))
        draft_ms = 1000.0 * r.pop("draft_seconds") / max(1, r["cycles"]) / costs.contention
        if o.tree_width == 1:   # the model prices one token per stage per cycle
            r.update(prediction(costs, r, name, draft_ms, head, o, lookahead))


def add_run(r: dict, out, reference: list[int], stages: int) -> None:
    """Add one SPD generation's counts and times to its drafter's running totals `r`."""
    s = out.stats
    for key in ("cycles", "accepted", "rejected", "verified_candidates"):
        r[key] += getattr(s, key)
    r["tokens"] += s.new_tokens - 1      # the first token comes from prefill, as for AR
    r["seconds"] += s.decode_seconds
    r["identical"] &= out.tokens == reference
    r["breakdowns"].append(s.breakdown)
    for key in ("verified_by_fill", "accepted_by_fill"):
        r[key] = [a + b for a, b in zip(r.get(key, [0] * stages), getattr(s, key))]
    r["draft_seconds"] = r.get("draft_seconds", 0.0) + s.pdm_seconds


def prediction(costs, r: dict, name: str, draft_ms: float, head: str, o: WallclockOptions, lookahead: str) -> dict:
    """The cost model's tokens/s for one drafter's run: device costs measured before the run, the
    run's acceptance by fill and the drafter's mean draft time in it (a hybrid's depends on how
    often it skips the PDM). Also its speedup over AR on one thread (AR priced from the same
    costs), against the measured one: a host whose speed drifts between the timing and the run
    moves both AR and SPD, so the ratio holds where tokens/s does not."""
    from .planner import acceptance_profile, predict

    guess = predict(costs, r["split"], o.draft_rank, head, acceptance_profile(r), name, draft_ms,
                    new_tokens=o.max_new_tokens, lookahead=None if lookahead == "auto" else lookahead == "on")
    return {"predicted_tokens_per_second": guess.tokens_per_second, "predicted_cycle_ms": guess.cycle_ms,
            "prediction_error": guess.tokens_per_second / r["tokens_per_second"] - 1.0,
            "predicted_ratio_vs_ar_one_thread": guess.vs_ar_one_device,
            "ratio_prediction_error": guess.vs_ar_one_device / r["ratio_vs_ar_one_thread"] - 1.0}


def format_report(results: dict) -> str:
    s = results["settings"]
    load = s["load_average_before"], s["load_average_after"]
    lines = [f"wall-clock: {s['model']}, n={len(s['stage_layers'][0])}, draft rank "
             f"{s['draft_rank']} ({s['processes']} processes x {s['spd_threads_per_process']} threads; "
             f"{s['cores']} cores), {s['prompts']} prompts x {s['max_new_tokens']} new tokens, {s['dtype']}"
             + f", lookahead {s['lookahead']}" + (f", tree width {s['tree_width']}" if s.get("tree_width", 1) > 1 else "")
             + (f"; load average {load[0]:.1f} -> {load[1]:.1f}" if load[0] is not None else "")]
    c = results["costs"]
    lines.append(f"  prompts: {s['prompt_source']}")
    lines.append(f"  split {s['split']}, head on {'the last stage' if s['head'] == 'last' else 'rank 0'}; device costs"
                 f"{' at context ' + str(s['cost_context']) if 'cost_context' in s else ''}: "
                 f"layer {c['layer_ms']:.2f} ms (x{c['contention']:.2f} with every core busy), head "
                 f"{c['head_ms']:.2f} ms, message {c['message_ms']:.2f} ms, draft "
                 + ", ".join(f"{k} {v:.2f}" for k, v in c["draft_ms"].items()) + " ms")
    for r in results["ar"]:
        lines.append(f"  AR ({r['threads']} threads)    {r['tokens_per_second']:7.2f} tok/s")
    for name, r in results.items():
        if name in ("ar", "settings", "costs"):
            continue
        label = f"SPD {name} {'/'.join(map(str, r['split']))}"
        predicted = (f"predicted {r['predicted_tokens_per_second']:.2f}, {r['prediction_error']:+.0%}"
                     if "predicted_tokens_per_second" in r else f"mean width {r['mean_width']:.2f}, no prediction")
        if "ratio_prediction_error" in r:
            predicted += (f"; x{r['predicted_ratio_vs_ar_one_thread']:.2f} AR 1 thread predicted, "
                          f"{r['ratio_prediction_error']:+.0%}")
        lines.append(f"  {label:<16} {r['tokens_per_second']:7.2f} tok/s ({predicted})  x{r['ratio_vs_ar_all_cores']:.2f} AR all cores, "
                     f"x{r['ratio_vs_ar_one_thread']:.2f} AR 1 thread"
                     f"  tokens/cycle {r['tokens_per_cycle']:.3f}  per-draft acceptance {r['per_draft_acceptance']:.3f}"
                     f"  {'identical to AR' if r['identical'] else 'DIFFERENT from AR'}")
        b = r["breakdown"]
        lines.append(f"    per cycle {b['cycle_ms']:.1f} ms: slowest stage {b['slowest_stage_ms']:.1f} (stages "
                     + "/".join(f"{t:.1f}" for t in b["stage_ms"])
                     + f"), PDM {b['pdm_ms']:.1f}, verify {b['verify_ms']:.1f}, exposed communication "
                     f"{b['communication_ms']:.1f}, stage idle {b['idle_ms']:.1f}")
    lines.append(f"  PDM: {s['pdm']}")
    return "\n".join(lines)


def bench_wallclock(
    model: str = typer.Option("default", help="Target model folder, hub id, or 'default' (SmolLM2-135M-Instruct)."),
    stages: int = typer.Option(2, "--stages", "-n", min=1, help="Pipeline stages n."),
    split: str = typer.Option("auto", help="Layers per stage, e.g. 13,17, or auto: balanced by measured costs."),
    head: str = typer.Option("last", help="Final norm + lm_head on the last stage's rank (last) or on rank 0 (control)."),
    draft_rank: str = typer.Option("with-first-stage", help="'separate' (n+1 processes) or 'with-first-stage' (n)."),
    drafters: str = typer.Option("oracle,pdm,hybrid", help="Comma-separated: oracle (upper bound), pdm (shipped, else "
                                 "random), hybrid (retrieval beside the PDM), retrieval (no PDM)."),
    pdm: Optional[str] = typer.Option(None, help="PDM checkpoint (default: the shipped one for the split)."),
    max_new_tokens: int = typer.Option(64, min=2, help="New tokens per prompt (EOS ignored)."),
    prompts: int = typer.Option(len(PROMPTS), min=1, help="How many prompts: of the built-in ones (at most "
                                f"{len(PROMPTS)}), or the first N of each --questions file."),
    questions: List[str] = typer.Option([], help="EAGLE-format question file (the first turn of each line is a "
                                                 "prompt) instead of the built-in prompts; repeat for several."),
    ar_threads: Optional[str] = typer.Option(None, help="torch threads for AR, one run each, e.g. 2,1 (default: every core, and 1); ratios are against the fastest."),
    threads: Optional[int] = typer.Option(None, help="torch threads per SPD process (default: cores / processes)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    lookahead: str = typer.Option("auto", help="off, on, or auto: start a cycle before the previous one is verified "
                                  "(off with a tree width above 1)."),
    tree_width: int = typer.Option(1, min=1, help="Candidates per pipeline level (token tree); 1 = the chain."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
):
    """AR vs distributed SPD decode tokens/s on the same prompts and cores; ratio, acceptance, cycle breakdown."""
    from ..loading import parse_int_list
    from ..runtime import LayoutError, StageFailure
    from .harness import read_questions

    names = tuple(d.strip() for d in drafters.split(",") if d.strip())
    if not names or any(d not in ("oracle", "pdm", "hybrid", "retrieval") for d in names):
        raise typer.BadParameter(f"--drafters takes oracle, pdm, hybrid and/or retrieval, got {drafters!r}")
    try:
        if questions:
            texts = [q.text for path in questions for q in read_questions(path, Path(path).parent.name, prompts)]
            if not texts:
                raise ValueError(f"--questions: no prompts in {', '.join(questions)}")
            if None in texts:
                raise ValueError("--questions: every line needs a text prompt in `turns` (prompt_ids are not read here)")
            source = ", ".join(f"first {prompts} of {path}" for path in questions)
        elif prompts > len(PROMPTS):
            raise ValueError(f"--prompts {prompts}: there are {len(PROMPTS)} built-in prompts; give --questions "
                             "FILE for more")
        else:
            texts, source = PROMPTS[:prompts], f"{prompts} built-in"
        results = measure(WallclockOptions(
            model=model, stages=stages, split="auto" if split == "auto" else parse_int_list(split, "--split"),
            draft_rank=draft_rank, drafters=names, prompts=texts, source=source, max_new_tokens=max_new_tokens,
            ar_threads=tuple(parse_int_list(ar_threads, "--ar-threads") or ()), threads=threads, pdm=pdm, dtype=dtype,
            lookahead=lookahead, head=head, tree_width=tree_width))
    except (LayoutError, ValueError, FileNotFoundError) as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(2)
    except StageFailure as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(1)
    print(json.dumps(results, indent=2) if as_json else format_report(results))
