"""`spd train` and `spd vocab`: typer options and one call each into the library (lazy imports)."""

from __future__ import annotations

import json
from typing import List, Optional

import typer


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def _ints(text: Optional[str], what: str):
    from ..loading import parse_int_list
    value = parse_int_list(text, what)
    return tuple(value) if value is not None else None


def train(
    model: str = typer.Option(..., help="Target model folder, hub id, or 'default' (embedded SmolLM2-135M-Instruct)."),
    data: List[str] = typer.Option(..., help="Training files (.txt, .jsonl with text/messages/input_ids, .parquet); repeat the option for several."),
    out: str = typer.Option(..., help="Output folder: the PDM checkpoint `spd generate --pdm` loads."),
    stages: int = typer.Option(2, "--stages", "-n", min=1, help="Pipeline stages n."),
    split: Optional[str] = typer.Option(None, help="Layers per stage, e.g. 8,8,7,7 (default: most even)."),
    pdm_layers: int = typer.Option(1, min=1, help="Decoder layers in the PDM body (N_s)."),
    anchors: str = typer.Option("auto", help="'auto' (the spec's default) or hidden-state indices, e.g. 0,8,23,30."),
    draft_vocab: Optional[str] = typer.Option(None, help="Draft vocabulary file from `spd vocab`."),
    init_from: str = typer.Option("last", help="Body init: 'last' target layers, 'none' (random), or indices."),
    layout: str = typer.Option("auto", help="auto | types | depths (auto: exact for the PDM's N_s)."),
    max_steps: Optional[int] = typer.Option(None, help="Optimizer steps (default: --epochs)."),
    epochs: Optional[float] = typer.Option(None, help="Passes over the data (default 1 when --max-steps is not given)."),
    lr: float = typer.Option(5e-4, help="Peak learning rate (AdamW)."),
    warmup_steps: Optional[int] = typer.Option(None, help="Warm-up steps (default 3% of the steps)."),
    batch_tokens: int = typer.Option(4096, help="Padded tokens per micro-batch (sequences are bucketed by length)."),
    grad_accum: int = typer.Option(1, min=1, help="Micro-batches per optimizer step."),
    max_len: int = typer.Option(512, help="Longest training sequence; longer ones are cut."),
    pack: bool = typer.Option(False, help="Concatenate documents into rows of exactly --max-len."),
    partial_fill: float = typer.Option(0.5, help="Share of cycles trained as partial pipelines (after a rejection)."),
    temperature: float = typer.Option(1.0, help="Distillation temperature."),
    grad_clip: float = typer.Option(1.0, help="Gradient norm clip (0 = off)."),
    weight_decay: float = typer.Option(0.0),
    precision: str = typer.Option("fp32", help="fp32, or bf16 autocast (for GPUs; slow on CPU)."),
    device: str = typer.Option("cpu", help="cpu or cuda (torchrun: one GPU per process)."),
    dtype: str = typer.Option("float32", help="Target weights dtype."),
    cache: Optional[str] = typer.Option(None, help="Token + feature cache folder (default OUT/cache); share it between runs."),
    feature_cache: bool = typer.Option(True, help="Run the target once and keep its features on disk."),
    cache_anchors: Optional[str] = typer.Option(None, help="Extra anchors to store, so runs with other n reuse the cache."),
    cache_dtype: str = typer.Option("float16", help="float16 or float32 feature cache."),
    regenerate: Optional[str] = typer.Option(None, help="greedy | sample: the target rewrites the chat answers first."),
    regen_max_new_tokens: int = typer.Option(256, help="Longest regenerated answer."),
    eval_fraction: float = typer.Option(0.02, help="Held-out share of sequences for eval."),
    eval_every: int = typer.Option(200, help="Eval every N steps (0: only at the end)."),
    save_every: int = typer.Option(200, help="Checkpoint every N steps (and on Ctrl-C / SIGTERM)."),
    resume: bool = typer.Option(False, help="Continue the run in --out exactly where it stopped."),
    stop_after: Optional[int] = typer.Option(None, help="Pause after N steps this session (continue with --resume)."),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's choice)."),
    progress: bool = typer.Option(True, help="Show progress bars."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Train a Pipeline Draft Module for a target and a stage split (SPEC section 4)."""
    import logging

    from ..cli import _setup
    from .loop import TrainConfig, train as run_train

    _setup(threads, verbose)
    logging.getLogger("spd.train").setLevel(logging.INFO)  # what the run does, step by step
    try:
        cfg = TrainConfig(
            model=model, data=tuple(data), out=out, stages=stages, split=_ints(split, "--split"),
            pdm_layers=pdm_layers, anchors=None if anchors == "auto" else _ints(anchors, "--anchors"),
            draft_vocab=draft_vocab, init_from=init_from, layout=layout, max_steps=max_steps, epochs=epochs,
            lr=lr, warmup_steps=warmup_steps, batch_tokens=batch_tokens, grad_accum=grad_accum, max_len=max_len,
            pack=pack, partial_fill=partial_fill, temperature=temperature, grad_clip=grad_clip,
            weight_decay=weight_decay, precision=precision, device=device, target_dtype=dtype, cache=cache,
            feature_cache=feature_cache, cache_anchors=_ints(cache_anchors, "--cache-anchors") or (),
            cache_dtype=cache_dtype, regenerate=regenerate, regen_max_new_tokens=regen_max_new_tokens,
            eval_fraction=eval_fraction, eval_every=eval_every, save_every=save_every, resume=resume,
            stop_after=stop_after, seed=seed, progress=progress)
        summary = run_train(cfg)
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as err:
        _fail(str(err))
    typer.echo(_summary_text(summary), err=True)


def _summary_text(s) -> str:
    lines = [f"{'stopped (' + s.interrupted + ')' if s.interrupted else 'done'}: step {s.step}/{s.total_steps}, "
             f"{s.tokens} tokens in {s.seconds:.0f}s ({s.tokens_per_second:.0f} tok/s)",
             f"train loss {s.train_loss:.4f}  agreement {s.train_agreement:.3f}"]
    if s.eval:
        ev = s.eval
        lines.append(f"eval loss {ev['loss']:.4f}  agreement full {ev['agreement_full']:.3f}"
                     + (f"  partial {ev['agreement_partial']:.3f}" if "agreement_partial" in ev else "")
                     + f"  est. accept length {ev['est_accept_length']:.2f}")
    lines.append(f"PDM checkpoint: {s.out}" + ("  (continue with --resume)" if s.interrupted or s.step < s.total_steps else ""))
    return "\n".join("  " + line for line in lines)


def vocab(
    model: str = typer.Option(..., help="Target model folder, hub id, or 'default'."),
    data: List[str] = typer.Option(..., help="Training files, as for `spd train`."),
    out: str = typer.Option(..., help="Output JSON file with the draft vocabulary ids."),
    size: int = typer.Option(16384, min=1, help="Number of ids to keep (K)."),
    all_tokens: bool = typer.Option(False, help="Count every token, not only the scored (assistant) ones."),
    max_len: int = typer.Option(2048, help="Sequences are cut as training would (count is unaffected)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Count token frequencies on the training data and write the top-K ids (a draft vocabulary)."""
    from ..vocab import build_vocab

    try:
        result = build_vocab(model, data, out, size, max_len, scored_only=not all_tokens)
    except (ValueError, FileNotFoundError, OSError) as err:
        _fail(str(err))
    if as_json:
        print(json.dumps(result))
    else:
        typer.echo(f"wrote {result['size']} ids to {result['out']}: they cover {result['coverage']:.2%} of "
                   f"{result['counted_tokens']} counted tokens ({result['distinct_tokens']} distinct)")
