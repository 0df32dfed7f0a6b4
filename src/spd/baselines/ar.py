"""Autoregressive decoding of the target with spd's own cache and sampling code.

The reference every SPD output is checked against (greedy: token for token) and the baseline
every speed figure is divided by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..sampling import SamplingParams, sample
from ..target import Target


@dataclass
class ARStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0            # target forwards after prefill
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return (self.new_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**self.__dict__, "decode_tokens_per_second": self.decode_tokens_per_second}


@torch.inference_mode()
def ar_stream(target: Target, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
              max_new_tokens: int = 128, eos_token_ids=(), stats: ARStats | None = None) -> Iterator[int]:
    """Yield new tokens one by one: one full target forward per token after the prefill."""
    stats = stats if stats is not None else ARStats()
    stats.prompt_tokens = len(prompt_ids)
    if max_new_tokens < 1:
        return
    device, eos = target.device, set(eos_token_ids)
    gen = params.generator(device)
    cache = target.new_cache(keep=1)   # no rollback: one recurrent state
    t0 = time.perf_counter()
    hidden, _ = target.prefill(torch.tensor(prompt_ids, device=device), cache)
    token = sample(target.logits(hidden[0, -1]), params, gen)
    stats.prefill_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    position = len(prompt_ids)
    while True:
        stats.new_tokens += 1
        yield token
        if token in eos or stats.new_tokens >= max_new_tokens:
            return
        hidden = target.embed(torch.tensor([token], device=device))
        hidden, _ = target.run_layers(hidden, torch.tensor([position], device=device),
                                      range(target.num_layers), cache)
        token = sample(target.logits(hidden[0, -1]), params, gen)
        position += 1
        stats.forwards += 1
        stats.decode_seconds = time.perf_counter() - t0


def ar_generate(target: Target, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                max_new_tokens: int = 128, eos_token_ids=None) -> tuple[list[int], ARStats]:
    eos = target.eos_token_ids if eos_token_ids is None else eos_token_ids
    stats = ARStats()
    tokens = list(ar_stream(target, prompt_ids, params, max_new_tokens, eos, stats))
    return tokens, stats
