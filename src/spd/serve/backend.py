"""What the server needs from a decoder, and the single-process backend over `engine.stream()`.

A backend decodes one sequence at a time and knows its tokenizer and limits. It knows nothing
about HTTP, queues or text: the worker drives it (every call from the worker thread), the app
talks to clients. `DistributedBackend` offers the same `stream()` over a spd.runtime session and
pings its stage processes while no request comes, so an idle server keeps its pipeline.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Generator, Protocol

from ..engine import SPDStats, stream
from ..loading import Decoder, build_decoder
from ..sampling import SamplingParams

log = logging.getLogger(__name__)


class Backend(Protocol):
    name: str                       # the model id clients send and /v1/models lists
    tokenizer: object | None        # a transformers tokenizer, or None (token-id prompts only)
    vocab_size: int
    max_model_len: int              # prompt + completion tokens, at most
    eos_token_ids: tuple[int, ...]
    n_stages: int
    keepalive_seconds: float | None  # call idle() at least this often between requests (None: never)
    alive: bool                     # False once it cannot decode any more (a stage died)

    def stream(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
               eos_token_ids, stats: SPDStats) -> Generator[int, None, None]:
        """Yield verified new tokens as they are decided, filling `stats`; close() stops decoding."""

    def idle(self) -> None:
        """Nothing to decode for `keepalive_seconds`: keep whatever waits on us alive."""

    def close(self) -> None:
        """The server stops: release processes and memory."""


@dataclass
class LocalBackend:
    """SPD in this process: the decoder's target, its PDM and stage split, on one device."""

    decoder: Decoder
    name: str
    max_model_len: int
    keepalive_seconds = None
    alive = True

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

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class DistributedBackend:
    """SPD over spd.runtime: a stage process per stage (spawned here, or torchrun's), rank 0 here."""

    session: object                 # spd.runtime.Session
    tokenizer: object | None
    name: str
    max_model_len: int

    @property
    def keepalive_seconds(self) -> float:
        return self.session.spec.idle_timeout / 4   # several pings per idle timeout: one late one is fine

    @property
    def alive(self) -> bool:
        return not self.session.closed

    @property
    def vocab_size(self) -> int:
        return self.session.target.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.session.target.eos_token_ids)

    @property
    def n_stages(self) -> int:
        return self.session.layout.n_stages

    def stream(self, prompt_ids, params, max_new_tokens, eos_token_ids, stats):
        return self.session.stream(prompt_ids, None, params, max_new_tokens, eos_token_ids, stats)

    def idle(self) -> None:
        self.session.ping()

    def close(self) -> None:
        self.session.close()


def model_context(config, fallback: int = 2048) -> int:
    """The target's own context length from its config."""
    return int(getattr(config, "max_position_embeddings", None) or fallback)


def open_backend(model: str, pdm: str | None = None, stages: int | None = None,
                 split: list[int] | None = None, distributed: bool = False, dtype=None,
                 device: str = "cpu", max_model_len: int | None = None,
                 served_model_name: str | None = None, **runtime_options) -> Backend | None:
    """Load the model and PDM behind a backend.

    `runtime_options` may name the drafter (hybrid, pdm, retrieval); distributed: plan and start
    spd.runtime (they go to `plan`: drafter, draft_rank, devices, threads, timeout, idle_timeout,
    lookahead). Under torchrun only rank 0 serves HTTP: the other
    ranks run their stage until the server stops, then this returns None for them.
    """
    if distributed:
        return _open_distributed(model, pdm, stages, split, dtype, max_model_len, served_model_name,
                                 **runtime_options)
    drafter = runtime_options.pop("drafter", None)
    if runtime_options:
        raise ValueError(f"{', '.join(sorted(runtime_options))} only apply with --distributed")
    kwargs = {} if dtype is None else {"dtype": dtype}
    decoder = build_decoder(model, stages, split, pdm, device=device, drafter=drafter, **kwargs)
    context = _context_limit(decoder.target.config, max_model_len)
    return LocalBackend(decoder, served_model_name or model, context)


def _open_distributed(model, pdm, stages, split, dtype, max_model_len, served_model_name,
                      draft_rank: str = "separate", **options) -> DistributedBackend | None:
    from ..runtime import plan, start
    from ..runtime.commands import load_tokenizer
    from ..runtime.weights import read_model_config

    if dtype is not None:
        options["dtype"] = str(dtype).removeprefix("torch.")
    spec = plan(model, stages, split, draft_rank, pdm, **options)   # checks before any weights load
    context = _context_limit(read_model_config(spec.model)[1], max_model_len)
    tokenizer = load_tokenizer(spec.model)
    session = start(spec)
    if session is None:   # a torchrun rank other than 0: its stage ran until the server stopped
        return None
    return DistributedBackend(session, tokenizer, served_model_name or model, context)


def _context_limit(config, max_model_len: int | None) -> int:
    context = model_context(config)
    if max_model_len is not None:
        if max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2; got {max_model_len}")
        if max_model_len > context:
            log.warning("--max-model-len %d is beyond the model's max_position_embeddings %d",
                        max_model_len, context)
        context = max_model_len
    return context
