"""Stop strings over streamed text: cut before the first stop, never emit part of one.

A stop string can arrive split over several deltas ("\\n\\nUs" then "er:"), so the
matcher holds back the longest suffix of the unemitted text that could still begin a
stop string, and releases it once it cannot.

Invariants:
- emitted text never contains a stop string, nor ends with text later found to start
  one: a stop is found inside (held-back suffix + new text), since anything emitted
  earlier is followed by no prefix of a stop (the held suffix was the longest one);
- the emitted text is the stream's text up to the earliest occurrence of any stop
  string (ties at one position: the first in ``stops``), or all of it, after ``flush``.
"""

from __future__ import annotations


class StopStringMatcher:
    """Filters one sequence's text deltas against its stop strings.

    With no stop strings it passes text straight through and never holds any back.
    After a stop string matches the sequence is over and ``feed`` must not be called.
    """

    __slots__ = ("_stops", "_held", "_longest", "_matched")

    def __init__(self, stops: tuple[str, ...]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = stops
        self._longest = max((len(stop) for stop in stops), default=0)
        self._held = ""  # unemitted text that is a prefix of some stop string
        self._matched: str | None = None

    @property
    def held(self) -> str:
        """Text received but not yet emitted because it may begin a stop string."""
        return self._held

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        found = [(text.find(stop), rank, stop) for rank, stop in enumerate(self._stops)]
        hits = [(start, rank, stop) for start, rank, stop in found if start >= 0]
        if not hits:
            return None
        start, _, stop = min(hits)
        return start, stop

    def _partial_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Take the next delta; return (text now safe to emit, the stop matched or None).

        On a match the returned text ends just before the stop string, and what follows
        it is dropped.
        """
        if self._matched is not None:
            raise RuntimeError(f"stop string {self._matched!r} already ended this sequence")
        if not self._stops:
            return new_text, None
        text = self._held + new_text
        hit = self._first_stop(text)
        if hit is not None:
            start, self._matched = hit
            self._held = ""
            return text[:start], self._matched
        cut = len(text) - self._partial_length(text)
        self._held = text[cut:]
        return text[:cut], None

    def flush(self) -> str:
        """The held-back text, for a sequence that ended for another reason."""
        held, self._held = self._held, ""
        return held
