"""spd: Speculative Pipeline Decoding."""

__version__ = "0.1.0"
