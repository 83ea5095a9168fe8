"""Stop strings over a stream of text pieces: a stop string may begin in one token and end in a later one.

The text a client sees must end just before the first stop string to complete and must never contain any part of it.
So each new piece is appended to a small tail of text held back: everything that can no longer be the
start of a stop string is released, and a tail that might still grow into one (a suffix that is a prefix
of some stop string) waits for the next piece. At most the longest stop string minus one character is
ever held.
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # text not yet released: it could be the beginning of a stop string
        self.stopped = False

    # Task L9.2: stop strings across pieces: release what can no longer start one, hold a suffix that might
    def push(self, piece: str) -> str:
        """Append `piece`; return the text now safe to release. After a match, `stopped` is set and the text
        before the stop string is the last ever returned."""
        if self.stopped:
            return ""
        text = self.held + piece
        # The stop string that completes first ends the output, as it would token by token (on a tie, the
        # longer one): then where the tokens happened to split the text cannot change the answer.
        ends = [(i + len(s), -len(s)) for s in self.stops if (i := text.find(s)) >= 0]
        if ends:
            end, minus_length = min(ends)
            self.stopped, self.held = True, ""
            return text[:end + minus_length]
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    # Task L9.2: stop strings across pieces: release what can no longer start one, hold a suffix that might
    def flush(self) -> str:
        """The output ended without a stop string: what was held is plain text after all."""
        text, self.held = self.held, ""
        return "" if self.stopped else text

    # Task L9.2: stop strings across pieces: release what can no longer start one, hold a suffix that might
    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
