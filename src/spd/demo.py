"""`spd demo`: the embedded default target with its shipped PDM, one process per stage, next to AR.

For two labelled prompts (an open question, and a task that reworks text given in the prompt,
where drafting from the sequence itself pays), SPD decodes greedily with one process per stage
(streamed), then plain AR decodes the same prompt in this process on every core and on one
thread; the tokens are compared. With fewer cores than stages, or `one_process`, SPD runs in
this process on one thread instead (the stages one after another: acceptance, not speed). Last, the
cost model (`spd plan`) prices what n stages would give on n devices like one core here, from
this run's own timings and acceptance.
"""

from __future__ import annotations

import os
import sys
import textwrap
from dataclasses import dataclass

from .baselines.ar import ar_generate
from .bench.planner import Costs, acceptance_profile, measure_message_ms, predict
from .loading import build_decoder, encode_prompt
from .sampling import SamplingParams
from .shipped import demo_pdm

PROMPTS = (
    ("open question", "Explain in a few sentences why the sky is blue, then give one everyday example."),
    ("rework text", "Fix the spelling mistakes in this text and return the corrected text:\n\nOur team met on "
     "Monday to plan the new website. We agreed that the home page should be simple and easy to read. Maria "
     "will write the text for the about page, and Tom will take the photos of the ofice. The first version "
     "should be ready by the end of the month, and we will show it to the customers in early Febuary."),
)
DRAFT_RANK, HEAD = "with-first-stage", "last"   # n processes: rank 0 drafts beside stage 0


@dataclass(frozen=True)
class DemoOptions:
    stages: int = 2
    prompts: tuple[tuple[str, str], ...] = PROMPTS   # (label, text)
    max_new_tokens: int = 96
    drafter: str = "hybrid"
    one_process: bool = False


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_demo(options: DemoOptions = DemoOptions(), on_token_for=None) -> dict:
    """Decode every prompt with SPD and AR (every core, one thread); return the report as a dict.

    `on_token_for(label, prompt, tokenizer)` gives the callback that receives SPD's tokens of
    one prompt as they come (None: nothing streamed)."""
    import torch

    o, cores = options, usable_cores()
    pdm = demo_pdm(o.stages)
    fallback = None
    if not o.one_process and cores < o.stages:
        fallback = (f"{cores} core(s) for {o.stages} stages: one process per stage would only time-share them, "
                    f"so SPD ran in one process (the stages one after another)")
    distributed = not o.one_process and fallback is None
    spd_threads = max(1, cores // o.stages) if distributed else 1   # one process: as AR on one thread
    if distributed:
        from .runtime import plan, start
        from .target import load_target

        spec = plan("default", o.stages, None, DRAFT_RANK, pdm, threads=spd_threads, lookahead="auto",
                    drafter=o.drafter, timeout=60.0)
        target, tokenizer = load_target(spec.model)   # the whole model, for AR (rank 0 holds only part)
        split, kind = list(spec.stage_layers), spec.drafter
        with start(spec) as session:
            decode = lambda ids, new, on_token: session.generate(ids, session.drafter(), max_new_tokens=new,  # noqa: E731
                                                                 on_token=on_token)
            runs = _decode_prompts(decode, target, tokenizer, o, cores, spd_threads, on_token_for)
    else:
        from .engine import generate

        dec = build_decoder("default", stages=o.stages, pdm_path=pdm, drafter=o.drafter)
        target, tokenizer, split, kind = dec.target, dec.tokenizer, dec.stage_layers, dec.drafter_kind
        decode = lambda ids, new, on_token: generate(target, dec.drafter(), ids, dec.stages, SamplingParams(),  # noqa: E731
                                                     new, on_token=on_token)
        runs = _decode_prompts(decode, target, tokenizer, o, cores, spd_threads, on_token_for)
    torch.set_num_threads(cores)
    for run in runs:
        run["spd_processes"] = o.stages if distributed else 1
    return {"model": "default (SmolLM2-135M-Instruct)", "stages": o.stages, "split": list(split), "drafter": kind,
            "mode": "one process per stage" if distributed else "one process", "fallback": fallback,
            "cores": cores, "load_average": _load(), "spd_processes": o.stages if distributed else 1, "spd_threads_per_process": spd_threads,
            "max_new_tokens": o.max_new_tokens, "prompts": runs, "identical": all(r["identical"] for r in runs),
            "plan": plan_line(target, runs, split, kind)}


def _decode_prompts(decode, target, tokenizer, o: DemoOptions, cores: int, spd_threads: int, on_token_for) -> list:
    """Per prompt: SPD (streamed), then AR on every core and on one thread, tokens compared."""
    import torch

    ar_threads = sorted({cores, 1}, reverse=True)
    warm = encode_prompt(tokenizer, o.prompts[0][1])[:8]
    torch.set_num_threads(spd_threads)
    decode(warm, 4, None)   # warm-up: first calls pay for allocations and lazy set-up
    for t in ar_threads:
        torch.set_num_threads(t)
        ar_generate(target, warm, max_new_tokens=4)
    runs = []
    for label, prompt in o.prompts:
        ids = encode_prompt(tokenizer, prompt)
        torch.set_num_threads(spd_threads)
        result = decode(ids, o.max_new_tokens, on_token_for(label, prompt, tokenizer) if on_token_for else None)
        ar = {}
        for t in ar_threads:
            torch.set_num_threads(t)
            ar[t] = ar_generate(target, ids, SamplingParams(), o.max_new_tokens)
        s = result.stats
        runs.append({
            "label": label, "prompt": prompt, "text": tokenizer.decode(result.tokens, skip_special_tokens=True),
            "new_tokens": s.new_tokens, "identical": all(tokens == result.tokens for tokens, _ in ar.values()),
            "spd_tokens_per_second": s.decode_tokens_per_second,
            "ar_tokens_per_second": {"all_cores": ar[cores][1].decode_tokens_per_second,
                                     "one_thread": ar[1][1].decode_tokens_per_second},
            "per_draft_acceptance": s.per_draft_acceptance, "equivalent_accept_length": s.equivalent_accept_length,
            "source_acceptance": s.source_acceptance(), "cycles": s.cycles,
            "draft_ms": 1000.0 * s.pdm_seconds / max(1, s.cycles),
            "ar_ms_one_thread": 1000.0 * ar[1][1].decode_seconds / max(1, ar[1][1].new_tokens - 1),
            "acceptance_by_fill": acceptance_profile(s.to_dict())})
    return runs


def plan_line(target, runs: list[dict], split: list[int], drafter: str) -> dict:
    """The cost model on n devices like one core here: AR per token on one thread and the draft
    time from this run, the head timed apart (the rest is the layers), one local message."""
    import statistics
    import time

    import torch

    torch.set_num_threads(1)
    hidden = torch.zeros(target.hidden_size, dtype=target.dtype, device=target.device)
    times = []
    with torch.inference_mode():
        for _ in range(9):
            t = time.perf_counter()
            int(target.logits(hidden).argmax())
            times.append(time.perf_counter() - t)
    head_ms = 1000.0 * statistics.median(times)
    ar_ms = statistics.mean(r["ar_ms_one_thread"] for r in runs)
    costs = Costs(num_layers=target.num_layers, layer_ms=max(0.0, ar_ms - head_ms) / target.num_layers,
                  head_ms=head_ms, message_ms=measure_message_ms(target.hidden_size, reps=30),
                  draft_ms={drafter: statistics.mean(r["draft_ms"] for r in runs)}, cores=None)
    ratios = {r["label"]: predict(costs, split, DRAFT_RANK, HEAD, r["acceptance_by_fill"], drafter,
                                  new_tokens=r["new_tokens"]).vs_ar_one_device for r in runs}
    return {"devices": len(split), "layer_ms": costs.layer_ms, "head_ms": head_ms, "message_ms": costs.message_ms,
            "draft_ms": costs.draft_ms[drafter], "predicted_vs_ar_one_device": ratios}


def print_report(report: dict, out=None) -> None:
    out = out or sys.stderr  # looked up per call: a redirected stderr (tests, callers) is honoured
    runs, n, cores = report["prompts"], report["stages"], report["cores"]
    procs = report["spd_processes"]
    threads = report["spd_threads_per_process"]
    spd_label = (f"SPD, {procs} processes x {threads} thread{'s' * (threads > 1)}" if procs > 1
                 else f"SPD, one process, {threads} thread{'s' * (threads > 1)}")
    rows = [("", *[r["label"] for r in runs]),
            (f"{spd_label} tok/s", *[f"{r['spd_tokens_per_second']:.1f}" for r in runs]),
            (f"AR, {cores} threads tok/s", *[f"{r['ar_tokens_per_second']['all_cores']:.1f}" for r in runs])]
    if cores > 1:
        rows.append(("AR, 1 thread tok/s", *[f"{r['ar_tokens_per_second']['one_thread']:.1f}" for r in runs]))
    rows += [("SPD / AR same cores", *[f"{_ratio(r, 'all_cores'):.2f}x" for r in runs]),
             ("SPD / AR one thread", *[f"{_ratio(r, 'one_thread'):.2f}x" for r in runs]),
             ("tokens identical to AR", *["yes" if r["identical"] else "NO" for r in runs]),
             ("new tokens", *[r["new_tokens"] for r in runs]),
             ("per-draft acceptance", *[f"{r['per_draft_acceptance']:.2f}" for r in runs])]
    for source in ("pdm", "retrieval", "both"):
        rows.append((f"  drafts from {source}", *[_source(r, source) for r in runs]))
    rows.append(("n*N/C (speedup on n devices, ideal)", *[f"{r['equivalent_accept_length']:.2f}x" for r in runs]))
    p = report["plan"]
    rows.append((f"cost model: {p['devices']} devices like 1 core here",
                 *[f"{p['predicted_vs_ar_one_device'][r['label']]:.2f}x AR" for r in runs]))
    print(f"\n{report['model']}, n={n} stages ({','.join(map(str, report['split']))} layers), "
          f"{report['drafter']} drafter, greedy, {report['max_new_tokens']} new tokens at most; "
          f"{report['mode']} on {cores} core{'s' * (cores > 1)}"
          + (f" (load average {report['load_average']:.1f})" if report["load_average"] is not None else ""), file=out)
    if report["fallback"]:
        print(f"  note: {report['fallback']}", file=out)
    if report["load_average"] is not None and report["load_average"] > cores:
        print(f"  note: load average {report['load_average']:.1f} on {cores} cores: other work shares them, so every "
              f"tokens/s here is low, AR on {cores} threads most (its threads wait for each other)", file=out)
    print(textwrap.fill(_when_it_pays(report), 100, initial_indent="  ", subsequent_indent="  ") + "\n", file=out)
    for label, *cells in rows:
        print(f"  {label:<40}" + "".join(f"{str(c):<21}" for c in cells).rstrip(), file=out)
    print(f"  (cost model: layer {p['layer_ms']:.2f} ms, head {p['head_ms']:.2f} ms, draft {p['draft_ms']:.2f} ms, "
          f"message {p['message_ms']:.2f} ms; the draft as in this run, {threads} thread{'s' * (threads > 1)}; "
          "`spd plan` for every n and layout)", file=out)


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _ratio(run: dict, which: str) -> float:
    ar = run["ar_tokens_per_second"][which]
    return run["spd_tokens_per_second"] / ar if ar else 0.0


def _source(run: dict, source: str) -> str:
    c = run["source_acceptance"].get(source)
    return f"{c['share']:.0%}, accepted {c['acceptance']:.2f}" if c else "-"


def _when_it_pays(report: dict) -> str:
    n, cores = report["stages"], report["cores"]
    if report["spd_processes"] == 1:
        where = ("Here SPD ran in one process: the stages run one after another, so it cannot beat AR; "
                 "it shows acceptance and identical tokens. Without --one-process and with at least n cores, "
                 "the demo runs one process per stage.")
    else:
        where = (f"Here the {n} stage processes share {cores} CPU cores and their memory bandwidth, while AR on "
                 f"{cores} threads splits each matrix product over all of them: against AR on one thread "
                 "(one device) SPD can win, against AR on every core it rarely does.")
    return ("When SPD pays: with one device per stage (n GPUs or machines), where the stages really run side "
            f"by side; the cost-model row prices that. {where} Answers that copy text from the prompt (the "
            "rework task) are drafted from the sequence itself and accepted far more often than an open answer.")
