"""Incremental detokenization with stop strings: tokens in, text that is safe to show out.

Decoding the last few tokens with one token of context keeps word spacing and multi-byte
characters right at O(1) cost per token (the prefix/read offsets of TGI and vLLM). Text that
could still become the start of a stop string is held back until it cannot; once a stop string
appears, the text is cut just before it and generation should end.
"""

from __future__ import annotations


class StopText:
    """Turns one sequence's tokens into released text, cut at the first stop string."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.prefix = self.read = 0   # tokens[prefix:read] is context already turned into text
        self.text = ""                # all text so far (cut before a stop string once found)
        self.released = 0             # characters of text already handed out
        self.stopped = False          # a stop string was found

    def add(self, token: int) -> str:
        """Take one new token; return the newly releasable text (may be empty)."""
        assert not self.stopped, "no tokens after a stop string"
        self.tokens.append(token)
        self._decode(final=False)
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The sequence ended: release everything still held back."""
        if not self.stopped:
            self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        if self.tokenizer is None:
            return
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        context = decode(self.tokens[self.prefix:self.read])
        fresh = decode(self.tokens[self.prefix:])
        if len(fresh) <= len(context) or (fresh.endswith("\ufffd") and not final):
            return  # nothing new yet, or half a multi-byte character
        start = len(self.text)
        self.text += fresh[len(context):]
        self.prefix, self.read = self.read, len(self.tokens)
        self._cut_at_stop(max(0, start - self.hold))

    def _cut_at_stop(self, search_from: int) -> None:
        found = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True

    def _held(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        for k in range(min(self.hold, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop):
                return k
        return 0

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.released, len(self.text) - self._held())
        out = self.text[self.released:end]
        self.released = end
        return out
