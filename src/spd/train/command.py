"""`spd train` and `spd vocab`: typer options and one call each into the library (lazy imports)."""

from __future__ import annotations

import json
import os
from typing import List, Optional

import typer

from ..console import fail, setup


def _ints(text: Optional[str], what: str):
    from ..loading import parse_int_list
    value = parse_int_list(text, what)
    return tuple(value) if value is not None else None


def train(
    model: Optional[str] = typer.Option(None, help="Target model folder, hub id, or 'default' (embedded SmolLM2-135M-Instruct)."),
    data: Optional[List[str]] = typer.Option(None, help="Training files (.txt, .jsonl with text/messages/input_ids, .parquet); repeat the option for several."),
    out: str = typer.Option(..., help="Output folder: the PDM checkpoint `spd generate --pdm` loads."),
    stages: Optional[int] = typer.Option(None, "--stages", "-n", min=1, help="Pipeline stages n (default 2)."),
    split: Optional[str] = typer.Option(None, help="Layers per stage, e.g. 8,8,7,7 (default: most even)."),
    pdm_layers: Optional[int] = typer.Option(None, min=1, help="Decoder layers in the PDM body, N_s (default 1)."),
    anchors: Optional[str] = typer.Option(None, help="'auto' (default: the spec's rule) or hidden-state indices, e.g. 0,8,23,30."),
    draft_vocab: Optional[str] = typer.Option(None, help="Draft vocabulary file from `spd vocab` (default: full vocabulary)."),
    init_from: Optional[str] = typer.Option(None, help="Body init: 'last' target layers (default), 'none' (random), or indices."),
    proj_init: Optional[str] = typer.Option(None, help="Projection init: scaled (default: to the data's anchor scales) | random."),
    layout: Optional[str] = typer.Option(None, help="auto (default: exact for the PDM's N_s) | types | depths."),
    max_steps: Optional[int] = typer.Option(None, help="Optimizer steps (default: --epochs)."),
    epochs: Optional[float] = typer.Option(None, help="Passes over the data (default 1 when --max-steps is not given)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate, AdamW (default 1e-3)."),
    warmup_steps: Optional[int] = typer.Option(None, help="Warm-up steps (default 3% of the steps)."),
    batch_tokens: Optional[int] = typer.Option(None, help="Padded tokens per micro-batch, sequences bucketed by length (default 2048)."),
    grad_accum: Optional[int] = typer.Option(None, min=1, help="Micro-batches per optimizer step (default 1)."),
    max_len: Optional[int] = typer.Option(None, help="Longest training sequence; longer ones are cut (default 512)."),
    pack: Optional[bool] = typer.Option(None, "--pack/--no-pack", help="Concatenate documents into rows of exactly --max-len (default off)."),
    partial_fill: Optional[float] = typer.Option(None, help="Share of cycles trained as partial pipelines, after a rejection (default 0.5)."),
    temperature: Optional[float] = typer.Option(None, help="Distillation temperature (default 1)."),
    grad_clip: Optional[float] = typer.Option(None, help="Gradient norm clip, 0 = off (default 1)."),
    weight_decay: Optional[float] = typer.Option(None, help="AdamW weight decay (default 0)."),
    precision: Optional[str] = typer.Option(None, help="fp32 (default), or bf16 autocast (for GPUs; slow on CPU)."),
    device: Optional[str] = typer.Option(None, help="cpu (default) or cuda (torchrun: one GPU per process)."),
    dtype: Optional[str] = typer.Option(None, help="Target weights dtype (default float32)."),
    cache: Optional[str] = typer.Option(None, help="Token + feature cache folder (default OUT/cache); share it between runs."),
    feature_cache: Optional[bool] = typer.Option(None, "--feature-cache/--no-feature-cache", help="Run the target once and keep its features on disk (default on)."),
    cache_anchors: Optional[str] = typer.Option(None, help="Extra anchors to store, so runs with other n reuse the cache."),
    cache_dtype: Optional[str] = typer.Option(None, help="float16 (default) or float32 feature cache."),
    feature_dtype: Optional[str] = typer.Option(None, help="Target dtype of the feature-cache pass, e.g. bfloat16 (~2x faster "
                                                "on CPUs with bf16 instructions; default: --dtype)."),
    regenerate: Optional[str] = typer.Option(None, help="greedy | sample: the target rewrites the chat answers first."),
    regen_max_new_tokens: Optional[int] = typer.Option(None, help="Longest regenerated answer (default 256)."),
    eval_fraction: Optional[float] = typer.Option(None, help="Held-out share of sequences for eval (default 0.02)."),
    eval_head: Optional[int] = typer.Option(None, min=0, help="Hold out the first K sequences instead of --eval-fraction: "
                                            "one held-out set while data grows behind it (a conversation shorter than "
                                            "--max-len is one sequence)."),
    train_tokens: Optional[int] = typer.Option(None, min=1, help="Train on the leading training sequences up to this "
                                               "many tokens (a data-size curve on one feature cache)."),
    eval_every: Optional[int] = typer.Option(None, help="Eval every N steps, 0: only at the end (default 200)."),
    save_every: Optional[int] = typer.Option(None, help="Checkpoint every N steps, and on Ctrl-C / SIGTERM (default 200)."),
    resume: bool = typer.Option(False, help="Continue the run in --out where it stopped, with its saved settings."),
    stop_after: Optional[int] = typer.Option(None, help="Pause after N steps this session (continue with --resume)."),
    seed: Optional[int] = typer.Option(None, help="Seed (default 0)."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's choice)."),
    progress: bool = typer.Option(True, help="Show progress bars."),
    method: Optional[str] = typer.Option(None, help="pdm (SPD, default), or a baseline head: eagle (EAGLE-style) or ppsd; --resume keeps the run's."),
    ttt_steps: Optional[int] = typer.Option(None, min=1, help="eagle: unrolled chain steps per position in training "
                                            "(default 2; --resume keeps the run's)."),
    feature_layers: Optional[str] = typer.Option(None, help="eagle: hidden-state indices fused into the head, e.g. "
                                                 "8,15,29 (default: low / mid / high, 2, L/2, L-3); pick "
                                                 "layers a shared --cache holds to reuse it."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Train a Pipeline Draft Module for a target and a stage split (SPEC section 4).

    With --resume only --out is needed: the run continues with its saved settings; options
    given as well override them (settings that shape the run must match, or it fails).
    """
    import logging

    from .loop import make_config
    from .loop import train as run_train

    setup(threads, verbose)
    logging.getLogger("spd.train").setLevel(logging.INFO)  # what the run does, step by step
    try:
        given = dict(
            model=model, data=tuple(data) if data else None, stages=stages, split=_ints(split, "--split"),
            pdm_layers=pdm_layers, draft_vocab=draft_vocab, init_from=init_from, proj_init=proj_init, layout=layout,
            max_steps=max_steps, epochs=epochs, lr=lr, warmup_steps=warmup_steps, batch_tokens=batch_tokens,
            grad_accum=grad_accum, max_len=max_len, pack=pack, partial_fill=partial_fill,
            temperature=temperature, grad_clip=grad_clip, weight_decay=weight_decay, precision=precision,
            device=device, target_dtype=dtype, cache=cache, feature_cache=feature_cache,
            cache_anchors=_ints(cache_anchors, "--cache-anchors"), cache_dtype=cache_dtype, feature_dtype=feature_dtype,
            regenerate=regenerate, regen_max_new_tokens=regen_max_new_tokens, eval_fraction=eval_fraction,
            eval_head=eval_head, train_tokens=train_tokens,
            eval_every=eval_every, save_every=save_every, stop_after=stop_after, seed=seed)
        given = {k: v for k, v in given.items() if v is not None}
        if anchors is not None:
            given["anchors"] = None if anchors == "auto" else _ints(anchors, "--anchors")
        if method is None:   # a resumed head run says which head it trains
            from ..baselines.train_heads import saved_method
            method = (saved_method(out) if resume else None) or "pdm"
        if method not in ("pdm", "eagle", "ppsd"):
            raise ValueError(f"--method must be pdm, eagle or ppsd; got {method!r}")
        if feature_layers is not None and method != "eagle":
            raise ValueError(f"--feature-layers is for --method eagle (this run trains {method})")
        config = make_config(out, resume, progress=progress, **given)
        if method == "pdm":
            summary = run_train(config)
        else:  # the baselines' heads: same data, feature cache, schedule and loss
            from ..baselines.train_heads import train_head

            summary = train_head(config, method, ttt_steps=ttt_steps,
                                 feature_layers=_ints(feature_layers, "--feature-layers"))
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as err:
        fail(str(err))
    if os.environ.get("RANK", "0") == "0":  # under torchrun: one summary
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
        fail(str(err))
    if as_json:
        print(json.dumps(result))
    else:
        typer.echo(f"wrote {result['size']} ids to {result['out']}: they cover {result['coverage']:.2%} of "
                   f"{result['counted_tokens']} counted tokens ({result['distinct_tokens']} distinct)")
