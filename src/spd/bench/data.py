"""`spd bench data`: answer tokens/s of `spd data`'s sampler against transformers' `generate`.

Both answer the same prompts (opener-grid questions as user turns, chat template), in batches of
`--batch-size`, sampled at the same temperature, in the same dtype and process; the two run in
turn, `--repeats` times, so a change in machine load hits both alike. Tokens/s counts answer
tokens up to and including each row's end (what a data file keeps), over wall time, prefill
included. This is a benchmark, not a test: it prints what it measured.
"""

from __future__ import annotations

import json
import os
import random
import time

import typer

from ..console import fail, setup


def bench_data(
    model: str = typer.Option("default", help="Model folder, hub id, or 'default' (SmolLM2-135M-Instruct)."),
    batch_size: int = typer.Option(128, min=1, help="Prompts per batch."),
    batches: int = typer.Option(1, min=1, help="Batches per method and repeat."),
    max_new_tokens: int = typer.Option(128, min=1, help="Longest answer."),
    temperature: float = typer.Option(0.7, min=0.0, help="Sampling temperature (0 = greedy)."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32."),
    repeats: int = typer.Option(2, min=1, help="Alternating runs of both methods."),
    seed: int = typer.Option(0, help="Which opener-grid prompts."),
    threads: int = typer.Option(None, help="torch threads (default: every core)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """spd data's batched sampler vs transformers' generate: answer tokens/s on the same prompts, and the ratio."""
    setup(threads or len(os.sched_getaffinity(0)))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..default_target import resolve_model_path
    from ..distill.prompts import opener
    from ..distill.run import chat_frame, eos_ids, pad_id
    from ..distill.sample import ATTENTION, SampleConfig, sample_batch
    from ..loading import parse_dtype

    try:
        path = resolve_model_path(model)
        tok = AutoTokenizer.from_pretrained(path)
        _, end_of_turn = chat_frame(tok)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype)).eval()
    except (ValueError, OSError) as err:
        fail(str(err))
    rng = random.Random(seed)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": opener(rng)}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])
               for _ in range(batch_size * batches)]
    batches_ids = [prompts[b * batch_size:(b + 1) * batch_size] for b in range(batches)]
    stop = sorted(eos_ids(lm, tok) | {end_of_turn})   # what ends an answer in spd data
    pad = pad_id(tok, stop)
    if tok.pad_token is None:   # generate's left padding needs one (Llama's tokenizers have none)
        tok.pad_token = tok.convert_ids_to_tokens(pad)

    def spd_sampler(batch, gen):
        lm.set_attn_implementation(ATTENTION)
        return sum(len(r.tokens) + r.finished for r in
                   sample_batch(lm, batch, SampleConfig(max_new_tokens, temperature), stop, pad, gen))

    def hf_generate(batch, gen):
        lm.set_attn_implementation("sdpa")
        tok.padding_side = "left"
        enc = tok.pad({"input_ids": batch}, return_tensors="pt")
        with torch.inference_mode():
            out = lm.generate(**enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                              temperature=temperature or None, top_k=0, top_p=1.0, eos_token_id=stop,
                              pad_token_id=pad)
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        return sum(next((i + 1 for i, t in enumerate(row) if t in stop), len(row)) for row in new)

    results = {"generate": [], "spd_data": []}
    for r in range(repeats):
        for name, fn in (("generate", hf_generate), ("spd_data", spd_sampler)):
            gen = torch.Generator().manual_seed(seed * 1000 + r)
            torch.manual_seed(seed * 1000 + r)
            start, tokens = time.perf_counter(), 0
            for batch in batches_ids:
                tokens += fn(batch, gen)
            results[name].append(tokens / (time.perf_counter() - start))
    best = {name: max(v) for name, v in results.items()}
    report = {"model": model, "dtype": dtype, "batch_size": batch_size, "batches": batches,
              "max_new_tokens": max_new_tokens, "temperature": temperature, "threads": torch.get_num_threads(),
              "answer_tokens_per_second": results, "best": best,
              "ratio_spd_data_vs_generate": best["spd_data"] / best["generate"], "load": os.getloadavg()[0]}
    if as_json:
        print(json.dumps(report))
        return
    for name, rates in results.items():
        typer.echo(f"{name:<10} answer tokens/s " + " ".join(f"{x:.0f}" for x in rates) + f"  (best {best[name]:.0f})")
    typer.echo(f"spd data / generate: {report['ratio_spd_data_vs_generate']:.2f}x  ({dtype}, batch {batch_size}, "
               f"{report['threads']} threads, load {report['load']:.1f})")
