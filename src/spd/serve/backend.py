"""What the server needs from a decoder, and the single-process backend over `engine.stream()`.

A backend decodes one sequence at a time and knows its tokenizer and limits. It knows nothing
about HTTP, queues or text: the worker drives it (every call from the worker thread), the app
talks to clients. `DistributedBackend` offers the same `stream()` over a spd.runtime session,
pings its stage processes while no request comes (so an idle server keeps its pipeline, and
notices a dead stage), and restarts them after a stage died or froze, a bounded number of times.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Generator, Protocol

from ..engine import stream
from ..loading import Decoder, build_decoder
from ..runtime.faults import StageFailure
from ..sampling import SamplingParams
from ..stats import SPDStats

log = logging.getLogger(__name__)


class Backend(Protocol):
    name: str                       # the model id clients send and /v1/models lists
    tokenizer: object | None        # a transformers tokenizer, or None (token-id prompts only)
    vocab_size: int
    max_model_len: int              # prompt + completion tokens, at most
    eos_token_ids: tuple[int, ...]
    n_stages: int
    keepalive_seconds: float | None  # call idle() at least this often between requests (None: never)
    state: str                      # "ok", "recovering" (heal() will restart it) or "failed" (for good)
    failure: str | None             # why it is recovering or failed
    restarts: int                   # how often heal() restarted it

    def stream(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
               eos_token_ids, stats: SPDStats) -> Generator[int, None, None]:
        """Yield verified new tokens as they are decided, filling `stats`; close() stops decoding."""

    def idle(self) -> None:
        """Nothing to decode for `keepalive_seconds`: keep whatever waits on us alive."""

    def heal(self) -> None:
        """state is "recovering": restart what failed (the worker calls it before the next job)."""

    def close(self) -> None:
        """The server stops: release processes and memory."""


@dataclass
class LocalBackend:
    """SPD in this process: the decoder's target, its PDM and stage split, on one device."""

    decoder: Decoder
    name: str
    max_model_len: int
    keepalive_seconds = None
    state = "ok"
    failure = None
    restarts = 0

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

    def heal(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class RestartPolicy:
    """At most `limit` restarts within `window` seconds; one more failure then is final."""

    limit: int = 3
    window: float = 300.0
    times: list[float] = field(default_factory=list)

    def allow(self, now: float) -> bool:
        self.times = [t for t in self.times if now - t < self.window]
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


@dataclass
class DistributedBackend:
    """SPD over spd.runtime: a stage process per stage (spawned here, or torchrun's), rank 0 here.

    When a stage dies or freezes, the session fails (the request in flight gets the error) and
    closes; `heal` then starts the stage processes again, as `policy` allows."""

    session: object                 # spd.runtime.Session
    tokenizer: object | None
    name: str
    max_model_len: int
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restarts: int = 0
    failure: str | None = None      # the last failure (while recovering, or why it failed for good)
    final: bool = False             # no more restarts

    @property
    def keepalive_seconds(self) -> float:
        # several pings per idle timeout (one late one is fine), and at least every 2 s, so that a
        # stage that dies between requests is restarted before the next request comes
        return min(self.session.spec.idle_timeout / 4, 2.0)

    @property
    def state(self) -> str:
        if self.final:
            return "failed"
        return "recovering" if self.session.closed else "ok"

    def heal(self) -> None:
        """Start the stage processes again with the same RunSpec (a new store and process group)."""
        from ..runtime import start

        if self.session.workers is None:   # torchrun's processes: not ours to restart
            self.final = True
            self.failure = (f"{self.failure}; the stages run under torchrun and cannot be restarted from "
                            f"here: restart the job")
            return
        if not self.policy.allow(time.monotonic()):
            self.final = True
            self.failure = (f"the pipeline failed {self.policy.limit + 1} times within "
                            f"{self.policy.window:.0f} s, so it is not restarted again (last failure: "
                            f"{self.failure}); see the server log, then restart the server")
            log.error("%s", self.failure)
            return
        log.warning("restarting the stage processes after: %s", self.failure)
        try:
            self.session = start(self.session.spec)
        except Exception as err:  # noqa: BLE001 -- a failed start is one more failure; the policy bounds them
            self.failure = f"restarting failed: {type(err).__name__}: {err}"
            log.error("%s", self.failure)
            return
        self.restarts += 1
        log.warning("stage processes restarted (%d restart(s) so far)", self.restarts)

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
        try:
            yield from self.session.stream(prompt_ids, None, params, max_new_tokens, eos_token_ids, stats)
        except StageFailure as err:
            self.failure = str(err)
            raise

    def idle(self) -> None:
        try:
            self.session.ping()
        except StageFailure as err:
            self.failure = str(err)
            raise

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
                      draft_rank: str = "separate", max_restarts: int = 3, **options) -> DistributedBackend | None:
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
    return DistributedBackend(session, tokenizer, served_model_name or model, context,
                              RestartPolicy(limit=max_restarts))


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
