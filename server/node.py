"""What the admin API and the CLI do over one node's store root, as typed results.

:class:`Node` opens each run's :class:`~logstore.LogStore` read-only (no writer name: the server
and the CLI are never the writer), keeps them open, and answers with the pydantic models of
:mod:`server.models`. Routers and CLI commands only parse, call one method, and render.

Reading never blocks a training process writing the same store: LMDB readers take no lock a
writer waits on, read transactions are short, and segment files are read with ``pread``.

Run summaries are served from a small cache (stale-while-revalidate, ``_summary.py``): younger
than ``summary_ttl`` as is; up to ``summary_max_stale`` old as is while one background thread
recomputes it; older or missing, computed in the caller's thread (one computation per run at a
time). Mutations through this class (checkpoint, GC, flush) drop the run's entry at once.
``as_of`` in every summary says when it was computed. The answers' conversions live in
``_views.py``, the checks of a registration in ``_registration.py``.

Never: writes a record, seals a segment (that is the writer's job), or deletes anything except
through ``gc(confirm=True)``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from logstore import LogStore, RecordInfo, StoreConfig, codec, list_runs
from logstore.errors import CodecError, ColdTierError, ColdTierUnavailableError, SwiftlogError
from logstore.keys import Channel, Kind, RecordKey, validate_run
from logstore.segment import BlobStream, blob_checksum
from logstore.store import writers_under
from server._registration import check_registration
from server._summary import SummaryCache, summarize
from server._views import checkpoint_view, decode_cursor, encode_cursor, hex64, kind_name, record_entry, tensor_stats
from server.errors import (
    BadRequestError,
    CheckpointNotFoundError,
    NoColdTierError,
    ProfileNotFoundError,
    RunNotFoundError,
)
from server.models import (
    Checkpoint,
    CheckpointList,
    CheckpointRequest,
    FlushResult,
    GcPreview,
    GcResult,
    OpenSegment,
    RecordDetail,
    RecordEntry,
    RecordPage,
    RecoveryPlan,
    RunBrief,
    RunList,
    RunSummary,
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
        self._summaries = SummaryCache(self._compute_summary, summary_ttl, summary_max_stale)
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
        return summarize(self.store(run), run, self.root / run)

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
                    f"unknown kind {kind!r}", hint="use " + ", ".join(kind_name(k) for k in Kind)
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
            records=[RecordEntry.model_construct(**record_entry(i)) for i in infos],  # built from trusted index data
            next_cursor=encode_cursor(infos[-1].key) if more and infos else None,
            cold_error=cold_error,
        )

    def _locate(self, st: LogStore, key: RecordKey) -> RecordInfo | None:
        infos = st.list_records(
            key.channel, key.iteration, key.iteration + 1, micro_batch=key.micro_batch, limit=key.part + 1
        )
        return next((i for i in infos if i.key == key), None)

    def opened(self, run: str) -> LogStore | None:
        """The run's store if it is open already; never opens one (no I/O)."""
        with self._lock:
            st = self._stores.get(run)
            if st is not None:
                self._used[run] = time.monotonic()
            return st

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
            record_entry(info)
            if info is not None
            else record_entry(RecordInfo(k, "hot", "", len(blob), header.raw_len, blob_checksum(blob), ""))
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
            raw_checksum=hex64(header.checksum),
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
            checkpoints=[checkpoint_view(c) for c in cps],
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
            summary = self.summary(run, fresh=True)  # the newest iteration may be seconds old
            check_registration(summary, req, cold_url=self.cold_url, cold_options=self.cold_options)
        try:
            c = st.register_checkpoint(req.stage, req.iteration, uri=req.uri, meta=req.meta)
        finally:
            self._summaries.invalidate(run)
        return checkpoint_view(c)

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
            checkpoint=checkpoint_view(p.checkpoint),
            watermarks_before=[Watermark(stage=s, iteration=i) for s, i in sorted(p.watermarks_before.items())],
            watermarks_after=[Watermark(stage=s, iteration=i) for s, i in sorted(p.watermarks_after.items())],
            gc_before=preview(p.gc_before),
            gc_after=preview(p.gc_after),
            notes=notes,
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
        failed_ranks: list[int] | None = None,
        stages_per_rank: int | None = None,
        stage_style: str | None = None,
    ) -> RecoveryPlan:
        """The recovery plan of the pluggable planner; NotAvailableError until it is installed.

        ``target_iteration`` (where the survivors stand), ``bandwidth_mbps`` (for the fetch time
        estimate), ``workers`` (parallel replay) and, for a multi-stage schedule, ``failed_ranks``
        with ``stages_per_rank`` and ``stage_style`` are passed to the planner only when given,
        so a planner without them keeps working.
        """
        st = self.store(run)
        if not failed_stages and not failed_ranks:
            raise BadRequestError("no failed stage given", hint="name at least one failed stage (or rank)")
        fn = load_planner(self.planner)
        options = {
            k: v
            for k, v in (
                ("target_iteration", target_iteration),
                ("bandwidth_mbps", bandwidth_mbps),
                ("workers", workers),
                ("failed_ranks", sorted(set(failed_ranks)) if failed_ranks else None),
                ("stages_per_rank", stages_per_rank),
                ("stage_style", stage_style),
            )
            if v is not None
        }
        try:
            plan = fn(store=st, failed_stages=sorted(set(failed_stages)), **options)
        except SwiftlogError:
            raise
        except (ValueError, KeyError) as e:
            raise BadRequestError(f"recovery planner refused the request: {e}") from e
        stages = getattr(plan, "failed_stages", None) or sorted(set(failed_stages))
        return RecoveryPlan(run=run, failed_stages=stages, planner=self.planner, plan=to_jsonable(plan))

    # ------------------------------------------------------------------ logging groups
    def profile(self, run: str) -> dict[str, Any]:
        """The run's saved cost profile (``replay.profile``); ProfileNotFoundError (404) when none."""
        from replay.profile import load_profile

        p = load_profile(self.store(run))
        if p is None:
            raise ProfileNotFoundError(
                f"run {run!r} has no cost profile",
                hint=f"measure one: swiftlog profile --run {run} (after a few iterations with every boundary logged)",
            )
        return p.to_dict()

    def plan_groups(self, run: str, **options: Any) -> dict[str, Any]:
        """Logging groups for the run from its saved profile (``replay.plan_groups``; ``options``
        are its keyword arguments). BadRequestError for options it refuses, BudgetTooSmallError
        (a ConfigError: 400 / exit 2) when no grouping fits."""
        from replay.group_planner import plan_groups
        from replay.profile import JobProfile

        profile = JobProfile.from_dict(self.profile(run))
        try:
            return plan_groups(profile, **options).to_dict()
        except SwiftlogError:
            raise
        except ValueError as e:
            raise BadRequestError(f"the group planner refused the request: {e}") from e
