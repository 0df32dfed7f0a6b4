"""`spd bench run` and `spd bench report`: options only; the harness loads when they run."""

from __future__ import annotations

from typing import List, Optional

import typer

from ..console import fail, setup
from . import DEFAULT_METHODS


def bench_run(
    out: str = typer.Option(..., help="Output folder (per_prompt.jsonl, summary.json/.md, run.json, plots); "
                                      "run again with the same folder to resume."),
    model: str = typer.Option("default", help="Target model folder, hub id, or 'default' (SmolLM2-135M-Instruct)."),
    methods: str = typer.Option(DEFAULT_METHODS,
                                help="Comma-separated: ar, spd-n<N>, spd-n<N>-w<W> (token tree), ppsd-n<N>, "
                                     "eagle-k<K>, eagle-tree-b<B>, and spd-n<N>+retrieval / eagle-k<K>+retrieval "
                                     "(AR always runs)."),
    datasets: str = typer.Option("mt_bench,gsm8k,humaneval", help="Folders under --eval-dir holding question.jsonl ('' for none)."),
    eval_dir: Optional[str] = typer.Option(None, help="Folder of the datasets (default $SPD_EVAL_DATA, else ../shared/eval_data)."),
    data: List[str] = typer.Option([], help="Another question file (EAGLE format); repeat for several."),
    temperatures: str = typer.Option("0,1", help="Comma-separated sampling temperatures (0 = greedy)."),
    limit: Optional[int] = typer.Option(None, min=1, help="First N prompts of each dataset (a quick run)."),
    max_new_tokens: int = typer.Option(256, min=1, help="Tokens to generate per prompt at most."),
    ignore_eos: bool = typer.Option(False, help="Decode max_new_tokens tokens whatever the model emits."),
    pdm: List[str] = typer.Option([], help="PDM checkpoint for spd-n<N> (matched by its n); repeat per n. "
                                           "Default: the shipped one, else a random PDM."),
    ppsd: List[str] = typer.Option([], help="PPSD head for ppsd-n<N> (matched by its n); repeat per n. "
                                            "Default: the target's own early exit."),
    eagle: Optional[str] = typer.Option(None, help="EAGLE-style head for every eagle-k<K> and eagle-tree-b<B> (default: a random head)."),
    seed: int = typer.Option(0, help="Base seed of the per-prompt sampling seeds."),
    cost_context: int = typer.Option(256, min=1, help="Cached positions when timing draft vs target forwards."),
    replay: bool = typer.Option(False, help="Records of the drafting methods from a replay over AR's tokens "
                                            "(one target forward per prompt, the real drafters; no timings; T > 0: "
                                            "one draw of the acceptances given AR's sample): hundreds of prompts at "
                                            "about one AR decode each. Tree SPD still decodes."),
    engine_check: int = typer.Option(3, min=0, help="With --replay: the first N prompts of each dataset also "
                                                    "decode for real (greedy: tokens checked against AR, counts "
                                                    "against the replay)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", help="cpu or cuda:0."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's choice)."),
    plots: bool = typer.Option(True, help="Write the PNG plots."),
    progress: bool = typer.Option(True, help="Progress bar over prompts."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Run AR, SPD, PPSD and EAGLE-style drafting on the same prompts; write records, summary, plots.

    Exits 1 if a greedy output differs from AR's.
    """
    from .harness import BenchConfig, run_bench

    setup(threads, verbose)
    try:
        temps = tuple(float(t) for t in temperatures.split(",") if t.strip())
        cfg = BenchConfig(out=out, model=model, methods=methods,
                          datasets=tuple(d.strip() for d in datasets.split(",") if d.strip()),
                          eval_dir=eval_dir, data=tuple(data), temperatures=temps, limit=limit,
                          max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, pdm=tuple(pdm),
                          ppsd=tuple(ppsd), eagle=eagle, seed=seed, dtype=dtype, device=device,
                          cost_context=cost_context, replay=replay, engine_check=engine_check,
                          progress=progress, plots=plots)
        result = run_bench(cfg)
    except (ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    from pathlib import Path

    typer.echo((Path(result.out) / "summary.md").read_text())
    typer.echo(f"{result.new_records} new records ({result.records} in all) in {result.out}", err=True)
    if result.greedy_mismatches:
        typer.secho(f"{result.greedy_mismatches} greedy outputs differ from AR's", fg="red", err=True)
        raise typer.Exit(1)


def bench_report(out: str = typer.Option(..., help="A folder written by `spd bench run`.")):
    """Rebuild summary.json, summary.md and the plots from OUT/per_prompt.jsonl (no decoding)."""
    from .report import markdown, report_from_disk

    try:
        rows = report_from_disk(out)
    except (ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    typer.echo(markdown(rows))
