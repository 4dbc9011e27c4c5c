"""The hot tiers of one run on this node: this process's own and every other writer's, to read.

A :class:`HotTiers` opens each writer's index under ``<root>/<run>/`` once, walks it
(``HotTier.check_readable``) and caches it. A writer's index that cannot be opened or read is
left out and tried again after 10 s; one whose read failed later (``HotTier.damaged``) is left
out from then on. Either way the reason is kept for ``unreadable_writers`` and ``verify``.

Never: creates anything in another writer's directory; hands out a reader whose index failed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from logstore.errors import CorruptIndexError, StoreError
from logstore.hot import HotTier

__all__ = ["HotTiers", "list_runs", "writers_under"]

logger = logging.getLogger(__name__)


def list_runs(root: str | os.PathLike[str]) -> list[str]:
    """Runs with a hot tier under ``root`` (directories with at least one writer index)."""
    p = Path(root)
    if not p.is_dir():
        return []
    return sorted(d.name for d in p.iterdir() if d.is_dir() and writers_under(d))


def writers_under(run_dir: str | os.PathLike[str]) -> list[str]:
    """Writers with a hot tier (an index) under a run's directory; [] when it cannot be read."""
    try:
        return sorted(w.name for w in Path(run_dir).iterdir() if (w / "index").is_dir())
    except OSError:
        return []


def _open_reader(directory: Path) -> HotTier:
    """Another writer's hot tier opened to read, its index walked once (``check_readable``): a
    damaged index is left out when it is opened, not met in every later listing. Raises StoreError
    (CorruptIndexError for a damaged, truncated or missing index)."""
    reader = HotTier(directory, owner=False)
    try:
        reader.check_readable()
    except CorruptIndexError:
        reader.close()
        raise
    return reader


class HotTiers:
    """The hot tiers under ``run_dir``: ``own`` (this process's writer, once attached) and the
    other writers', opened read-only and cached. Thread-safe."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.own: HotTier | None = None
        self._lock = threading.Lock()
        self._readers: dict[str, HotTier] = {}
        self._unreadable: dict[str, tuple[str, float]] = {}  # writer -> why its index was left out, and when
        self._readers_scanned = 0.0

    def attach_own(self, writer: str, hot: HotTier) -> None:
        """This process's own hot tier (its writer's): listed first, never left out."""
        self.own = hot
        self._readers[writer] = hot

    def all(self) -> list[HotTier]:
        """Own hot tier plus every other writer's under root/run (opened read-only, cached)."""
        with self._lock:
            now = time.monotonic()
            if now - self._readers_scanned > 1.0 and self.run_dir.is_dir():
                self._readers_scanned = now
                for d in sorted(self.run_dir.iterdir()):
                    # A writer's index that could not be opened or read is tried again after a while. One
                    # being created by its writer at this moment is not there yet; a damaged one is warned
                    # about once per retry.
                    bad = self._unreadable.get(d.name)
                    if d.name not in self._readers and (bad is None or now - bad[1] > 10.0) and (d / "index").is_dir():
                        try:
                            reader = _open_reader(d)
                        except StoreError as e:
                            logger.warning("leaving out hot tier %s: %s", d, e)
                            self._unreadable[d.name] = (str(e), now)
                            continue
                        self._unreadable.pop(d.name, None)
                        self._readers[d.name] = reader
                # damaged since it was opened (a read raised CorruptIndexError)
                for name, reader in list(self._readers.items()):
                    if reader.damaged is not None and reader is not self.own:
                        logger.warning("leaving out hot tier %s: %s", reader.dir, reader.damaged)
                        self._unreadable[name] = (reader.damaged, now)
                        del self._readers[name]
                        reader.close()
            return list(self._readers.values())

    def writers(self) -> list[str]:
        """Names of the writers with a hot tier of this run under this root (sorted; [] for none)."""
        return writers_under(self.run_dir)

    def unreadable(self) -> dict[str, str]:
        """Writers whose index readers leave out (damaged, truncated, missing), and why; {} when none."""
        self.all()
        with self._lock:
            return {w: why for w, (why, _) in sorted(self._unreadable.items())}

    def why_unreadable(self, writer: str, default: str) -> str:
        """Why ``writer``'s index was left out when it was last tried (``default`` if it was not)."""
        return self._unreadable.get(writer, (default, 0.0))[0]

    def close(self) -> None:
        """Close every hot tier opened here, the own one too."""
        with self._lock:
            for hot in self._readers.values():
                hot.close()
            self._readers.clear()
