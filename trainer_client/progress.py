"""What the training thread is doing, for a watcher on another thread: section, busy or waiting.

The client holds one :class:`Progress`. The training thread marks it (the pipeline stage at the
start and end of every forward and backward, the resilient loop around the commit wait and the
recovery, the client around a checkpoint); the heartbeat thread publishes :meth:`Progress.snapshot`
with every beat. A rank whose count stops moving for longer than its section allows is hung even
though its process and heartbeat live; among the stalled ranks the one ``busy`` (computing, or in
user code) is the culprit, not those ``waiting`` on it (a receive, the commit).

Never: blocks, takes a lock, or raises (one attribute store per mark, under the GIL).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["SECTIONS", "Progress"]

#: the sections a rank reports: the training step, a checkpoint write, a recovery
SECTIONS = ("step", "checkpoint", "recovery")


class Progress:
    """The training thread's position: ``section``, ``state`` ("busy" or "waiting"), a mark count."""

    __slots__ = ("count", "section", "state", "t")

    def __init__(self) -> None:
        self.section, self.state, self.count, self.t = "step", "busy", 0, time.time()

    def busy(self) -> None:
        self.state, self.count, self.t = "busy", self.count + 1, time.time()

    def waiting(self) -> None:
        self.state, self.count, self.t = "waiting", self.count + 1, time.time()

    @contextmanager
    def section_of(self, section: str) -> Iterator[None]:
        """Inside: ``section`` (marked busy); after: the section before, busy again."""
        before = self.section
        self.section = section
        self.busy()
        try:
            yield
        finally:
            self.section = before
            self.busy()

    def snapshot(self) -> dict[str, Any]:
        return {"section": self.section, "state": self.state, "count": self.count, "t": self.t}
