"""`spd data`: typer options and one call into spd.distill.run (lazy imports)."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import typer

from ..console import fail, setup


def data(
    model: str = typer.Option(..., help="Model folder, hub id, or 'default' (the embedded SmolLM2-135M-Instruct)."),
    out: str = typer.Option(..., help="JSONL to write, one conversation a line (`spd train --data` reads it); "
                            "OUT.meta.json records the parameters and progress."),
    prompts: Optional[str] = typer.Option(None, help="Prompt file: .jsonl with `turns` (eval/EAGLE format), "
                                          "`messages` or `conversations` (ShareGPT), or `prompt`; or .txt, one "
                                          "prompt a line. Default: the target writes its own questions from "
                                          "topic x task x format openers."),
    num_conversations: Optional[int] = typer.Option(None, min=1, help="Conversations to write (default: every "
                                                    "prompt of --prompts; required without it)."),
    max_new_tokens: int = typer.Option(256, min=1, help="Longest answer, in tokens."),
    temperature: float = typer.Option(0.7, min=0.0, help="Answer sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus filter for answers (1 = off)."),
    seed: int = typer.Option(0, help="Seed: round r of the run depends on (seed, r) alone."),
    raw: bool = typer.Option(False, help="No chat template: the model continues each prompt's text (base models). "
                             "Lines are {text, input_ids, loss_mask}, only the continuation scored."),
    resume: bool = typer.Option(False, help="Go on with --out where it stopped (same parameters): nothing is lost "
                                "and no prompt is answered twice."),
    batch_size: int = typer.Option(128, min=1, help="Prompts sampled together (throughput grows with it up to "
                                   "~128 on a CPU)."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 (fast on CPUs with AVX512-BF16 and on GPUs) or float32."),
    device: str = typer.Option("cpu", help="cpu or e.g. cuda; samples differ across devices, so --resume stays on one."),
    eval_dir: Optional[str] = typer.Option(None, help="Evaluation prompts to keep out (folders mt_bench, gsm8k, "
                                           "humaneval with question.jsonl). Default: ../shared/eval_data when present."),
    eval_filter: bool = typer.Option(True, "--eval-filter/--no-eval-filter", help="Drop prompts that overlap the "
                                     "evaluation prompts."),
    workers: Optional[int] = typer.Option(None, min=1, help="Processes sampling rounds side by side, the torch "
                                          "threads split between them (default: one per core on a CPU, 1 on a GPU; "
                                          "two 1-thread processes ran 1.24x one 2-thread process on 2 cores)."),
    threads: Optional[int] = typer.Option(None, help="torch threads in all (default: every core)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Self-distilled training data: the target answers prompts (from a file, or questions it writes itself);
    its answers teach a PDM to draft what this target says. Batched, resumable, evaluation prompts kept out."""
    setup(threads, verbose)
    from .prompts import PromptError
    from .run import DataConfig, distill

    cores = len(os.sched_getaffinity(0))
    workers = workers or (cores if device == "cpu" else 1)
    cfg = DataConfig(model=model, out=out, prompts=prompts, num_conversations=num_conversations,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, raw=raw,
                     batch_size=batch_size, dtype=dtype, eval_dir=eval_dir, eval_filter=eval_filter, device=device,
                     workers=workers, worker_threads=max(1, (threads or cores) // workers), resume=resume)
    start = time.time()
    try:
        progress = distill(cfg)
    except (PromptError, ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    seconds = time.time() - start
    typer.echo(json.dumps({"out": out, "lines": progress.lines, "answer_tokens": progress.answer_tokens,
                           "prompt_tokens_written": progress.prompt_tokens, "rejected": progress.rejected,
                           "seconds": round(seconds, 1)}), err=True)
