"""Reading a run's records for a replay: :class:`LogReader` over one or several record sources.

A source is anything with the :class:`RecordSource` methods: a ``LogStore`` opened on a node's
store root (every writer's hot tier there, plus its cold tier), a cold-tier-only store, or a node
server over HTTP (``replay.remote.HttpRecordSource``). A key is asked first of the first source
that lists it in a hot tier (a survivor's disk, not the object store another source also reaches),
else of the first that listed it (no failed lookups in the sources that do not hold it), then of
the others in order; the first intact copy wins; a retryable error of one source (an unreachable server) falls
through to the next.

Prefetching: :meth:`LogReader.prefetch` fetches and decodes keys ahead (the replay's prefetch
thread calls it); :meth:`LogReader.get` hands each prefetched record out once, or waits for one
being fetched, so nothing is read twice. Key listings are cached per (channel, iteration) and
taken :data:`LIST_WINDOW` iterations at a time; META documents are cached decoded.

Never: returns bytes that failed a checksum (the sources guarantee it); writes to a source.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from logstore import Channel, LogStore, RecordKey
from logstore.errors import (
    ColdTierError,
    ColdTierUnavailableError,
    CorruptRecordError,
    RecordNotFoundError,
    StoreError,
    SwiftlogError,
)
from logstore.keys import Kind
from replay.errors import ReplayError, ReplayInputMissingError
from trainer_client.digest import digest_from_record
from trainer_client.meta import amend_meta, decode_meta

__all__ = ["RecordSource", "LogReader", "MetaDocSource", "LIST_WINDOW"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: iterations listed per key-listing call of a source (see ``LogReader._parts_of``)
LIST_WINDOW = 16


@runtime_checkable
class RecordSource(Protocol):
    """What the replay reads records through (``LogStore`` is one; so is ``replay.remote.HttpRecordSource``).

    ``get`` raises RecordNotFoundError / CorruptRecordError (naming the key) and never returns
    wrong bytes; ``keys`` lists one channel's keys of iterations ``[it_lo, it_hi)`` in key order;
    ``gaps`` lists the recorded gaps (dicts with channel, iteration, micro_batch, reason).
    """

    def get(self, key: RecordKey) -> torch.Tensor: ...

    def keys(self, channel: Channel | None = None, it_lo: int = 0, it_hi: int | None = None) -> list[RecordKey]: ...

    def gaps(self) -> list[dict[str, Any]]: ...


class MetaDocSource:
    """META documents held in memory, as a :class:`RecordSource` of META records only.

    A replacement reads them from the commit store (``trainer_client.commit.stored_metas``): the
    copy of every committed iteration's META that outlives the failed stage's machine. ``docs``
    maps ``"stage/iteration"`` to the JSON text as the stage encoded it (so a :class:`~replay.job.ReplayJob` carries
    them to helper processes as plain values). Never holds or returns another channel's records.
    """

    def __init__(self, docs: dict[str, str]) -> None:
        self._docs: dict[RecordKey, str] = {}
        for name, text in docs.items():
            stage, _, it = name.partition("/")
            self._docs[RecordKey(Channel.meta(int(stage)), int(it), 0)] = text

    def get(self, key: RecordKey) -> torch.Tensor:
        text = self._docs.get(key)
        if text is None:
            raise RecordNotFoundError(f"no META document {key} from the commit store")
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)  # the bytes the stage stored

    def keys(self, channel: Channel | None = None, it_lo: int = 0, it_hi: int | None = None) -> list[RecordKey]:
        return sorted(
            k
            for k in self._docs
            if (channel is None or k.channel == channel)
            and it_lo <= k.iteration
            and (it_hi is None or k.iteration < it_hi)
        )

    def gaps(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


class LogReader:
    """Read one run's records through one or several sources; the first source holding a key wins.

    Typical sources: a store opened read-only on a node root (every writer's hot tier there, plus
    the cold tier), the cold tier alone, or a node server over HTTP. Caches the key listing per
    (channel, iteration) and decoded META documents. Records fetched ahead by :meth:`prefetch`
    are handed out once (the cache entry is dropped on use). Thread-safe.
    """

    def __init__(self, stores: RecordSource | Sequence[RecordSource]) -> None:
        many = isinstance(stores, (list, tuple))
        self.stores: list[RecordSource] = list(stores) if many else [stores]  # type: ignore[list-item]
        if not self.stores:
            raise ValueError("LogReader needs at least one record source")
        self._lock = threading.Lock()
        self._listing: dict[tuple[Channel, int], dict[int, list[RecordKey]]] = {}
        self._source_of: dict[RecordKey, int] = {}  # the first source that listed a key: asked first
        self._metas: dict[tuple[int, int], dict[str, Any]] = {}
        self._meta_pending: dict[tuple[int, int], Future[dict[str, Any] | None]] = {}
        self._listing_pending: dict[tuple[Channel, int], Future[dict[int, list[RecordKey]]]] = {}
        self._pending: dict[RecordKey, Future[torch.Tensor]] = {}
        self._taken: set[RecordKey] = set()  # fetched by get() while a prefetch thread runs
        self._prefetchers = 0
        self._hot_only: set[int] = set()  # ids of stores read from their hot tiers only (cold tier unreachable)
        # a key no listing placed (META is read without one) is asked of the node roots and servers before a
        # cold-tier-only store
        self._order = sorted(range(len(self.stores)), key=lambda i: _cold_only(self.stores[i]))
        self.fetched_records = 0
        self.fetched_seconds = 0.0
        self.prefetch_hits = 0

    # -------------------------------------------------------------- records
    def get(self, key: RecordKey) -> torch.Tensor:
        """The tensor under ``key`` from the first source that has an intact copy (asking first the
        first source that listed it).

        Raises ReplayInputMissingError if no source has it (with the gaps recorded for it, if
        any), the CorruptRecordError of the last source when every copy is corrupt, or the
        retryable StoreError of an unreachable source when no reachable one has it.
        """
        with self._lock:
            fut = self._pending.pop(key, None)
            if fut is None and self._prefetchers:
                self._taken.add(key)  # a prefetch that has not reached it yet skips it
            if fut is not None:
                self.prefetch_hits += 1
        if fut is not None:
            return fut.result()
        return self._fetch(key)

    def _fetch(self, key: RecordKey) -> torch.Tensor:
        t0 = time.perf_counter()
        corrupt: CorruptRecordError | None = None
        unavailable: StoreError | None = None
        first = self._source_of.get(key)
        order = self._order if first is None else [first, *(i for i in self._order if i != first)]
        try:
            for s in (self.stores[i] for i in order):
                try:
                    return s.get(key)
                except RecordNotFoundError:
                    continue
                except CorruptRecordError as e:
                    corrupt = e
                except StoreError as e:  # an unreachable source: another one may have the record
                    if not e.retryable:
                        raise
                    unavailable = e
        finally:
            with self._lock:
                self.fetched_records += 1
                self.fetched_seconds += time.perf_counter() - t0
        if corrupt is not None:
            raise corrupt
        if unavailable is not None:
            raise unavailable
        raise ReplayInputMissingError(
            f"record {key} is in none of {len(self.stores)} source(s){self._gap_note(key)}",
            key=key,
            hint="replay from an older checkpoint whose logs are complete, or recover the whole group",
        )

    def prefetch(self, keys: Sequence[RecordKey], stop: threading.Event | None = None) -> int:
        """Fetch ``keys`` now (in order) into the one-shot cache that :meth:`get` reads first.

        Every key is registered before the first fetch, so a :meth:`get` racing this call waits
        for the prefetched copy instead of fetching it twice. Errors are stored and raised by the
        :meth:`get` that asks for the key. Returns how many keys were newly registered.
        """
        mine: list[tuple[RecordKey, Future[torch.Tensor]]] = []
        with self._lock:
            for k in keys:
                if k not in self._pending and k not in self._taken:
                    fut: Future[torch.Tensor] = Future()
                    self._pending[k] = fut
                    mine.append((k, fut))
        for k, fut in mine:
            if stop is not None and stop.is_set():
                fut.set_exception(ReplayError(f"prefetch of {k} cancelled"))
                with self._lock:
                    if self._pending.get(k) is fut:
                        del self._pending[k]
                continue
            try:
                fut.set_result(self._fetch(k))
            except BaseException as e:  # handed to the get() that asks for it
                fut.set_exception(e)
        return len(mine)

    def start_prefetching(self) -> None:
        """Note that a prefetch thread feeds this reader (until :meth:`stop_prefetching`)."""
        with self._lock:
            self._prefetchers += 1

    def stop_prefetching(self) -> None:
        """The prefetch thread ended: drop every prefetched record not used yet."""
        with self._lock:
            self._prefetchers = max(0, self._prefetchers - 1)
            if not self._prefetchers:
                self._pending.clear()
                self._taken.clear()

    def discard(self, iteration: int) -> int:
        """Drop what was fetched ahead for iterations <= ``iteration`` and not used (e.g. the records
        of micro-batches another parallel worker claimed); returns how many. A later :meth:`get`
        of such a key fetches it again."""
        with self._lock:
            old = [k for k in self._pending if k.iteration <= iteration]
            for k in old:
                del self._pending[k]
            self._taken = {k for k in self._taken if k.iteration > iteration}
        return len(old)

    def has(self, key: RecordKey) -> bool:
        """Whether some source lists ``key`` (no read, no checksum)."""
        return key in self._parts_of(key.channel, key.iteration).get(key.micro_batch, [])

    def parts(self, channel: Channel, iteration: int, micro_batch: int) -> list[torch.Tensor]:
        """Every part of one (channel, iteration, micro-batch), in part order (empty if none)."""
        return [self.get(k) for k in self._parts_of(channel, iteration).get(micro_batch, [])]

    def part_keys(self, channel: Channel, iteration: int, micro_batch: int) -> list[RecordKey]:
        """The keys of every part of one (channel, iteration, micro-batch) the sources list."""
        return list(self._parts_of(channel, iteration).get(micro_batch, []))

    def require_parts(self, channel: Channel, iteration: int, micro_batch: int) -> list[torch.Tensor]:
        """Like :meth:`parts` but raises ReplayInputMissingError when there is none."""
        keys = self._parts_of(channel, iteration).get(micro_batch)
        if not keys:
            key = RecordKey(channel, iteration, micro_batch)
            own = channel.kind in (
                Kind.INPUT,
                Kind.TARGET,
                Kind.REDUCED,
            )  # logged by the stage itself: its node and the cold tier had them
            hint = (
                "a stage's own inputs / targets / reduced gradients outlive its node only in the run's cold tier: "
                "give it (--cold-url); if it was given, the record never reached it (shipping off, or the node died "
                "first)"
                if own
                else "the sender's logs are incomplete: replay from an older checkpoint or recover the group"
            )
            raise ReplayInputMissingError(
                f"no record of {channel.name} at iteration {iteration} micro-batch {micro_batch}{self._gap_note(key)}",
                key=key,
                hint=hint,
            )
        return [self.get(k) for k in keys]

    def meta(self, stage: int, iteration: int) -> dict[str, Any] | None:
        """The META document of (stage, iteration), or None if no source has it (cached when found).

        Concurrent callers (the compute and the prefetch thread) share one fetch.
        """
        k = (stage, iteration)

        def fetch() -> dict[str, Any] | None:
            try:
                doc = decode_meta(self._fetch(RecordKey(Channel.meta(stage), iteration, 0)))
                if 1 in self._parts_of(Channel.meta(stage), iteration):  # amended: the optimizer step used other values
                    doc = amend_meta(doc, decode_meta(self._fetch(RecordKey(Channel.meta(stage), iteration, 1))))
            except ReplayInputMissingError:
                return None
            with self._lock:
                if len(self._metas) > 4096:
                    self._metas.clear()
                self._metas[k] = doc
            return doc

        return self._shared(self._metas, self._meta_pending, k, fetch)

    def logged_parts(self, channel: Channel, iteration: int, micro_batch: int) -> list[int]:
        """The parts of (channel, iteration, micro-batch) some source lists, in order ([] if none)."""
        return sorted({k.part for k in self._parts_of(channel, iteration).get(micro_batch, [])})

    def digest(self, src: int, dst: int, iteration: int, micro_batch: int, part: int) -> int | None:
        """The digest that receiver ``dst`` kept of part ``part`` sent by ``src``, or None."""
        try:
            return digest_from_record(self.get(RecordKey(Channel.digest(src, dst), iteration, micro_batch, part)))
        except ReplayInputMissingError:
            return None

    def _parts_of(self, channel: Channel, iteration: int) -> dict[int, list[RecordKey]]:
        """Keys of one (channel, iteration) by micro-batch. A miss lists :data:`LIST_WINDOW`
        iterations at once (one call per source instead of one per iteration); iterations of the
        window with no key are not cached, so records that arrive later are still found.
        Concurrent misses of one (channel, iteration) share one listing (the compute and the
        prefetch thread start on the same iteration)."""
        return self._shared(
            self._listing, self._listing_pending, (channel, iteration), lambda: self._list(channel, iteration)
        )

    def _keys_of(self, s: RecordSource, channel: Channel, lo: int, hi: int) -> list[tuple[RecordKey, bool]]:
        """(key, on the node's disk) for what ``s`` lists: a node's store or server says which of
        its records are in a hot tier (those are read there first, not from the object store
        another source reaches too); other sources' keys count as local. A node's store whose
        cold tier is unreachable is listed from its hot tiers (what that node's disk holds, with
        a warning once per source, and from then on: each listing of a dead cold tier costs its
        retries)."""
        if not hasattr(s, "list_records"):  # e.g. META documents from the commit store
            return [(k, True) for k in s.keys(channel, lo, hi)]
        hot_only = id(s) in self._hot_only
        try:
            return _tiers_listed(s, channel, lo, hi, hot_only)
        except (ColdTierUnavailableError, ColdTierError) as e:  # down, or refusing (credentials, bucket, permissions)
            if hot_only or not isinstance(s, LogStore) or s.is_cold_only():
                raise
            self._hot_only.add(id(s))
            logger.warning(
                "the cold tier of store root %s cannot be read (%s): reading what its hot tiers hold", s.root, e.message
            )
            return _tiers_listed(s, channel, lo, hi, True)

    def _list(self, channel: Channel, iteration: int) -> dict[int, list[RecordKey]]:
        """List every source for the window starting at ``iteration`` and cache it (see :meth:`_parts_of`)."""
        found: dict[
            RecordKey, int
        ] = {}  # key -> the source asked first: the first listing it on a local disk, else the first listing it
        local: set[RecordKey] = set()
        for i, s in enumerate(self.stores):
            try:
                for key, hot in self._keys_of(s, channel, iteration, iteration + LIST_WINDOW):
                    if key not in found or (hot and key not in local):
                        found[key] = i
                    if hot:
                        local.add(key)
            except StoreError as e:
                logger.warning("listing %s it %d failed in one source: %s", channel.name, iteration, e)
        by_it: dict[int, dict[int, list[RecordKey]]] = {iteration: {}}
        for key in sorted(found):
            by_it.setdefault(key.iteration, {}).setdefault(key.micro_batch, []).append(key)
        with self._lock:
            if len(self._listing) > 4096:
                self._listing.clear()
            if len(self._source_of) > 1 << 20:
                self._source_of.clear()
            self._source_of.update((key, i) for key, i in found.items() if i != self._order[0])
            for it, by_mb in by_it.items():
                self._listing[(channel, it)] = by_mb
        return by_it[iteration]

    def _shared(self, cache: dict[Any, Any], pending: dict[Any, Future[Any]], k: Any, compute: Callable[[], _T]) -> _T:
        """``cache[k]`` if it is there, else ``compute()`` run once however many threads ask at the
        same time (the others wait for its result or its exception). ``compute`` caches what it
        wants cached."""
        with self._lock:
            hit = cache.get(k)
            if hit is not None:
                return hit
            fut = pending.get(k)
            mine = fut is None
            if fut is None:
                fut = pending[k] = Future()
        if mine:
            try:
                fut.set_result(compute())
            except BaseException as e:  # handed to every waiter
                fut.set_exception(e)
            finally:
                with self._lock:
                    pending.pop(k, None)
        return fut.result()

    def _gap_note(self, key: RecordKey) -> str:
        try:
            for s in self.stores:
                for g in s.gaps():
                    if (
                        g["channel"] == key.channel.name
                        and g["iteration"] == key.iteration
                        and g["micro_batch"] == key.micro_batch
                    ):
                        return f" (a gap was recorded: {g['reason']})"
        except SwiftlogError:
            pass
        return ""


def _tiers_listed(s: Any, channel: Channel, lo: int, hi: int, hot_only: bool) -> list[tuple[RecordKey, bool]]:
    """Every record of ``channel`` in ``[lo, hi)`` that a store or node server lists, with whether
    it is in a hot tier (``list_records`` pages)."""
    out: list[tuple[RecordKey, bool]] = []
    after: RecordKey | None = None
    while True:
        page = s.list_records(channel, lo, hi, after=after, limit=1000, **({"hot_only": True} if hot_only else {}))
        out.extend((info.key, info.tier == "hot") for info in page)
        if len(page) < 1000:
            return out
        after = page[-1].key


def _cold_only(s: Any) -> bool:
    """A source that reads a cold tier alone (``LogStore.is_cold_only``; also through a wrapper)."""
    check = getattr(s, "is_cold_only", None)
    return bool(check()) if callable(check) else False
