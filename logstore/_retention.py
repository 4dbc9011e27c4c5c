"""Retention: checkpoint registrations, the watermarks they make, and the GC that follows them.

A registration (``logstore.checkpoints``) says that stage k's checkpoint at iteration c is
durable. The watermark of stage k is its newest registered iteration; a logging group's members
share the oldest of their newest ones. :class:`Retention` writes and withdraws registrations in
the cold tier and the hot indexes of this node, reads them back (a document that cannot be
trusted is left out, warned about once and kept for ``verify``), caches the watermarks, and
runs GC by them in both tiers.

Never: deletes a record at or above its owner's watermark; trusts a registration whose content
disagrees with its name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from logstore._cold_index import ColdIndex
from logstore._hot_tiers import HotTiers
from logstore.checkpoints import (
    CheckpointInfo,
    check_meta,
    cold_name,
    hot_name,
    parse_cold_name,
    parse_doc,
    parse_hot_name,
)
from logstore.cold import ColdTier
from logstore.errors import ConfigError, CorruptRecordError, StoreError, SwiftlogError
from logstore.hot import EVICTED
from logstore.reports import GcReport, UnregisterPreview

__all__ = ["Retention", "group_watermarks"]

logger = logging.getLogger(__name__)


def group_watermarks(wm: dict[int, int], groups: Any) -> dict[int, int]:
    """``wm`` with each logging group's members at the group's oldest newest checkpoint (a member
    without one: 0, nothing of the group is garbage). ``groups``: sizes of consecutive groups."""
    if not isinstance(groups, list) or not all(isinstance(n, int) and n > 0 for n in groups):
        return wm
    out, first = dict(wm), 0
    for n in groups:
        members = range(first, first + n)
        low = min(wm.get(k, 0) for k in members)
        for k in members:
            if k in out or low:
                out[k] = low
        first += n
    return out


class Retention:
    """Registrations, watermarks and GC of one run on this node (see the module docstring).

    ``note_error`` records a cold tier error a read path falls back from; ``after_gc`` runs after
    every GC (the store refreshes its upload backlog there). Thread-safe.
    """

    def __init__(
        self,
        run: str,
        cold: ColdTier | None,
        cold_index: ColdIndex | None,
        tiers: HotTiers,
        *,
        stale_upload_age: timedelta,
        note_error: Callable[[BaseException], None],
        after_gc: Callable[[], None],
    ) -> None:
        self.run = run
        self.cold = cold
        self._cold_index = cold_index
        self._tiers = tiers
        self._stale_upload_age = stale_upload_age
        self._note_error = note_error
        self._after_gc = after_gc
        self._lock = threading.Lock()
        # stage -> its newest registered checkpoint (raw: groups applied on the way out)
        self._wm_cache: dict[int, int] = {}
        self._wm_groups: Any = None  # the logging groups the newest registration named
        self._wm_at = 0.0
        self._ckpt_warned: set[str] = set()  # registration documents warned about (once each)
        self.problems: list[dict[str, str]] = []  # registration documents left out by the last checkpoints()

    # ---------------------------------------------------------------- registrations
    def register(
        self, stage: int, iteration: int, *, uri: str | None = None, meta: dict[str, Any] | None = None
    ) -> CheckpointInfo:
        """``LogStore.register_checkpoint``."""
        if (
            isinstance(stage, bool)
            or not isinstance(stage, int)
            or stage < 0
            or isinstance(iteration, bool)
            or not isinstance(iteration, int)
            or iteration < 0
        ):
            raise ConfigError(
                f"checkpoint needs stage >= 0 and iteration >= 0, got stage={stage!r} iteration={iteration!r}"
            )
        # Stored as JSON, served as UTF-8: a lone surrogate, a NaN or a deep nest would break every later read.
        try:
            check_meta({} if meta is None else meta)
        except ValueError as e:
            raise ConfigError(
                f"checkpoint meta of stage {stage} iteration {iteration} is not portable JSON within the limits: {e}",
                hint="meta must be a small JSON object: valid Unicode, finite numbers, a few levels deep",
            ) from e
        info = CheckpointInfo(stage, iteration, uri, time.time(), dict(meta or {}))
        doc = asdict(info)
        if self.cold is not None:
            self.cold.put_doc(cold_name(self.run, stage, iteration), doc)
        own = self._tiers.own
        hots = [own] if own is not None else self._tiers.all()[:1]
        for hot in hots:
            hot.put_doc(hot_name(stage, iteration), doc)
        with self._lock:
            if iteration > self._wm_cache.get(stage, -1):
                self._wm_cache[stage] = iteration
            if info.meta.get("logging_groups"):
                self._wm_groups = info.meta["logging_groups"]
        return info

    def unregister(self, stage: int, iteration: int) -> CheckpointInfo | None:
        """``LogStore.unregister_checkpoint``."""
        found = next((c for c in self.checkpoints() if (c.stage, c.iteration) == (stage, iteration)), None)
        if self.cold is not None:
            self.cold.delete_doc(cold_name(self.run, stage, iteration))
        for hot in self._tiers.all():
            hot.delete_doc(hot_name(stage, iteration))
        with self._lock:
            self._wm_cache.pop(stage, None)
            self._wm_at = 0.0  # the next watermarks() reads the registrations again
        return found

    def adopt(self, doc: dict[str, Any]) -> CheckpointInfo:
        """``LogStore.adopt_registration``."""
        named = (doc.get("stage"), doc.get("iteration")) if isinstance(doc, dict) else None
        info, _ = parse_doc("a registration from another node", named, doc)  # type: ignore[arg-type]
        own = self._tiers.own
        hots = [own] if own is not None else self._tiers.all()[:1]
        if not hots:
            raise StoreError(f"run {self.run!r}: no hot index on this node to record a registration in")
        hots[0].put_doc(hot_name(info.stage, info.iteration), asdict(info))
        with self._lock:
            self._wm_at = 0.0
        return info

    def preview_unregister(self, stage: int, iteration: int) -> UnregisterPreview | None:
        """``LogStore.preview_unregister``."""
        cps = self.checkpoints()
        found = next((c for c in cps if (c.stage, c.iteration) == (stage, iteration)), None)
        if found is None:
            return None
        before = self._watermarks_of(cps)
        after = self._watermarks_of([c for c in cps if c is not found])
        gc_before, gc_after = self.gc(dry_run=True, watermarks=before), self.gc(dry_run=True, watermarks=after)
        return UnregisterPreview(found, before, after, gc_before, gc_after)

    def checkpoints(self, *, hot_only: bool = False) -> list[CheckpointInfo]:
        """``LogStore.checkpoints``; what it left out is in ``problems``."""
        found: dict[tuple[int, int], CheckpointInfo] = {}
        problems: list[dict[str, str]] = []
        for hot in self._tiers.all():
            for name, d in hot.docs("ckpt/").items():
                info = self._registration(f"{name} in {hot.dir}", "hot", parse_hot_name(name), d, problems)
                if info is not None:
                    found[(info.stage, info.iteration)] = info
        if self.cold is not None and not hot_only:
            for name in self.cold.list_docs(f"{self.run}/checkpoints/"):
                d = self.cold.get_doc(name)
                if d:
                    info = self._registration(name, "cold", parse_cold_name(name), d, problems)
                    if info is not None:
                        found[(info.stage, info.iteration)] = info
        with self._lock:
            self.problems = problems
        return [found[k] for k in sorted(found)]

    def _registration(
        self, where: str, tier: str, named: tuple[int, int] | None, doc: Any, problems: list[dict[str, str]]
    ) -> CheckpointInfo | None:
        """One registration document read by :meth:`checkpoints`: parsed, or None (noted in
        ``problems`` and warned about once) when it cannot be trusted."""
        try:
            info, unknown = parse_doc(where, named, doc)
        except CorruptRecordError as e:
            problems.append({"tier": tier, "key": "", "where": where, "error": e.message})
            self._warn_once(where, e.message)
            return None
        if unknown:
            fields = ", ".join(unknown)
            self._warn_once(where + "#fields", f"checkpoint registration {where}: unknown field(s) {fields} ignored")
        return info

    def _warn_once(self, what: str, message: str) -> None:
        with self._lock:
            if what in self._ckpt_warned:
                return
            self._ckpt_warned.add(what)
        logger.warning("run %s: %s", self.run, message)

    # ---------------------------------------------------------------- watermarks
    @staticmethod
    def _newest(cps: list[CheckpointInfo]) -> tuple[dict[int, int], Any]:
        """Each stage's newest registered iteration, and the logging groups of the newest
        registration naming any."""
        wm: dict[int, int] = {}
        groups = None
        for c in sorted(cps, key=lambda c: c.registered_at):
            wm[c.stage] = max(wm.get(c.stage, 0), c.iteration)
            groups = c.meta.get("logging_groups") or groups
        return wm, groups

    @classmethod
    def _watermarks_of(cls, cps: list[CheckpointInfo]) -> dict[int, int]:
        """The watermarks the registrations ``cps`` make (groups applied)."""
        return group_watermarks(*cls._newest(cps))

    def watermarks(self, max_age: float = 0.0) -> dict[int, int]:
        """``LogStore.watermarks``."""
        with self._lock:
            if max_age and time.monotonic() - self._wm_at < max_age:
                return group_watermarks(self._wm_cache, self._wm_groups)
        try:
            wm, groups = self._newest(self.checkpoints())
        except SwiftlogError as e:
            if max_age:  # a read path: fall back to what we knew, and ask again only after max_age
                self._note_error(e)
                with self._lock:
                    self._wm_at = time.monotonic()
                    return group_watermarks(self._wm_cache, self._wm_groups)
            raise
        with self._lock:
            self._wm_cache = dict(wm)
            self._wm_groups = groups
            self._wm_at = time.monotonic()
            return group_watermarks(wm, self._wm_groups)

    def cached_watermarks(self, max_age: float) -> dict[int, int] | None:
        """The watermarks as last read, when that was less than ``max_age`` seconds ago; else None.
        Never reads the registrations (no I/O)."""
        with self._lock:
            if time.monotonic() - self._wm_at >= max_age:
                return None
            return group_watermarks(self._wm_cache, self._wm_groups)

    # ---------------------------------------------------------------- GC
    def gc(self, *, dry_run: bool = False, watermarks: dict[int, int] | None = None) -> GcReport:
        """``LogStore.gc``."""
        if watermarks is not None and not dry_run:
            raise ConfigError("gc(watermarks=...) is a dry run only", hint="a GC deletes by the registered checkpoints")
        wm = self.watermarks() if watermarks is None else dict(watermarks)
        rep = GcReport(dry_run=dry_run, watermarks=wm)
        for hot in self._tiers.all():
            keys, segs = hot.gc(wm, dry_run=dry_run)
            rep.hot_records += len(keys)
            rep.hot_segments += len(segs)
            rep.hot_bytes += sum(m.file_size for m in segs if m.state != EVICTED)
            rep.keys.extend(str(k) for k in keys[: max(0, 1000 - len(rep.keys))])
        if self.cold is not None and self._cold_index is not None:
            self._gc_cold(wm, rep, dry_run)
        self._after_gc()
        return rep

    def _gc_cold(self, wm: dict[int, int], rep: GcReport, dry_run: bool) -> None:
        """The cold half of :meth:`gc`: segments wholly below their owner's watermark, objects left
        without a marker, stale multipart uploads."""
        assert self.cold is not None and self._cold_index is not None
        for seg in self._cold_index.segments(None, refresh=True):
            w = wm.get(seg.channel.owner)
            if w and seg.hi < w:
                rep.cold_segments += 1
                rep.cold_bytes += seg.size
                rep.segments.append(seg.name)
                if not dry_run:
                    self.cold.delete_segment(seg.name)
        # objects left without a marker (a crashed upload, a crash between a delete's marker and object)
        age = self._stale_upload_age
        stale = self.cold.remove_uncommitted(age, prefix=f"{self.run}/segments/", dry_run=dry_run)
        for name, size in stale.items():
            rep.cold_segments += 1
            rep.cold_bytes += size
            rep.segments.append(name)
        if not dry_run:
            rep.aborted_uploads = self.cold.abort_stale_uploads(self._stale_upload_age, prefix=f"{self.run}/")
            self._cold_index.invalidate(forget=rep.segments)
