"""The shipper: what moves sealed segments from the hot tier to the cold tier.

A :class:`Shipper` runs a writer's upload thread: sealing a segment queues it, and the thread
copies the sealed file byte-for-byte to the cold tier (commit marker last), precious channels
first (inputs, targets, META and what ``seal()`` named). Upload state lives in the hot index and
is reconciled with the cold listing at start, so a crash at any point converges. While the
object store is down, segments stay sealed in the hot tier and uploads resume with backoff.

It also keeps the upload backlog (``max_backlog_bytes``), evicts uploaded segments beyond
``hot_max_bytes`` once their committed copy is confirmed, answers ``wait_shipped`` from memory,
and fences a writer whose later incarnation ships (``WriterFencedError``). Cold tier errors of
the whole store are counted here (``note_error``, ``stats()["upload"]``).

Never: blocks a writer's ``put`` on the object store; drops a hot copy whose committed copy is
not confirmed to be exactly its bytes; lets a bad item kill the upload thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from logstore._cold_index import ColdIndex, cold_name_parts
from logstore._hot_tiers import HotTiers
from logstore.cold import ColdTier
from logstore.config import StoreConfig
from logstore.errors import (
    ColdTierUnavailableError,
    ConfigError,
    SegmentClashError,
    StoreError,
    StoreFullError,
    SwiftlogError,
    WriterFencedError,
)
from logstore.hot import EVICTED, OPEN, SEALED, UPLOADED, HotTier, SegmentMeta
from logstore.keys import Channel, Kind

__all__ = ["Shipper"]

logger = logging.getLogger(__name__)

_PRECIOUS_KINDS = frozenset({Kind.INPUT, Kind.TARGET, Kind.META, Kind.REDUCED})
_FENCED_HINT = "its records stay in its hot tier; stop its process (its stage was replaced)"


def _precious(channel: str, first: set[str]) -> bool:
    """Uploaded before the bulk: channels sealed through ``seal()`` and, even without that (a writer
    reopened, another process's flush), inputs, targets and META: what only their stage had."""
    if channel in first:
        return True
    try:
        return Channel.parse(channel).kind in _PRECIOUS_KINDS
    except SwiftlogError:
        return False


class Shipper:
    """Uploads, backlog, eviction and cold tier error counts of one store (see the module docstring).

    Made by ``LogStore`` for every store; :meth:`start` attaches the writer's hot tier and, with a
    cold tier and ``upload``, starts the upload thread. Thread-safe.
    """

    def __init__(
        self, config: StoreConfig, cold: ColdTier | None, cold_index: ColdIndex | None, tiers: HotTiers
    ) -> None:
        self.config = config
        self.run = config.run
        self.cold = cold
        self._cold_index = cold_index
        self._tiers = tiers
        self._writer = config.writer
        self.hot: HotTier | None = None
        self._upload_lock = threading.Lock()
        self._gaps_shipped: set[str] = set()
        self._upload_stats = {"uploaded_segments": 0, "uploaded_bytes": 0, "errors": 0}
        self._last_error: tuple[float, str] | None = None
        self.backlog_bytes = 0
        self._ship_first: set[str] = set()  # channels sealed by seal(): their segments are uploaded before others
        self._shipped = threading.Condition()  # guards _unsealed_up; notified after every upload (wait_shipped)
        self._unsealed_up: dict[int, tuple[str, int]] = {}  # sealed, not yet uploaded: segment id -> (channel, lo)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._uploader: threading.Thread | None = None
        self._fenced: str | None = None  # why this writer no longer uploads (a newer incarnation ships)
        self._unconfirmed: set[str] = set()  # cold names of segments kept hot: their committed copy is not theirs

    def start(self, hot: HotTier, watermarks: Callable[[], dict[int, int]]) -> None:
        """Attach the writer's ``hot`` tier; with a cold tier and ``upload``, reconcile the upload
        state with the cold listing (``watermarks`` tells garbage apart) and start the thread."""
        self.hot = hot
        self.backlog_bytes = self._compute_backlog()
        if self.cold is not None and self.config.upload:
            self._reconcile_uploads(watermarks)
            self._unsealed_up = {m.id: (m.channel, m.lo) for m in hot.segments() if m.state == SEALED}
            self._uploader = threading.Thread(target=self._upload_loop, name=f"swiftlog-upload-{self.run}", daemon=True)
            self._uploader.start()

    def wake(self) -> None:
        """Have the upload thread look for work now (a segment sealed, a gap recorded)."""
        self._wake.set()

    def check_backlog(self, items: list[tuple[Any, ...]]) -> None:
        """Refuse a put (StoreFullError) while the upload backlog exceeds ``max_backlog_bytes``."""
        mb = self.config.max_backlog_bytes
        if mb is not None and self.backlog_bytes > mb:
            raise StoreFullError(
                f"upload backlog {self.backlog_bytes} bytes exceeds max_backlog_bytes={mb}",
                key=items[0][0] if items else None,
                hint="the cold tier is unreachable or too slow; see stats()['upload']",
            )

    def refresh_backlog(self) -> None:
        """Count the sealed, not yet uploaded bytes again (after a GC)."""
        self.backlog_bytes = self._compute_backlog()

    def stop(self, timeout: float) -> None:
        """Stop the upload thread, waiting at most ``timeout`` seconds for an upload in progress."""
        self._stop.set()
        self._wake.set()
        if self._uploader is not None:
            self._uploader.join(timeout=timeout)

    def stats(self) -> dict[str, Any]:
        """``stats()["upload"]`` of the store."""
        return {
            **self._upload_stats,
            "backlog_bytes": self.backlog_bytes if self.hot else None,
            "last_error": self._last_error[1] if self._last_error else None,
            "last_error_at": self._last_error[0] if self._last_error else None,
        }

    def _ship_gaps(self) -> None:
        """Copy gap documents of this writer's index to the cold tier (uploader thread)."""
        assert self.hot is not None and self.cold is not None
        for name, doc in self.hot.docs("gap/").items():
            if name in self._gaps_shipped:
                continue
            self.cold.put_doc(f"{self.run}/gaps/{name[len('gap/') :]}.json", doc)
            self._gaps_shipped.add(name)

    def _compute_backlog(self) -> int:
        return sum(m.file_size for m in self.hot.segments() if m.state == SEALED) if self.hot else 0

    def _cold_name(self, m: SegmentMeta, writer: str | None = None, seg_id: int | None = None) -> str:
        seg = m.id if seg_id is None else seg_id
        return f"{self.run}/segments/{m.channel}/{m.lo:012d}-{m.hi:012d}.{writer or self._writer}.{seg:010d}.seg"

    def _number_past_own_uploads(self, committed: set[str], hot: HotTier | None = None) -> bool:
        """Number the new segments of ``hot``'s writer (default: this store's) past the ids its name
        has among ``committed`` (an earlier incarnation on another root: a rollback); True when
        that moved the numbering."""
        hot = hot or self.hot
        assert hot is not None
        mine = [int(m["seg"]) for name in committed if (m := cold_name_parts(name)) and m["writer"] == hot.writer]
        return hot.number_past(max(mine, default=0))

    def _reconcile_uploads(self, watermarks: Callable[[], dict[int, int]]) -> None:
        """After a restart: segments already committed in the cold tier are marked uploaded, and
        uploaded ones the cold tier no longer has (and whose file is still here) are queued again."""
        try:
            committed = self._cold_index.committed_names()
            wm = watermarks()
        except SwiftlogError as e:
            self.note_error(e)
            return
        if self._number_past_own_uploads(committed):
            logger.info(
                "run %s: writer %s numbers its segments past its earlier uploads in the cold tier",
                self.run,
                self._writer,
            )
        for m in self.hot.segments():
            if m.state == SEALED and self._cold_name(m) in committed:
                self.hot.set_state(m.id, UPLOADED, cold_name=self._cold_name(m))
            elif (
                m.state == UPLOADED
                and m.cold_name not in committed
                and self.hot.seg_path(m.id).exists()
                and m.hi >= wm.get(Channel.parse(m.channel).owner, 0)
            ):  # not garbage another node's GC removed
                logger.warning(
                    "run %s: segment %d of %s was uploaded as %s, which the cold tier no longer has: "
                    "uploading it again",
                    self.run,
                    m.id,
                    self.hot.writer,
                    m.cold_name,
                )
                self.hot.set_state(m.id, SEALED)
                with self._shipped:
                    self._unsealed_up[m.id] = (m.channel, m.lo)

    def _upload_pending(self, deadline: float | None = None) -> int:
        """Upload every sealed segment now (caller's thread). Raises the first cold-tier error, and
        ColdTierUnavailableError when ``deadline`` (``time.monotonic()``) passes first: between
        segments, or waiting for the uploader thread's upload in progress."""
        assert self.hot is not None and self.cold is not None
        n = 0
        if not self._upload_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise ColdTierUnavailableError(
                f"run {self.run}: the uploader is still busy with a slow upload (object store slow or down?)",
                hint="the records stay in the hot tier; the uploader goes on in the background",
            )
        try:
            if self.cold.fenced_writes(probe=False) is None:  # once: does the store fence two uploaders of one name?
                self.cold.fenced_writes()
            self._ship_gaps()
            first = self._ship_first
            with self._shipped:
                known = set(self._unsealed_up)  # before the listing: what it cannot show was collected or uploaded
            segs = self.hot.segments()
            sealed = {m.id for m in segs if m.state == SEALED}
            self._forget_unshipped(known - sealed)
            order = lambda m: (not _precious(m.channel, first), m.id)  # noqa: E731
            todo = sorted((m for m in segs if m.state == SEALED), key=order)
            queued = {m.id for m in todo}
            left = 0
            while todo:
                if deadline is not None and time.monotonic() > deadline:
                    left = len(todo)
                    break
                m = todo.pop(0)
                name = self._ship(self.hot, m)
                if name is not None:
                    self.hot.set_state(m.id, UPLOADED, cold_name=name)
                    self._upload_stats["uploaded_segments"] += 1
                    self._upload_stats["uploaded_bytes"] += m.file_size
                    n += 1
                self._forget_unshipped([m.id])
                urgent = self._sealed_first_since(queued, first)
                if urgent:  # inputs/targets/META sealed during this pass go before its bulk (a backlog can be long)
                    queued.update(u.id for u in urgent)
                    todo = sorted([*todo, *urgent], key=order)
            self.backlog_bytes = self._compute_backlog()
            self._cold_index.invalidate()
            self._evict()
        finally:
            self._upload_lock.release()
        if left:
            raise ColdTierUnavailableError(
                f"run {self.run}: {left} sealed segment(s) not uploaded in the time given (object store slow?)",
                hint="they stay in the hot tier; the uploader goes on in the background",
            )
        return n

    def _sealed_first_since(self, queued: set[int], first: set[str]) -> list[SegmentMeta]:
        """Segments of the ship-first channels sealed since ``queued`` was listed (in-memory check;
        the index is read only when there is one)."""
        assert self.hot is not None
        with self._shipped:
            ids = [i for i, (ch, _lo) in self._unsealed_up.items() if i not in queued and _precious(ch, first)]
        metas = (self.hot.segment(i) for i in ids)
        return [m for m in metas if m is not None and m.state == SEALED]

    def on_seal(self, m: SegmentMeta) -> None:
        """The hot tier sealed ``m`` (explicitly or by rotation): it waits for upload; wake the uploader."""
        with self._shipped:
            self._unsealed_up[m.id] = (m.channel, m.lo)
        self._wake.set()

    def _forget_unshipped(self, ids: Iterable[int]) -> None:
        """Segments uploaded, or gone (collected, uploaded by their writer): wake wait_shipped."""
        with self._shipped:
            for i in ids:
                self._unsealed_up.pop(i, None)
            self._shipped.notify_all()

    def _ship(self, hot: HotTier, m: SegmentMeta) -> str | None:
        """Upload sealed segment ``m`` of ``hot`` (any writer's) to the cold tier; its cold name, or
        None when a checkpoint's GC deleted it (or its writer uploaded it) before or while it was
        read: nothing is left to ship and that is no cold-tier fault. Raises the cold tier's error
        otherwise."""
        assert self.cold is not None
        own = hot is self.hot
        if own and self._fenced is not None:
            raise WriterFencedError(self._fenced, hint=_FENCED_HINT)
        name = self._cold_name(m, hot.writer)
        meta = {
            "channel": m.channel,
            "lo": m.lo,
            "hi": m.hi,
            "writer": hot.writer,
            "records": m.live,
            "raw_bytes": m.raw_bytes,
            "stored_bytes": m.live_bytes,
        }
        incarnation = hot.incarnation()  # whichever process ships it: its writer's (a server's flush, a CLI's)
        if incarnation:
            meta["incarnation"] = incarnation
        path = hot.seg_path(m.id)
        if path.exists():
            try:
                self.cold.put_segment(name, str(path), meta=meta)
                return name
            except SegmentClashError:
                other = self.cold.segment_info(name)
                theirs = None if other is None else other.meta.get("incarnation")
                if isinstance(theirs, (int, float)) and theirs > incarnation:
                    # a later incarnation of this writer (its replacement) uploads: this one is the stale one
                    opened = datetime.fromtimestamp(theirs, UTC).isoformat()
                    mine = datetime.fromtimestamp(incarnation, UTC).isoformat()
                    why = (
                        f"writer {hot.writer} of run {self.run!r}: {name} in the cold tier was uploaded by a later "
                        f"incarnation of this writer (opened {opened}, this one {mine}): this one uploads nothing more"
                    )
                    # the writer's own uploader: said once in its log (the exception reaches only its flush callers)
                    if own:
                        self._fenced = why
                        logger.error("run %s: %s", self.run, why)
                    raise WriterFencedError(why, key=name, hint=_FENCED_HINT) from None
                # an earlier incarnation of this writer (a rollback's fresh root, opened while the cold tier
                # was down) used the name: number past its uploads and ship this one under a new id (also when
                # another process ships it: the index's counter is shared through LMDB)
                self._number_past_own_uploads(self._cold_index.committed_names(), hot)
                renamed = self._cold_name(m, hot.writer, hot.reserve_id())
                logger.warning(
                    "run %s: %s is taken in the cold tier by other bytes (an earlier incarnation of writer %s): "
                    "uploading it as %s",
                    self.run,
                    name,
                    hot.writer,
                    renamed,
                )
                self.cold.put_segment(renamed, str(path), meta=meta)
                return renamed
            except StoreError:
                cur = hot.segment(m.id)
                if cur is not None and cur.state == SEALED and path.exists():
                    raise
        logger.debug("run %s: segment %s of %s was collected or uploaded meanwhile", self.run, m.id, hot.writer)
        return None

    def _evict(self) -> None:
        """While the hot tier holds more than ``hot_max_bytes``, drop the hot copies of the oldest
        uploaded segments whose committed copy is confirmed to be exactly their file
        (``ColdTier.confirm_segment``): another uploader of the name may have replaced it. One
        that is not confirmed stays hot and is named once."""
        limit = self.config.hot_max_bytes
        if limit is None or self.hot is None or self.cold is None:
            return
        segs = self.hot.segments()
        total = sum(m.file_size for m in segs if m.state != EVICTED)
        for m in sorted((m for m in segs if m.state == UPLOADED), key=lambda m: (m.lo, m.id)):
            if total <= limit:
                break
            path = self.hot.seg_path(m.id)
            if m.cold_name is None or not path.exists():
                continue
            try:
                confirmed = self.cold.confirm_segment(m.cold_name, str(path))
            except SwiftlogError as e:  # cannot ask the object store now: nothing more is dropped
                self.note_error(e)
                return
            if not confirmed:
                if m.cold_name not in self._unconfirmed:
                    self._unconfirmed.add(m.cold_name)
                    logger.warning(
                        "run %s: segment %d of %s not evicted: its committed copy %s is not exactly its bytes "
                        "(another uploader of the name?); it stays in the hot tier",
                        self.run,
                        m.id,
                        self.hot.writer,
                        m.cold_name,
                    )
                continue
            self.hot.set_state(m.id, EVICTED)
            total -= m.file_size

    def _upload_loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._upload_pending()
                backoff = 0.1
            except SwiftlogError as e:
                if self._stop.is_set():  # closing: the tiers may be closed under an upload that outlived close's wait
                    break
                self.note_error(e)
                try:
                    self.backlog_bytes = self._compute_backlog()
                except SwiftlogError:
                    pass
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                self._wake.set()
            except Exception as e:  # a bad item must not kill the uploader
                if self._stop.is_set():
                    break
                logger.exception("uploader: unexpected error")
                self.note_error(e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                self._wake.set()

    def note_error(self, e: BaseException) -> None:
        """Count and log a cold tier error; ``stats()["upload"]`` reports the last one."""
        self._upload_stats["errors"] += 1
        self._last_error = (time.time(), f"{type(e).__name__}: {e}")
        logger.warning("run %s: cold tier error: %s", self.run, e)

    def seal(self, hot: HotTier, channels: Iterable[Channel] | None = None) -> None:
        """``LogStore.seal`` of the writer's ``hot`` tier."""
        names = None if channels is None else {c.name for c in channels}
        if names:
            self._ship_first |= names
        hot.seal_all(names)
        self._wake.set()

    def wait_shipped(
        self, channels: Iterable[Channel], iteration: int, timeout: float, writer_hot: Callable[[], HotTier]
    ) -> bool:
        """``LogStore.wait_shipped``; ``writer_hot`` gives the writer's hot tier (or raises)."""
        if self.cold is None or self._uploader is None:
            return False
        hot = writer_hot()
        names = {c.name for c in channels}
        deadline = time.monotonic() + timeout
        with self._shipped:  # in memory only: the open segments and the sealed ones not uploaded yet
            while True:
                waiting = [*hot.open_segments().items(), *self._unsealed_up.values()]
                if not any(ch in names and lo <= iteration for ch, lo in waiting):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._shipped.wait(min(left, 0.05))  # notified per upload; the poll bounds a missed wake

    def flush(self, hot: HotTier, timeout: float | None = None) -> int:
        """``LogStore.flush`` of the writer's ``hot`` tier."""
        hot.seal_all()
        if self.cold is None:
            return 0
        try:
            return self._upload_pending(None if timeout is None else time.monotonic() + timeout)
        except SwiftlogError as e:
            self.note_error(e)
            # what stats() reports as waiting: the segments just sealed too (the uploader may not have failed yet)
            try:
                self.backlog_bytes = self._compute_backlog()
            except SwiftlogError:
                pass
            raise

    def upload_sealed(self) -> dict[str, Any]:
        """``LogStore.upload_sealed``."""
        if self.cold is None:
            raise ConfigError(f"run {self.run!r}: no cold tier configured", hint="open the store with cold_url=...")
        rep: dict[str, Any] = {"uploaded": [], "uploaded_bytes": 0, "already_uploaded": 0, "open": []}
        with self._upload_lock:
            try:
                # every writer's inputs, targets and META first (what only their stage had), then the rest
                segs = [(hot, m) for hot in self._tiers.all() for m in hot.segments()]
                for hot, m in sorted(
                    segs, key=lambda hm: (not _precious(hm[1].channel, self._ship_first), hm[0].writer, hm[1].id)
                ):
                    if m.state == OPEN:
                        rep["open"].append(
                            {
                                "writer": hot.writer,
                                "channel": m.channel,
                                "lo": m.lo,
                                "hi": m.hi,
                                "records": m.live,
                                "bytes": m.end,
                            }
                        )
                        continue
                    if m.state != SEALED:
                        rep["already_uploaded"] += 1
                        continue
                    name = self._ship(hot, m)
                    if name is None:
                        continue
                    cur = hot.segment(m.id)
                    if cur is not None and cur.state == SEALED:
                        hot.set_state(m.id, UPLOADED, cold_name=name)
                    rep["uploaded"].append(name)
                    rep["uploaded_bytes"] += m.file_size
            except SwiftlogError as e:
                if not isinstance(e, WriterFencedError):  # a refusal of this run's data, not the cold tier's health
                    self.note_error(e)
                raise
            finally:
                self._cold_index.invalidate()
        return rep
