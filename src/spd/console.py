"""What every `spd` command shares: a one-line error, logging and torch threads, streamed text.

Commands (spd.cli and the `command.py` modules beside the code they run) import this module;
it imports none of them.
"""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """`error: MESSAGE` on stderr, one line, exit status 2 (no traceback)."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def setup(threads: int | None, verbose: bool = False, set_threads: bool = True) -> None:
    """Logging and torch threads (checked even when the processes of --distributed set them)."""
    import torch

    if threads is not None and threads < 1:
        fail(f"--threads must be at least 1; got {threads}")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if threads and set_threads:
        torch.set_num_threads(threads)


class TextStream:
    """Prints decoded text as tokens arrive (decoding the whole so far keeps multi-byte chars whole)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.printed = tokenizer, [], ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text
