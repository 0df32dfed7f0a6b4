"""What the server needs from a decoder, and the single-process backend over `engine.stream()`.

A backend decodes one sequence at a time and knows its tokenizer and limits. It knows nothing
about HTTP, queues or text: the worker drives it, the app talks to clients. The distributed
runtime plugs in by offering the same `stream()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Generator, Protocol

from ..engine import SPDStats, stream
from ..loading import Decoder, build_decoder
from ..sampling import SamplingParams

log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """The asked-for backend cannot run in this installation (the message says why and what to do)."""


class Backend(Protocol):
    name: str                       # the model id clients send and /v1/models lists
    tokenizer: object | None        # a transformers tokenizer, or None (token-id prompts only)
    vocab_size: int
    max_model_len: int              # prompt + completion tokens, at most
    eos_token_ids: tuple[int, ...]
    n_stages: int

    def stream(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
               eos_token_ids, stats: SPDStats) -> Generator[int, None, None]:
        """Yield verified new tokens as they are decided, filling `stats`; close() stops decoding."""


@dataclass
class LocalBackend:
    """SPD in this process: the decoder's target, its PDM and stage split, on one device."""

    decoder: Decoder
    name: str
    max_model_len: int

    @property
    def tokenizer(self):
        return self.decoder.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.decoder.target.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.decoder.target.eos_token_ids)

    @property
    def n_stages(self) -> int:
        return len(self.decoder.stages)

    def stream(self, prompt_ids, params, max_new_tokens, eos_token_ids, stats):
        dec = self.decoder
        return stream(dec.target, dec.drafter(), prompt_ids, dec.stages, params, max_new_tokens,
                      eos_token_ids, stats)


def model_context(config, fallback: int = 2048) -> int:
    """The target's own context length from its config."""
    return int(getattr(config, "max_position_embeddings", None) or fallback)


def open_backend(model: str, pdm: str | None = None, stages: int | None = None,
                 split: list[int] | None = None, distributed: bool = False, dtype=None,
                 device: str = "cpu", max_model_len: int | None = None,
                 served_model_name: str | None = None) -> Backend:
    """Load the model and PDM behind a backend; `--distributed` needs spd.runtime."""
    if distributed:
        raise BackendUnavailable(
            "--distributed is not available yet: the distributed runtime (spd.runtime) has no "
            "serving backend in this installation. Serve without --distributed to run the "
            "single-process engine.")
    kwargs = {} if dtype is None else {"dtype": dtype}
    decoder = build_decoder(model, stages, split, pdm, device=device, **kwargs)
    context = model_context(decoder.target.config)
    if max_model_len is not None:
        if max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2; got {max_model_len}")
        if max_model_len > context:
            log.warning("--max-model-len %d is beyond the model's max_position_embeddings %d",
                        max_model_len, context)
        context = max_model_len
    return LocalBackend(decoder, served_model_name or model, context)
