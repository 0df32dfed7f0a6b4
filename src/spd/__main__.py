"""`python -m spd ...`: the `spd` command, run by the interpreter at hand (what `make demo` uses)."""

from .cli import app

app(prog_name="spd")
