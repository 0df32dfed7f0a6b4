"""`spd bench run`: every method on the same prompts, in the same process, resumable.

For each dataset, temperature and prompt, AR runs first (the reference), then every other
method on the same prompt ids, so load changes on the machine hit all methods alike. Each
decode appends one record to OUT/per_prompt.jsonl at once; a rerun with the same OUT skips the
(method, dataset, temperature, question) keys already there, so an interrupted run continues
where it stopped and `--limit` can grow. OUT/run.json keeps the settings that shape the
records (a resume with others fails naming the setting) and the measured draft costs.
At the end OUT/summary.json, OUT/summary.md and the plots are written from all the records.

With `replay`, records of every method but AR and tree SPD come from a replay over AR's tokens
(`spd.bench.acceptance`: one target forward per prompt, then the method's real drafter; no
timings), except on the first `engine_check` prompts of each dataset, where the method runs as
usual (tokens checked against AR) and a greedy record says whether the replay's counts agreed
(`replay_agrees`; a near-tie between the full forward and step-by-step decoding may flip a draft).
Sampled records replay AR's sample at that temperature (one draw of the counts' law given those
tokens, which have the law of every lossless method's output); a sample has no per-prompt counts
to agree with, so tests/test_acceptance.py checks the replay's law against the engine's.
Hundreds of prompts then cost about one AR decode each instead of one decode per method.

Prompts: EAGLE-format question files (`question_id`, `turns`; the first turn, rendered with
the chat template). A record may carry `prompt_ids` instead (token ids; for models without a
tokenizer).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..sampling import SamplingParams
from . import DEFAULT_METHODS, costs
from .acceptance import sequence_snapshots
from .methods import MethodSpec, build_runner, parse_methods, warm_up
from .report import RECORDS, RUN, read_records, summarize, write_json, write_report

log = logging.getLogger(__name__)

DATASETS = ("mt_bench", "gsm8k", "humaneval")
REPLAY_COUNTS = ("cycles", "target_forwards", "draft_forwards", "verified", "accepted")


@dataclass(frozen=True)
class BenchConfig:
    out: str
    model: str = "default"
    methods: str = DEFAULT_METHODS
    datasets: tuple[str, ...] = DATASETS      # folders under eval_dir holding question.jsonl
    eval_dir: str | None = None               # default: $SPD_EVAL_DATA, else ../shared/eval_data
    data: tuple[str, ...] = ()                # extra question files (EAGLE format)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    limit: int | None = None                  # first N prompts of each dataset
    max_new_tokens: int = 256
    ignore_eos: bool = False
    pdm: tuple[str, ...] = ()                 # PDM checkpoints, matched to spd-n<N> by their n
    ppsd: tuple[str, ...] = ()                # PPSD heads, matched to ppsd-n<N> by their n
    eagle: str | None = None                  # EAGLE-style head, used for every eagle-k<K>
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    cost_context: int = 256                   # cached positions when timing draft forwards
    replay: bool = False                      # greedy records from a replay over AR's tokens
    engine_check: int = 3                     # ... except the first N prompts of each dataset
    progress: bool = True
    plots: bool = True

    # settings every record of one OUT must share
    FIXED = ("model", "max_new_tokens", "ignore_eos", "seed", "dtype")


@dataclass
class Prompt:
    dataset: str
    question_id: object
    text: str | None
    ids: list[int] | None = None


@dataclass
class BenchResult:
    out: str
    records: int
    new_records: int
    summary: list = field(default_factory=list)
    greedy_mismatches: int = 0


def default_eval_dir() -> Path:
    return Path(os.environ.get("SPD_EVAL_DATA", "../shared/eval_data"))


def read_questions(path, dataset: str, limit: int | None) -> list[Prompt]:
    """The first turn of each question in an EAGLE-format question.jsonl."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from None
            if "prompt_ids" not in q and not q.get("turns"):
                raise ValueError(f"{path}:{line_no}: a question needs `turns` (EAGLE format) or `prompt_ids`")
            prompts.append(Prompt(dataset, q.get("question_id", line_no - 1),
                                  (q.get("turns") or [None])[0], q.get("prompt_ids")))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def dataset_files(cfg: BenchConfig) -> list[tuple[str, Path]]:
    """(dataset name, question file) for --datasets under the eval dir, then each --data file."""
    root = Path(cfg.eval_dir) if cfg.eval_dir else default_eval_dir()
    files = [(name, root / name / "question.jsonl") for name in cfg.datasets]
    for extra in cfg.data:
        p = Path(extra)
        files.append((p.parent.name if p.name == "question.jsonl" else p.stem, p))
    names = [n for n, _ in files]
    if len(set(names)) != len(names):
        raise ValueError(f"two question files share a dataset name: {names}")
    return files


def prompt_seed(seed: int, dataset: str, question_id, temperature: float) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{dataset}/{question_id}/{temperature}".encode())) % 2**31


def record_key(r: dict) -> tuple:
    return r["method"], r["dataset"], float(r["temperature"]), str(r["question_id"])


def open_run(out: Path, cfg: BenchConfig) -> dict:
    """OUT/run.json: created, or checked against the settings of the records already there."""
    path = out / RUN
    settings = {name: getattr(cfg, name) for name in cfg.FIXED}
    if not path.is_file():
        return {"settings": settings, "methods": {}}
    run = json.loads(path.read_text())
    for name, value in settings.items():
        if run["settings"].get(name) != value:
            raise ValueError(f"{out} holds a run with {name}={run['settings'].get(name)!r}, now "
                             f"{name}={value!r}; use the same setting to resume, or another --out")
    return run


def encode(prompt: Prompt, tokenizer) -> list[int]:
    if prompt.ids is not None:
        return [int(x) for x in prompt.ids]
    from ..loading import encode_prompt
    return encode_prompt(tokenizer, prompt.text)


def run_bench(cfg: BenchConfig, target=None, tokenizer=None) -> BenchResult:
    """Run (or continue) the benchmark in cfg.out; returns what it wrote."""
    from ..loading import parse_dtype
    from ..target import load_target

    specs = parse_methods(cfg.methods)
    if not cfg.temperatures:
        raise ValueError("give at least one temperature")
    prompts = [p for name, f in dataset_files(cfg) for p in read_questions(f, name, cfg.limit)]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    run = open_run(out, cfg)
    if target is None:
        target, tokenizer = load_target(cfg.model, parse_dtype(cfg.dtype), cfg.device)
    runners = {s.name: build_runner(s, target, cfg.model, cfg.pdm, cfg.ppsd, cfg.eagle) for s in specs}
    _measure_costs(run, runners, target, cfg.cost_context, out)

    records_path = out / RECORDS
    records = read_records(records_path)
    done = {record_key(r) for r in records}
    reference = {(r["dataset"], float(r["temperature"]), str(r["question_id"])): r["tokens"]
                 for r in records if r["method"] == "ar"}
    eos = () if cfg.ignore_eos else target.eos_token_ids
    work = [(p, t, s) for p in prompts for t in cfg.temperatures for s in specs]
    todo = [(p, t, s) for p, t, s in work if (s.name, p.dataset, float(t), str(p.question_id)) not in done]
    bar = _bar(cfg.progress, len(work), len(work) - len(todo))
    for runner in {w[2].name: runners[w[2].name] for w in todo}.values():
        warm_up(runner, target.vocab_size)
    new, ids_of = 0, {}
    rank, seen = {}, Counter()   # each prompt's place in its dataset (engine checks: the first N)
    for p in prompts:
        rank[(p.dataset, str(p.question_id))] = seen[p.dataset]
        seen[p.dataset] += 1
    anchors = sorted({a for r in runners.values() for a in r.replay_anchors})
    latest = {}   # the latest prompt's hidden states, shared by its replays

    def snapshots(key, sequence) -> dict:
        if key not in latest:
            latest.clear()
            latest[key] = sequence_snapshots(target, sequence, anchors)
        return latest[key]

    with open(records_path, "a", encoding="utf-8") as fh:
        for prompt, temperature, spec in todo:
            key = (prompt.dataset, str(prompt.question_id))
            if key not in ids_of:
                ids_of[key] = encode(prompt, tokenizer)
            ids, runner = ids_of[key], runners[spec.name]
            params = SamplingParams(temperature=temperature,
                                    seed=prompt_seed(cfg.seed, prompt.dataset, prompt.question_id, temperature))
            bar.set_postfix_str(f"{prompt.dataset} T={temperature:g} {spec.name}")
            ar_tokens = reference.get((prompt.dataset, float(temperature), str(prompt.question_id)))
            if cfg.replay and runner.replayable and ar_tokens is not None:
                fields = _replayed(runner, ids, ar_tokens, snapshots(key, ids + ar_tokens), cfg,
                                   decode_too=rank[key] < cfg.engine_check, eos=eos, params=params)
            else:
                fields = runner.run(ids, params, cfg.max_new_tokens, eos)
            record = _record(spec, prompt, temperature, ids, fields, reference, runner)
            if spec.kind == "ar":
                reference[(prompt.dataset, float(temperature), str(prompt.question_id))] = record["tokens"]
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            records.append(record)
            new += 1
            bar.update(1)
    bar.close()
    rows = summarize(records, run["methods"])
    write_report(out, rows, plots=cfg.plots)
    mismatches = sum(1 for r in records if r.get("matches_ar") is False)
    if mismatches:
        log.error("%d greedy outputs differ from AR's (see matches_ar in %s)", mismatches, records_path)
    return BenchResult(str(out), len(records), new, rows, mismatches)


def _replayed(runner, ids: list[int], ar_tokens: list[int], snapshots: dict, cfg: BenchConfig, *, decode_too: bool,
              eos, params: SamplingParams) -> dict:
    """A record's fields from the replay over AR's tokens; with `decode_too` (an engine-checked
    prompt) the decode's fields instead, saying (greedy) whether the replay agreed."""
    if decode_too and not params.greedy:
        return runner.run(ids, params, cfg.max_new_tokens, eos)
    replayed = runner.replay(ids, ar_tokens, cfg.max_new_tokens, snapshots, params)
    if not decode_too:
        return {**replayed, "replayed": True}
    fields = runner.run(ids, params, cfg.max_new_tokens, eos)
    return {**fields, "replay_agrees": all(fields[f] == replayed[f] for f in REPLAY_COUNTS)}


def _record(spec: MethodSpec, prompt: Prompt, temperature: float, ids, fields: dict, reference, runner) -> dict:
    tokens = fields["tokens"]
    ref = reference.get((prompt.dataset, float(temperature), str(prompt.question_id)))
    matches = None
    if temperature == 0 and spec.kind != "ar" and ref is not None and not fields.get("replayed"):
        matches = tokens == ref
    tree = None if spec.tree is None else {"budget": spec.tree.budget, "depth": spec.tree.depth,
                                           "top_k": spec.tree.top_k}
    return {"method": spec.name, "kind": spec.kind, "n": spec.n, "k": spec.k, "tree": tree,
            "dataset": prompt.dataset, "question_id": prompt.question_id, "temperature": float(temperature),
            "prompt_tokens": len(ids), "new_tokens": len(tokens), "decode_tokens": max(0, len(tokens) - 1),
            **fields, "matches_ar": matches, "untrained": runner.untrained}


def _measure_costs(run: dict, runners: dict, target, context: int, out: Path) -> None:
    """Draft-forward fractions of a target forward, measured once per OUT (kept for resumes);
    draft and target steps alternate, so a change of load hits both alike."""
    run.setdefault("cost_context", context)
    for name, runner in runners.items():
        info = runner.info()
        known = run["methods"].get(name)
        if known is not None:
            if known["checkpoint"] != info["checkpoint"]:
                raise ValueError(f"{out} ran {name} with checkpoint {known['checkpoint']}, now "
                                 f"{info['checkpoint']}; use another --out for another checkpoint")
            continue
        step = runner.draft_step(run["cost_context"])
        if step is None:
            info.update(draft_fraction=0.0, draft_seconds=0.0, target_seconds=None)
        else:
            fraction, draft_s, target_s = costs.draft_fraction(target, step, run["cost_context"])
            info.update(draft_fraction=fraction, draft_seconds=draft_s, target_seconds=target_s)
            log.info("%s: draft forward %.2f ms = %.3f of a target forward (%.2f ms)", name, 1e3 * draft_s,
                     fraction, 1e3 * target_s)
        tokens = runner.spec.verify_tokens
        if tokens is not None:   # the verification forward's measured price (the second cost column)
            v, many_s, one_s = costs.verify_fraction(target, run["cost_context"], tokens)
            info["verify_cost"] = {"tokens": tokens, "fraction": v, "seconds": many_s, "one_token_seconds": one_s}
            log.info("%s: a %d-token target forward costs %.2f of a 1-token one", name, tokens, v)
        if runner.spec.retrieval:   # the lookup + gate part of a draft, at 4k tokens of context
            info["retrieval_ms"] = 1e3 * costs.median_seconds(costs.retrieval_step(4096, runner.spec.n or 1), 201)
        run["methods"][name] = info
    write_json(out / RUN, run)


def _bar(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm  # progress bars over prompts (core dependency)
    return tqdm(total=total, initial=initial, desc="bench", unit="decode", disable=not enabled,
                dynamic_ncols=True)
