"""What the admin API and the CLI do over one node's store root, as typed results.

:class:`Node` opens each run's :class:`~logstore.LogStore` read-only (no writer name: the server
and the CLI are never the writer), keeps them open, and answers with the pydantic models of
:mod:`server.models`. Routers and CLI commands only parse, call one method, and render.

Reading never blocks a training process writing the same store: LMDB readers take no lock a
writer waits on, read transactions are short, and segment files are read with ``pread``.

Run summaries are served from a small cache (stale-while-revalidate): younger than
``summary_ttl`` as is; up to ``summary_max_stale`` old as is while one background thread
recomputes it; older or missing, computed in the caller's thread (one computation per run at a
time). Mutations through this class (checkpoint, GC, flush) drop the run's entry at once.
``as_of`` in every summary says when it was computed.

Never: writes a record, seals a segment (that is the writer's job), or deletes anything except
through ``gc(confirm=True)``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from logstore import LogStore, RecordInfo, StoreConfig, codec, list_runs
from logstore.checkpoints import check_portable_json
from logstore.errors import CodecError, ColdTierError, ColdTierUnavailableError, SwiftlogError
from logstore.keys import KEY_SIZE, Channel, Kind, RecordKey, validate_run
from logstore.segment import BlobStream, blob_checksum
from logstore.store import writers_under
from server.errors import BadRequestError, CheckpointNotFoundError, NoColdTierError, RunNotFoundError
from server.models import (
    ChannelSummary,
    Checkpoint,
    CheckpointList,
    CheckpointRequest,
    ColdTierSummary,
    Collected,
    FlushResult,
    Gap,
    GcPreview,
    GcResult,
    HotTierSummary,
    OpenSegment,
    RecordDetail,
    RecordEntry,
    RecordPage,
    RecoveryPlan,
    RunBrief,
    RunList,
    RunSummary,
    SegmentStates,
    TensorStats,
    TierRange,
    UnregisterRequest,
    UnregisterResult,
    VerifyProblem,
    VerifyResult,
    Watermark,
)
from server.planner import DEFAULT_PLANNER, load_planner, to_jsonable
from server.settings import Settings

__all__ = ["Node", "encode_cursor", "decode_cursor", "tensor_stats"]

logger = logging.getLogger(__name__)

_CURSOR_RE = re.compile(rf"^[0-9a-f]{{{2 * KEY_SIZE}}}$")
_STATS_CHUNK = 1 << 22  # elements per float64 pass: bounds the memory of tensor statistics


def encode_cursor(key: RecordKey) -> str:
    """Opaque page cursor: the last key of a page, hex-encoded."""
    return key.encode().hex()


def decode_cursor(cursor: str) -> RecordKey:
    """Inverse of :func:`encode_cursor`; BadRequestError for anything else."""
    if not isinstance(cursor, str) or not _CURSOR_RE.match(cursor):
        raise BadRequestError(
            f"invalid cursor {cursor[:80]!r}", hint="pass back next_cursor from the previous page unchanged"
        )
    try:
        return RecordKey.decode(bytes.fromhex(cursor))
    except SwiftlogError:
        raise BadRequestError(
            f"invalid cursor {cursor!r}", hint="pass back next_cursor from the previous page unchanged"
        ) from None


def _hex(x: int) -> str:
    return f"{x:016x}"


def _kind_name(k: Kind) -> str:
    return k.name.lower()


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """min / max / mean / L2 norm over the finite values, NaN and Inf counts; float64 accumulation
    in bounded chunks. Raises TypeError for dtypes without a real numeric value (complex, bits)."""
    if t.is_complex():
        raise TypeError(f"no real statistics for complex dtype {t.dtype}")
    flat = t.reshape(-1)
    n = flat.numel()
    mn, mx, total, sq, count, nans, infs = math.inf, -math.inf, 0.0, 0.0, 0, 0, 0
    for start in range(0, n, _STATS_CHUNK):
        c = flat[start : start + _STATS_CHUNK]
        c = c.to(torch.uint8) if c.dtype == torch.bool else c
        c = c.to(torch.float64)
        finite = torch.isfinite(c)
        nf = int(finite.sum())
        if nf != c.numel():
            nans += int(torch.isnan(c).sum())
            infs += int(torch.isinf(c).sum())
            c = c[finite]
        if nf:
            mn = min(mn, float(c.min()))
            mx = max(mx, float(c.max()))
            total += float(c.sum())
            sq += float(torch.dot(c, c))
            count += nf
    if not count:
        return TensorStats(numel=n, nan_count=nans, inf_count=infs)
    return TensorStats(numel=n, min=mn, max=mx, mean=total / count, norm=math.sqrt(sq), nan_count=nans, inf_count=infs)


def _checkpoint(c: Any) -> Checkpoint:
    meta = c.meta
    try:  # a registration older than the check on portable JSON may hold a lone surrogate: served, not a 500 on every list
        check_portable_json(meta)
    except ValueError:
        meta = {"unreadable_meta": json.dumps(meta, ensure_ascii=True, default=repr)}
    return Checkpoint(stage=c.stage, iteration=c.iteration, uri=c.uri, registered_at=c.registered_at, meta=meta)


def _entry(info: RecordInfo) -> dict[str, Any]:
    k = info.key
    return {
        "key": str(k),
        "channel": k.channel.name,
        "kind": _kind_name(k.channel.kind),
        "iteration": k.iteration,
        "micro_batch": k.micro_batch,
        "part": k.part,
        "tier": info.tier,
        "writer": info.writer,
        "stored_bytes": info.stored_bytes,
        "raw_bytes": info.raw_bytes,
        "checksum": _hex(info.checksum),
    }


class _SummaryCache:
    """Per-run summaries, stale-while-revalidate (see the module docstring)."""

    def __init__(self, compute: Callable[[str], RunSummary], ttl: float, max_stale: float) -> None:
        self._compute = compute
        self._ttl = ttl
        self._max_stale = max(max_stale, ttl)
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, RunSummary]] = {}
        self._gen: dict[str, int] = {}
        self._run_locks: dict[str, threading.Lock] = {}
        self._refreshing: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swiftlog-summary")

    def _run_lock(self, run: str) -> threading.Lock:
        with self._lock:
            return self._run_locks.setdefault(run, threading.Lock())

    def get(self, run: str) -> RunSummary:
        now = time.monotonic()
        with self._lock:
            e = self._entries.get(run)
        if e is not None:
            age = now - e[0]
            if age <= self._ttl:
                return e[1]
            if age <= self._max_stale:
                self._refresh_soon(run)
                return e[1]
        with self._run_lock(run):  # one computation per run; later callers reuse its result
            with self._lock:
                e = self._entries.get(run)
            if e is not None and time.monotonic() - e[0] <= self._ttl:
                return e[1]
            return self._fill(run)

    def _fill(self, run: str) -> RunSummary:
        with self._lock:
            gen = self._gen.get(run, 0)
        started = time.monotonic()
        s = self._compute(run)
        with self._lock:
            if self._gen.get(run, 0) == gen:  # not invalidated while computing
                self._entries[run] = (started, s)
        return s

    def _refresh_soon(self, run: str) -> None:
        with self._lock:
            if run in self._refreshing:
                return
            self._refreshing.add(run)

        def job() -> None:
            try:
                with self._run_lock(run):
                    self._fill(run)
            except Exception as e:  # the stale entry stays; the next synchronous miss reports
                logger.warning("summary refresh of run %s failed: %s", run, e)
            finally:
                with self._lock:
                    self._refreshing.discard(run)

        try:
            self._pool.submit(job)
        except RuntimeError:  # shutting down
            with self._lock:
                self._refreshing.discard(run)

    def cached(self) -> dict[str, RunSummary]:
        with self._lock:
            return {r: e[1] for r, e in self._entries.items()}

    def invalidate(self, run: str) -> None:
        with self._lock:
            self._entries.pop(run, None)
            self._gen[run] = self._gen.get(run, 0) + 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Node:
    """One node's store root: every run under it, read-only, with cached summaries.

    Thread-safe. Stores are opened on first use and kept (at most ``max_open_runs``; the least
    recently used is closed beyond that, and a request racing that close gets a retryable
    StoreClosedError). With ``cold_refresh_interval`` (seconds; the server sets it, one-shot CLI
    commands do not), a background thread re-lists the cold tier of recently used runs at that
    interval so that requests find a fresh listing instead of making one.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        cold_url: str | None = None,
        cold_options: dict[str, Any] | None = None,
        summary_ttl: float = 2.0,
        summary_max_stale: float = 60.0,
        max_open_runs: int = 64,
        max_tensor_stats_bytes: int = 256 * 1024 * 1024,
        planner: str = DEFAULT_PLANNER,
        cold_refresh_interval: float | None = None,
    ) -> None:
        self.root = Path(root)
        self.cold_url = cold_url
        self.cold_options = dict(cold_options or {})
        self.max_open_runs = max_open_runs
        self.max_tensor_stats_bytes = max_tensor_stats_bytes
        self.stream_chunk_bytes = 4 << 20  # bytes read, hashed and written per step of a record download
        self.planner = planner
        self._stores: OrderedDict[str, LogStore] = OrderedDict()
        self._lock = threading.Lock()
        self._summaries = _SummaryCache(self._compute_summary, summary_ttl, summary_max_stale)
        self._used: dict[str, float] = {}
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        if cold_url is not None and cold_refresh_interval:
            self._refresher = threading.Thread(
                target=self._refresh_loop, args=(cold_refresh_interval,), name="swiftlog-cold-refresh", daemon=True
            )
            self._refresher.start()

    def _refresh_loop(self, interval: float) -> None:
        """Keep the cold listing of recently used runs fresh, so that no request pays for a listing."""
        failing: set[str] = set()
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                stores = [(r, st) for r, st in self._stores.items() if now - self._used.get(r, 0.0) < 120.0]
            for run, st in stores:
                try:
                    st.refresh_cold_listing()
                    failing.discard(run)
                except SwiftlogError as e:
                    if run not in failing:  # log a failure once, not every interval
                        logger.warning("cold listing of run %s failed: %s", run, e)
                        failing.add(run)
                except Exception:  # a bad store must not stop the refresher
                    logger.exception("cold listing of run %s failed", run)

    @classmethod
    def from_settings(cls, s: Settings) -> Node:
        return cls(
            s.root,
            cold_url=s.cold_url,
            cold_options=s.cold_options,
            cold_refresh_interval=s.cold_refresh_interval,
            summary_ttl=s.summary_ttl,
            summary_max_stale=s.summary_max_stale,
            max_open_runs=s.max_open_runs,
            max_tensor_stats_bytes=s.max_tensor_stats_bytes,
            planner=s.planner,
        )

    # ------------------------------------------------------------------ runs and stores
    def run_names(self) -> list[str]:
        return list_runs(self.root)

    def _writers(self, run: str) -> list[str]:
        return writers_under(self.root / run)

    def runs(self) -> RunList:
        return RunList(runs=[RunBrief(run=r, writers=self._writers(r)) for r in self.run_names()])

    def store(self, run: str) -> LogStore:
        """The read-only store of ``run``. InvalidNameError for a bad id, RunNotFoundError if absent."""
        validate_run(run)
        with self._lock:
            st = self._stores.get(run)
            self._used[run] = time.monotonic()
            if st is not None:
                self._stores.move_to_end(run)
                return st
        if not self._writers(run):
            raise RunNotFoundError(
                f"run {run!r} not found under {self.root}",
                key=run,
                hint="`swiftlog ls` lists the runs of this root; check --root / SWIFTLOG_ROOT",
            )
        st = LogStore(
            StoreConfig(root=self.root, run=run, writer=None, cold_url=self.cold_url, cold_options=self.cold_options)
        )
        with self._lock:
            other = self._stores.get(run)
            if other is not None:  # another thread won the race
                st.close()
                return other
            self._stores[run] = st
            doomed = []
            while len(self._stores) > self.max_open_runs:
                doomed.append(self._stores.popitem(last=False)[1])
        for d in doomed:
            d.close()
        return st

    def close(self) -> None:
        self._stop.set()
        self._summaries.close()
        with self._lock:
            stores = list(self._stores.values())
            self._stores.clear()
        for st in stores:
            try:
                st.close()
            except SwiftlogError as e:
                logger.warning("closing store of run %s: %s", st.run, e)

    # ------------------------------------------------------------------ summary
    def summary(self, run: str, *, fresh: bool = False) -> RunSummary:
        """The run's summary, from the cache unless ``fresh``."""
        self.store(run)  # validates and 404s before touching the cache
        if fresh:
            self._summaries.invalidate(run)
        return self._summaries.get(run)

    def cached_summaries(self) -> dict[str, RunSummary]:
        """Summaries currently cached (what /metrics reports; never computes anything)."""
        return self._summaries.cached()

    def _compute_summary(self, run: str) -> RunSummary:
        st = self.store(run)
        stats = st.stats()
        cold_error: str | None = None
        incomplete: list[str] = ["cold"] if stats["cold"] is not None and stats["cold"].get("error") else []
        wm: dict[int, int] = {}
        try:
            cps = st.checkpoints()
        except (
            ColdTierUnavailableError,
            ColdTierError,
        ) as e:  # unreachable or refusing: what this node registered itself, and the watermarks it last saw
            cold_error = f"checkpoints: {e.message}"
            cps, wm = st.checkpoints(hot_only=True), st.watermarks(max_age=math.inf)
            incomplete += ["checkpoints", "watermarks", "gaps"]
        for c in cps:
            wm[c.stage] = max(wm.get(c.stage, 0), c.iteration)
        gaps = st.gaps(hot_only=cold_error is not None)
        channels: list[ChannelSummary] = []
        stages: set[int] = set(wm)
        hot_lo: list[int] = []
        hot_hi: list[int] = []
        cold_lo: list[int] = []
        cold_hi: list[int] = []
        for name, tiers in sorted(stats["channels"].items(), key=lambda kv: Channel.parse(kv[0])):
            ch = Channel.parse(name)
            stages.update((ch.src, ch.dst))
            ranges: dict[str, TierRange | None] = {"hot": None, "cold": None}
            for tier, lo_l, hi_l in (("hot", hot_lo, hot_hi), ("cold", cold_lo, cold_hi)):
                t = tiers.get(tier)
                if t and t["records"] > 0:
                    ranges[tier] = TierRange(
                        records=t["records"],
                        stored_bytes=t["stored_bytes"],
                        raw_bytes=t["raw_bytes"],
                        first_iteration=t["lo"],
                        last_iteration=t["hi"],
                    )
                    lo_l.append(t["lo"])
                    hi_l.append(t["hi"])
            channels.append(
                ChannelSummary(name=ch.name, kind=_kind_name(ch.kind), src=ch.src, dst=ch.dst, owner=ch.owner, **ranges)
            )
        h = stats["hot"]
        segs = h["segments"]
        hot = HotTierSummary(
            records=h["records"],
            stored_bytes=h["stored_bytes"],
            raw_bytes=h["raw_bytes"],
            first_iteration=min(hot_lo, default=None),
            last_iteration=max(hot_hi, default=None),
            disk_bytes=h["disk_bytes"],
            writers=self._writers(run),
            unreadable=st.unreadable_writers(),
            collected=[Collected(stage=k, **c) for k, c in sorted(h["collected"].items())],
            segments=SegmentStates(
                open=segs.get("open", 0),
                sealed=segs.get("sealed", 0),
                uploaded=segs.get("uploaded", 0),
                evicted=segs.get("evicted", 0),
            ),
        )
        cold = None
        if stats["cold"] is not None:
            c = stats["cold"]
            err = "; ".join(e for e in (c.get("error"), cold_error) if e) or None
            cold = ColdTierSummary(
                records=c["records"],
                stored_bytes=c["stored_bytes"],
                raw_bytes=c["raw_bytes"],
                first_iteration=min(cold_lo, default=None),
                last_iteration=max(cold_hi, default=None),
                segments=c["segments"],
                object_bytes=c["object_bytes"],
                error=err,
            )
        ratio = stats["compression_ratio"]
        if ratio is None and cold is not None and cold.stored_bytes:
            ratio = cold.raw_bytes / cold.stored_bytes
        return RunSummary(
            run=run,
            as_of=time.time(),
            stages=sorted(stages),
            channels=channels,
            hot=hot,
            cold=cold,
            raw_bytes=h["raw_bytes"],
            stored_bytes=h["stored_bytes"],
            compression_ratio=ratio,
            checkpoints=[_checkpoint(c) for c in cps],
            watermarks=[Watermark(stage=s, iteration=i) for s, i in sorted(wm.items())],
            gaps=[Gap(**{k: g[k] for k in ("channel", "iteration", "micro_batch", "reason", "at")}) for g in gaps],
            incomplete=sorted(set(incomplete)),
        )

    # ------------------------------------------------------------------ records
    def records(
        self,
        run: str,
        *,
        channel: str | None = None,
        kind: str | None = None,
        it_lo: int = 0,
        it_hi: int | None = None,
        micro_batch: int | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> RecordPage:
        """One page of the run's records in key order, filtered; ``next_cursor`` continues it."""
        st = self.store(run)
        ch = Channel.parse(channel) if channel else None
        kinds = None
        if kind is not None:
            try:
                kinds = [Kind[kind.upper()]]
            except KeyError:
                raise BadRequestError(
                    f"unknown kind {kind!r}", hint="use " + ", ".join(_kind_name(k) for k in Kind)
                ) from None
            if ch is not None and ch.kind not in kinds:
                raise BadRequestError(f"channel {ch.name} is not of kind {kind}", hint="drop one of the two filters")
        if it_hi is not None and it_hi < it_lo:
            raise BadRequestError(
                f"it_hi {it_hi} is below it_lo {it_lo}", hint="the iteration range is it_lo <= iteration < it_hi"
            )
        after = decode_cursor(cursor) if cursor else None
        cold_error: str | None = None
        try:
            infos = st.list_records(
                ch, it_lo, it_hi, kinds=kinds, micro_batch=micro_batch, after=after, limit=limit + 1
            )
        except (
            ColdTierUnavailableError,
            ColdTierError,
        ) as e:  # unreachable or refusing: an operator still sees what this node holds, and is told what is missing
            cold_error = f"{e.message}: only the hot tier is listed (records only the cold tier holds are missing)"
            infos = st.list_records(
                ch, it_lo, it_hi, kinds=kinds, micro_batch=micro_batch, after=after, limit=limit + 1, hot_only=True
            )
        more = len(infos) > limit
        infos = infos[:limit]
        return RecordPage(
            run=run,
            records=[RecordEntry.model_construct(**_entry(i)) for i in infos],  # built from trusted index data
            next_cursor=encode_cursor(infos[-1].key) if more and infos else None,
            cold_error=cold_error,
        )

    def _locate(self, st: LogStore, key: RecordKey) -> RecordInfo | None:
        infos = st.list_records(
            key.channel, key.iteration, key.iteration + 1, micro_batch=key.micro_batch, limit=key.part + 1
        )
        return next((i for i in infos if i.key == key), None)

    def blob(self, run: str, key: str) -> tuple[RecordKey, bytes, codec.TensorHeader]:
        """The encoded record (verified against its stored checksum) and its header."""
        st = self.store(run)
        k = RecordKey.parse(key)
        blob = st.get_blob(k)
        return k, blob, codec.read_header(blob, key=k)

    def blob_stream(self, run: str, key: str) -> tuple[RecordKey, BlobStream, codec.TensorHeader]:
        """The encoded record as a stream verified while it is read (``LogStore.open_blob``) and
        its header (from the first chunk). The caller iterates the stream to the end or closes it."""
        st = self.store(run)
        k = RecordKey.parse(key)
        stream = st.open_blob(k, self.stream_chunk_bytes)
        try:
            header = codec.read_header(stream.head, key=k, total_length=stream.length)
        except CodecError:
            if len(stream.head) >= stream.length:
                stream.close()
                raise
            # a header longer than the first chunk (huge planes tables): read the record whole
            stream.close()
            blob = st.get_blob(k)
            stream, header = BlobStream.of_bytes(k, blob, self.stream_chunk_bytes), codec.read_header(blob, key=k)
        except BaseException:
            stream.close()
            raise
        return k, stream, header

    def tensor(self, run: str, key: str) -> tuple[RecordKey, torch.Tensor]:
        """The decoded tensor (checksum-verified)."""
        k, blob, _ = self.blob(run, key)
        return k, codec.decode_tensor(blob, key=k)

    def record(self, run: str, key: str, *, with_stats: bool = True) -> RecordDetail:
        """Metadata of one record and, unless it is too large or not numeric, its tensor statistics."""
        st = self.store(run)
        k, blob, header = self.blob(run, key)
        try:
            info = self._locate(st, k)
        except (
            ColdTierUnavailableError
        ):  # the bytes came from the hot tier; its listing of both tiers needs the cold one
            info = None
        entry = (
            _entry(info)
            if info is not None
            else _entry(RecordInfo(k, "hot", "", len(blob), header.raw_len, blob_checksum(blob), ""))
        )
        entry["raw_bytes"] = header.raw_len
        stats, skipped, document = None, None, None
        if k.channel.kind == Kind.META:  # a JSON document stored as bytes: show the document
            from trainer_client.meta import decode_meta  # (only for META records)

            try:
                document = decode_meta(codec.decode_tensor(blob, key=k))
                if not isinstance(document, dict):
                    raise ValueError(f"a JSON {type(document).__name__}, not an object")
            except (ValueError, UnicodeDecodeError) as e:
                skipped = f"META record is not a JSON document: {e}"
            else:
                skipped = "a META document (see meta)"
        elif not with_stats:
            skipped = "not requested"
        elif header.raw_len > self.max_tensor_stats_bytes:
            skipped = (
                f"record has {header.raw_len} raw bytes, above max_tensor_stats_bytes={self.max_tensor_stats_bytes}"
            )
        else:
            t = codec.decode_tensor(blob, key=k)
            try:
                stats = tensor_stats(t)
            except (TypeError, RuntimeError) as e:
                skipped = f"no statistics for dtype {t.dtype}: {e}"
        return RecordDetail(
            **entry,
            dtype=str(header.dtype).removeprefix("torch."),
            shape=list(header.shape),
            codec=header.codec,
            raw_checksum=_hex(header.checksum),
            stats=stats,
            stats_skipped=skipped,
            meta=document,
        )

    # ------------------------------------------------------------------ checkpoints, GC, flush, verify
    def checkpoints(self, run: str) -> CheckpointList:
        st = self.store(run)
        cps = st.checkpoints()
        wm: dict[int, int] = {}
        for c in cps:
            wm[c.stage] = max(wm.get(c.stage, 0), c.iteration)
        return CheckpointList(
            run=run,
            checkpoints=[_checkpoint(c) for c in cps],
            watermarks=[Watermark(stage=s, iteration=i) for s, i in sorted(wm.items())],
        )

    def register_checkpoint(self, run: str, req: CheckpointRequest) -> Checkpoint:
        """Record a durable checkpoint.

        Unless ``req.force``, refuses (BadRequestError) what is surely a mistake, since it would
        make logs garbage: a stage beyond every stage the run's channels name, an iteration beyond
        one past the last iteration logged in any tier, no ``uri``, or a ``uri`` that this node
        cannot read as a checkpoint of that run, stage and iteration (local paths and file://;
        s3:// with the cold tier's options; other schemes are not fetched)."""
        st = self.store(run)
        if not req.force:
            self._check_registration(run, req)
        try:
            c = st.register_checkpoint(req.stage, req.iteration, uri=req.uri, meta=req.meta)
        finally:
            self._summaries.invalidate(run)
        return _checkpoint(c)

    def unregister_checkpoint(self, run: str, req: UnregisterRequest) -> UnregisterResult:
        """Preview (unless ``req.confirm``) or withdraw one registration: the watermarks and a GC
        dry run with it and without it. CheckpointNotFoundError when it is not registered."""
        st = self.store(run)
        p = st.preview_unregister(req.stage, req.iteration)
        if p is None:
            raise CheckpointNotFoundError(
                f"run {run!r} has no registration of stage {req.stage}'s checkpoint at iteration {req.iteration}",
                key=f"stage{req.stage}/it{req.iteration}",
                hint=f"`swiftlog stat --run {run}` lists the registrations",
            )
        if req.confirm:
            try:
                st.unregister_checkpoint(req.stage, req.iteration)
            finally:
                self._summaries.invalidate(run)
        notes = []
        old, new = p.watermarks_before.get(req.stage, 0), p.watermarks_after.get(req.stage, 0)
        if new < old:
            notes.append(
                f"stage {req.stage}'s watermark falls from {old} to {new}: records it received in iterations "
                f"{new}..{old - 1} that a GC already deleted are not brought back "
                "(swiftlog plan says whether a replay can start there)"
            )
        if st.cold is None:
            notes.append(
                "no cold tier: the registration is withdrawn from this node's hot indexes only; "
                "a node that holds its own copy keeps it until unregistered there"
            )

        def preview(r: Any) -> GcPreview:
            return GcPreview(
                hot_records=r.hot_records,
                hot_segments=r.hot_segments,
                hot_bytes=r.hot_bytes,
                cold_segments=r.cold_segments,
                cold_bytes=r.cold_bytes,
            )

        return UnregisterResult(
            run=run,
            dry_run=not req.confirm,
            checkpoint=_checkpoint(p.checkpoint),
            watermarks_before=[Watermark(stage=s, iteration=i) for s, i in sorted(p.watermarks_before.items())],
            watermarks_after=[Watermark(stage=s, iteration=i) for s, i in sorted(p.watermarks_after.items())],
            gc_before=preview(p.gc_before),
            gc_after=preview(p.gc_after),
            notes=notes,
        )

    def _check_registration(self, run: str, req: CheckpointRequest) -> None:
        s = self.summary(run, fresh=True)  # the newest iteration may be seconds old
        named = {st for c in s.channels for st in (c.src, c.dst)}
        if named and req.stage > max(named):
            raise BadRequestError(
                f"stage {req.stage} is beyond the stages of run {run!r} (its channels name stages {min(named)}..{max(named)})",
                hint='check the stage; pass "force": true to register it anyway',
            )
        last = max(
            (
                t.last_iteration
                for c in s.channels
                for t in (c.hot, c.cold)
                if t is not None and t.last_iteration is not None
            ),
            default=None,
        )
        if last is not None and req.iteration > last + 1:
            raise BadRequestError(
                f"iteration {req.iteration} is beyond the logs of run {run!r} (last logged iteration {last}): it would make every "
                f"record stage {req.stage} received garbage",
                hint='check the iteration; pass "force": true to register it anyway',
            )
        if req.uri is None:
            raise BadRequestError(
                f"a registration of stage {req.stage} at iteration {req.iteration} without a uri cannot be checked",
                hint='give the uri the checkpoint was saved to; pass "force": true to register it anyway',
            )
        self._check_checkpoint_file(run, req.stage, req.iteration, req.uri)

    def _check_checkpoint_file(self, run: str, stage: int, iteration: int, uri: str) -> None:
        """BadRequestError unless ``uri`` is a swiftlog checkpoint of ``run``'s ``stage`` at ``iteration``:
        read here (a local path or file://, or s3:// with the cold tier's options), by its pickle alone.
        A missing file and a file of another kind get the same answer: the check reveals no file."""
        scheme = uri.split("://", 1)[0] if "://" in uri else None
        unchecked = 'pass "force": true to register it unchecked'
        if scheme is not None and scheme != scheme.lower():
            raise BadRequestError(
                f"checkpoint uri {uri!r}: the scheme must be lower case (fsspec does not know {scheme!r})",
                hint="e.g. file:///ckpt/stage00001/it000000000005.pt or s3://bucket/...",
            )
        local = uri[len("file://") :] if scheme == "file" else (uri if scheme is None else None)
        if local is not None and not os.path.isabs(local):
            raise BadRequestError(
                f"checkpoint uri {uri!r} is a relative path: it would be read relative to whichever process reads it",
                hint="give an absolute path (file:///abs/path/it000000000005.pt) or a URL",
            )
        options: dict[str, Any] = {}
        if scheme in ("s3", "s3a"):
            if not (self.cold_url or "").startswith(("s3://", "s3a://")):
                raise BadRequestError(
                    f"checkpoint uri {uri!r} cannot be checked: no S3 cold tier here whose credentials read it",
                    hint=unchecked,
                )
            options = self.cold_options
        elif local is None:
            raise BadRequestError(
                f"checkpoint uri {uri!r} cannot be checked: the server reads checkpoints from local paths, file:// "
                f"and s3:// only (it never fetches {scheme}:// URLs)",
                hint=unchecked,
            )
        from trainer_client.checkpoint import read_identity  # (only for registrations)

        try:
            ident = read_identity(uri, storage_options=options)
        except SwiftlogError:
            ident = None
        if ident is None or (ident.run_id, ident.stage, ident.iteration) != (run, stage, iteration):
            raise BadRequestError(
                f"checkpoint uri {uri!r} is not a readable swiftlog checkpoint of run {run!r}, stage {stage}, "
                f"iteration {iteration}",
                hint="register a checkpoint once it is durable, with the uri save_checkpoint returned; "
                'pass "force": true if it is readable elsewhere',
            )

    def gc(self, run: str, *, confirm: bool = False) -> GcResult:
        """Garbage below the watermarks: reported (dry run) unless ``confirm``, then deleted."""
        st = self.store(run)
        try:
            rep = st.gc(dry_run=not confirm)
        finally:
            if confirm:
                self._summaries.invalidate(run)
        d = rep.to_dict()
        d["watermarks"] = [Watermark(stage=s, iteration=i) for s, i in sorted(rep.watermarks.items())]
        return GcResult(run=run, **d)

    def flush(self, run: str) -> FlushResult:
        """Upload the sealed segments of every writer of the run (see LogStore.upload_sealed)."""
        st = self.store(run)
        if st.cold is None:
            raise NoColdTierError(
                "no cold tier configured: nothing to flush to",
                hint="start the server (or run the CLI) with --cold-url / SWIFTLOG_COLD_URL",
            )
        try:
            rep = st.upload_sealed()
        finally:
            self._summaries.invalidate(run)
        return FlushResult(
            run=run,
            uploaded_segments=len(rep["uploaded"]),
            uploaded_bytes=rep["uploaded_bytes"],
            already_uploaded=rep["already_uploaded"],
            open_segments=[
                OpenSegment(
                    writer=o["writer"],
                    channel=o["channel"],
                    first_iteration=o["lo"],
                    last_iteration=o["hi"],
                    records=o["records"],
                    bytes=o["bytes"],
                )
                for o in rep["open"]
            ],
            skipped_writers=st.unreadable_writers(),
        )

    def verify(self, run: str, progress: Callable[[str, int, int], None] | None = None) -> VerifyResult:
        """Every checksum of both tiers; problems are listed, never raised."""
        rep = self.store(run).verify(progress=progress)
        return VerifyResult(
            run=run,
            ok=rep.ok,
            hot_checked=rep.hot_checked,
            cold_checked=rep.cold_checked,
            cold_segments=rep.cold_segments,
            problems=[VerifyProblem(**p) for p in rep.problems],
        )

    # ------------------------------------------------------------------ recovery
    def plan(
        self,
        run: str,
        failed_stages: list[int],
        *,
        target_iteration: int | None = None,
        bandwidth_mbps: float | None = None,
        workers: int | None = None,
    ) -> RecoveryPlan:
        """The recovery plan of the pluggable planner; NotAvailableError until it is installed.

        ``target_iteration`` (where the survivors stand), ``bandwidth_mbps`` (for the fetch time
        estimate) and ``workers`` (parallel replay) are passed to the planner only when given,
        so a planner without them keeps working.
        """
        st = self.store(run)
        if not failed_stages:
            raise BadRequestError("no failed stage given", hint="name at least one failed stage")
        fn = load_planner(self.planner)
        options = {
            k: v
            for k, v in (
                ("target_iteration", target_iteration),
                ("bandwidth_mbps", bandwidth_mbps),
                ("workers", workers),
            )
            if v is not None
        }
        try:
            plan = fn(store=st, failed_stages=sorted(set(failed_stages)), **options)
        except SwiftlogError:
            raise
        except (ValueError, KeyError) as e:
            raise BadRequestError(f"recovery planner refused the request: {e}") from e
        return RecoveryPlan(
            run=run, failed_stages=sorted(set(failed_stages)), planner=self.planner, plan=to_jsonable(plan)
        )
