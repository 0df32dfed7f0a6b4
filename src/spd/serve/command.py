"""The `spd serve` command: options only; the model, fastapi and uvicorn load when it runs."""

from __future__ import annotations

from typing import Optional

import typer


def serve(
    model: str = typer.Option(..., help="Model folder, hub id, or 'default' (the embedded SmolLM2-135M-Instruct)."),
    pdm: Optional[str] = typer.Option(None, help="PDM checkpoint folder from `spd train` (default: shipped one, else random)."),
    stages: Optional[int] = typer.Option(None, "--stages", "-n", help="Pipeline stages n (default: the PDM's, else 2)."),
    split: Optional[str] = typer.Option(None, help="Layers per stage, e.g. 8,8,7,7 (default: most even split)."),
    drafter: Optional[str] = typer.Option(None, help="hybrid (retrieval beside the PDM), pdm, or retrieval (no PDM). "
                                          "Default: hybrid when a PDM is given or ships, else retrieval."),
    distributed: bool = typer.Option(False, "--distributed", help="One process per stage (spd.runtime): spawned here, or joined under torchrun (rank 0 serves HTTP)."),
    draft_rank: str = typer.Option("separate", help="--distributed: 'separate' (own rank: n+1 processes) or 'with-first-stage' (n)."),
    devices: Optional[str] = typer.Option(None, help="--distributed: one device per rank, e.g. cuda:0,cuda:1,cuda:2 (default: GPU LOCAL_RANK, else CPU)."),
    timeout: float = typer.Option(30.0, min=0.1, help="--distributed: seconds a message may take before a request fails, naming the stage."),
    idle_timeout: float = typer.Option(600.0, min=1.0, help="--distributed: seconds a stage waits for the next command; the server pings idle stages every quarter of it."),
    lookahead: str = typer.Option("off", help="--distributed: off, on, or auto (start the next cycle before verifying)."),
    max_restarts: int = typer.Option(3, min=0, help="--distributed: times the stage processes are restarted after a stage dies or freezes, within 5 minutes; one more failure then is final."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port to listen on."),
    queue_size: int = typer.Option(16, min=1, help="Requests that may wait while one decodes; more get 429."),
    max_model_len: Optional[int] = typer.Option(None, help="Prompt + completion tokens at most (default: the model's)."),
    served_model_name: Optional[str] = typer.Option(None, help="Model id clients send (default: --model as given)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", help="Device for the single-process engine, e.g. cpu or cuda:0."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's choice; --distributed: cores / processes)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health) over SPD."""
    from ..cli import _setup, fail

    _setup(threads, verbose, set_threads=not distributed)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        fail("spd serve needs fastapi and uvicorn: pip install 'spd[serve]'")
    from ..loading import parse_dtype, parse_int_list
    from .app import run
    from ..runtime import StageFailure   # LayoutError is a ValueError
    from .backend import open_backend

    runtime = {"drafter": drafter}
    if distributed:
        from ..runtime.layout import parse_devices

        runtime.update(draft_rank=draft_rank, devices=parse_devices(devices), threads=threads, timeout=timeout,
                       idle_timeout=idle_timeout, lookahead=lookahead, max_restarts=max_restarts)
    try:
        backend = open_backend(model, pdm, stages, parse_int_list(split, "--split"), distributed,
                               parse_dtype(dtype), device, max_model_len, served_model_name, **runtime)
    except (StageFailure, ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    if backend is None:   # a torchrun rank that ran a stage for rank 0's server
        return
    run(backend, host, port, queue_size, log_level="info" if verbose else "warning")
