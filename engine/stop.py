"""Stop strings over streamed text: never emit a stop string, even one split
across tokens, and never hold back more text than could still become one."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back what is safe to emit and whether to stop."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._held = ""  # suffix that might be the start of a stop string

    def push(self, text: str) -> tuple[str, bool]:
        """Add a delta.

        Returns:
            (emit, stopped): text safe to emit now, and True when a stop string
            was found (``emit`` then ends right before it).
        """
        if not self.stop:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._longest_partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Text held back at the end of generation (no stop string came)."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buf: str) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


def final_text(detokenizer, stopper: StopMatcher) -> tuple[str, bool]:
    """Flush a finished sequence's streaming detokenizer through its stop
    matcher: the text still to emit, and whether a stop string ended it."""
    detokenizer.finalize()
    tail, stopped = stopper.push(detokenizer.last_segment)
    return (tail, True) if stopped else (tail + stopper.flush(), False)
