"""The `spd serve` command: its options are spd.options.ServeOptions; the model, fastapi and uvicorn
load when it runs."""

from __future__ import annotations

from ..console import fail, setup
from ..options import ServeOptions


def serve(opts: ServeOptions):
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health) over SPD."""
    setup(opts.threads, opts.verbose, set_threads=not opts.distributed)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        fail("spd serve needs fastapi and uvicorn: pip install 'spd[serve]'")
    from ..loading import parse_dtype
    from ..runtime import StageFailure  # LayoutError is a ValueError
    from .app import run
    from .backend import open_backend

    try:
        runtime = opts.runtime() if opts.distributed else {"drafter": opts.drafter}
        backend = open_backend(opts.model, opts.pdm, opts.stages, opts.split_list(), opts.distributed,
                               parse_dtype(opts.dtype), opts.device, opts.max_model_len, opts.served_model_name,
                               **runtime)
    except (StageFailure, ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))
    if backend is None:   # a torchrun rank that ran a stage for rank 0's server
        return
    run(backend, opts.host, opts.port, opts.queue_size, log_level="info" if opts.verbose else "warning")
