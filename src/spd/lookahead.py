"""Lookahead: whether the loop issues the next cycle before verifying the exiting token.

Only worth it where the stages run in other processes (spd.runtime); `LocalStages` never does.
"""

from __future__ import annotations

LOOKAHEAD = ("off", "on", "auto")


class LookaheadPolicy:
    """Whether to issue the next cycle before verifying: "off", "on", or "auto" (when it pays).

    Looking ahead hides the verification time V of every exit and wastes one cycle T on every
    rejection, so "auto" looks ahead while the running acceptance a > 1 - V / T.
    """

    def __init__(self, mode: str, smoothing: float = 0.1):
        if mode not in LOOKAHEAD:
            raise ValueError(f"lookahead must be one of {', '.join(LOOKAHEAD)}; got {mode!r}")
        self.mode, self.smoothing = mode, smoothing
        self.acceptance, self.verify, self.step = 0.5, 0.0, 0.0

    def ahead(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        return self.step > 0 and self.acceptance > 1.0 - self.verify / self.step

    def update(self, accepted: bool, verify_seconds: float, step_seconds: float) -> None:
        mix = lambda old, new: old + self.smoothing * (new - old)  # noqa: E731
        self.acceptance = mix(self.acceptance, float(accepted))
        self.verify = mix(self.verify, verify_seconds) if self.verify else verify_seconds
        self.step = mix(self.step, step_seconds) if self.step else step_seconds
