"""`spd generate --distributed`: the CLI's one call into the runtime (printing stays in the CLI)."""

from __future__ import annotations

import logging
from typing import Callable

from ..options import GenerateOptions

log = logging.getLogger(__name__)


def load_tokenizer(folder: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as err:
        log.info("no tokenizer in %s (%s); token ids only", folder, err)
        return None


def distributed_generate(opts: GenerateOptions, on_token_for: Callable | None = None) -> dict | None:
    """Plan (checks, no weights), start or join the processes, decode one prompt on rank 0.

    Returns the CLI's output dict on rank 0 and None on the other ranks of a torchrun job.
    Raises LayoutError/ValueError for bad arguments (before any weights load) and
    StageFailure when a stage dies or hangs.
    """
    from ..loading import check_prompt, context_length, encode_prompt
    from .launch import plan, start
    from .weights import read_model_config

    prompt_ids, params, max_new_tokens = opts.checked_prompt_ids(), opts.sampling(), opts.max_new_tokens
    spec = plan(opts.model, opts.stages, opts.split_list(), pdm=opts.pdm, dtype=opts.dtype, tree_width=opts.tree_width,
                **opts.runtime())
    tokenizer = load_tokenizer(spec.model)
    ids = prompt_ids if prompt_ids is not None else encode_prompt(tokenizer, opts.prompt, opts.raw)
    config = read_model_config(spec.model)[1]
    check_prompt(ids, config.vocab_size, context_length(config), max_new_tokens)   # before any process starts
    session = start(spec)
    if session is None:   # this rank ran a stage until rank 0 said STOP
        return None
    with session:
        eos = () if opts.ignore_eos else session.target.eos_token_ids
        on_token = on_token_for(tokenizer) if on_token_for is not None and tokenizer is not None else None
        result = session.generate(ids, params=params, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                                  on_token=on_token)
    out = {"text": tokenizer.decode(result.tokens, skip_special_tokens=True) if tokenizer else None,
           "token_ids": result.tokens, "stats": result.stats.to_dict(), "stage_layers": list(spec.stage_layers),
           "draft_rank": spec.draft_rank}
    if opts.compare_ar:  # an explicit check: loads the whole model into this process once more
        from ..baselines.ar import ar_generate
        from ..loading import parse_dtype
        from ..target import load_target

        target, _ = load_target(spec.model, dtype=parse_dtype(spec.dtype))
        ar_tokens, ar_stats = ar_generate(target, ids, params, max_new_tokens, eos)
        out.update(ar_token_ids=ar_tokens, ar_decode_seconds=ar_stats.decode_seconds,
                   ar_decode_tokens_per_second=ar_stats.decode_tokens_per_second,
                   match=ar_tokens == result.tokens if params.greedy else None)
    return out
