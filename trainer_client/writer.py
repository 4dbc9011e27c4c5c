"""The asynchronous log writer: the training thread enqueues, background threads encode and write.

Data path::

    training thread           writer thread                encode pool (encode_threads)
    ---------------           -------------                -----------------------------
    submit(channel, it, mb,   pops items in FIFO order,    codec.encode_tensor(host tensor)
      tensors) -> queue  -->  hands records to the pool, -->  (after the CUDA copy event)
    mark(fn)                  writes finished records in
    gap(...)                  order with store.put_encoded
                              (batches), runs markers and
                              gaps in queue order

What the training thread pays: on CPU a reference (sent tensors are never mutated by
``PipelineStage`` afterwards) or a copy (``copy=True``: inputs/targets a user may reuse), plus an
append under a lock. Digests of received buffers: the pipeline stage defers them (a reference,
hashed by the encode pool while the next micro-batches compute; :meth:`AsyncLogWriter.settle_digests`
at the start of the next schedule step, before any receive can overwrite a buffer, hashes on the
training thread only what the pool has not reached yet); the explicit API hashes on the spot.
On CUDA: one device-to-host copy into pinned memory issued on a side stream after an event on
the current stream; the writer waits on the copy's event, never the training thread. Records
are written in submission order, so a marker runs only after every record submitted before it
is acknowledged by the store (used to seal segments and to trigger GC).

When the writer works: it is not woken per record (it would then compete with the training
thread for the GIL around every torch op) but when a quarter of ``max_queue_bytes`` (at most
8 MiB) is queued, by markers, gaps and :meth:`kick` (the client kicks at every commit, so an
iteration's records are encoded and written while the optimizer steps and the next iteration
starts), and at the latest after one second.

Memory bound: bytes of queued records (raw size; pinned buffers on GPU) are reserved at submit and
released once written or dropped. When a submit would exceed ``max_queue_bytes`` the policy is
explicit: ``"wait"`` blocks until enough is freed, for at most ``overflow_wait`` (counted and
timed in stats), ``"gap"`` drops the record and marks a gap in the store (counted). A wait that
times out drops the record as a gap too (an "overflow_timeout" fault); until the writer frees
memory again, later records that do not fit are dropped without waiting, so a hung store costs
the training thread one wait, not one per record. A record larger than the bound is admitted
when the queue is empty.

Digest work has a bound of its own, also ``max_queue_bytes``: the received buffers held until
they are hashed (references on CPU, pinned copies on GPU). A buffer is let go as soon as it is
hashed. Beyond the bound a CPU buffer is hashed on the spot by the training thread (nothing is
lost); a GPU buffer follows the overflow policy, and its digest dropped is a recorded gap.
Digest records themselves (8 bytes) and gap markers are never dropped.

Faults (encode errors, ``StoreFullError``, a closed store, anything unexpected) never reach the
training thread: the affected records become gaps (``store.record_gap``) when possible, and every
fault is counted and kept for :meth:`AsyncLogWriter.take_faults`. The writer thread survives any
bad item.

This module is over 600 lines because the writer is one thing: a queue, the lock that guards it
and the one thread that drains it. Each method runs either on the training thread or on the
writer thread, and they share the queue's invariants (the bounds, the order, the faults) under
that one lock. The queue's items and pinned buffers (``_staging``) and its counters
(``_writer_stats``) live apart.

Never: blocks the training thread on encoding or I/O (only on the memory bound under "wait", for at
most ``overflow_wait`` at a time, and in :meth:`drain`/:meth:`close`); keeps a received buffer
after hashing it; reorders records; writes from more than one thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from logstore import Channel, Encoded, LogStore, RecordKey, codec
from logstore.errors import StoreClosedError, StoreFullError, SwiftlogError
from logstore.segment import blob_checksum
from trainer_client._staging import PinnedPool, QueueItem
from trainer_client._writer_stats import MAX_FAULTS, Fault, WriterStats
from trainer_client.config import WriterConfig
from trainer_client.digest import digest_record, tensor_digest

__all__ = ["AsyncLogWriter", "Fault", "WriterStats", "auto_encode_threads"]

logger = logging.getLogger(__name__)

_WINDOW = 16  # records handed to the encode pool ahead of the writer
_POLL_S = 1.0  # longest time a queued record waits for the writer (it is woken earlier at thresholds and commits)


def auto_encode_threads(on_gpu: bool) -> int:
    """The encode pool size ``encode_threads=None`` chooses at the first record: 1 when the stage
    captures CPU tensors (its own compute needs the cores), and for a stage on a GPU the node's
    usable cores per GPU, at most 4 (on an H200 stage producing 1.6 GB/s of captures, 4 threads
    kept logging at 1.2-1.7 % per iteration where 1 thread cost 2-15 %; docs/gpu.md)."""
    if not on_gpu:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, torch.cuda.device_count())))


class AsyncLogWriter:
    """Bounded, ordered, asynchronous writer of tensor records into one LogStore.

    Args:
        store: a LogStore opened with a writer name (the writer thread is its only appender).
        config: the writer's :class:`~trainer_client.config.WriterConfig` (memory bound, overflow
            policy, codec, encode pool, batch sizes; see the module docstring). None: its defaults.
            Its ``encode_threads=None`` chooses at the first record (:func:`auto_encode_threads`:
            1 for CPU tensors, up to 4 for CUDA ones).
        name: thread name suffix (for debugging).
    """

    def __init__(self, store: LogStore, config: WriterConfig | None = None, *, name: str = "swiftlog") -> None:
        config = WriterConfig() if config is None else config
        self._store = store
        self._codec = config.codec
        self._max = config.max_queue_bytes
        self._overflow = config.overflow
        self._wait_s = config.overflow_wait.total_seconds()
        self._stalled = False  # a wait at the bound timed out and the writer has finished nothing since
        self._waiting = 0  # callers waiting for room at a bound (a release wakes them, never the idle writer)
        self._batch_records = config.batch_records
        self._batch_bytes = config.batch_bytes
        self._cv = threading.Condition()
        self._queue: collections.deque[QueueItem] = collections.deque()
        self._busy = 0  # items popped by the writer but not finished
        self._closing = False
        self._stats = WriterStats()
        self._faults: collections.deque[Fault] = collections.deque(maxlen=MAX_FAULTS)
        self._new_faults: list[Fault] = []
        self._pinned = PinnedPool(self._max)
        self._unsettled: list[QueueItem] = []  # deferred digest items; only the training thread touches the list
        self._hash_lock = threading.Lock()  # a deferred item is hashed exactly once, by whoever comes first
        # the writer is woken when this many bytes are queued, by markers, or after _POLL_S:
        # waking it for every record would make it compete for the GIL at every torch op
        self._wake_bytes = max(1, min(self._max // 4, 8 << 20))
        self._writer_idle = False
        self._side_streams: dict[int, Any] = {}
        self._name = name
        self._auto_threads = config.encode_threads is None
        self._pool: ThreadPoolExecutor | None = None
        self._encode_threads = 0
        if config.encode_threads:
            self._start_pool(config.encode_threads)
        self._thread = threading.Thread(target=self._run, name=f"{name}-writer", daemon=True)
        self._thread.start()

    # ================================================================ training thread
    def submit(
        self,
        channel: Channel,
        iteration: int,
        micro_batch: int,
        tensors: Sequence[torch.Tensor],
        *,
        copy: bool = False,
        nbytes: int | None = None,
    ) -> bool:
        """Queue the tensors of one (channel, iteration, micro-batch) as parts 0..n-1.

        ``copy=False``: the caller promises not to modify the tensors afterwards (CPU tensors are
        kept by reference). ``copy=True``: CPU tensors are copied now. CUDA tensors are always
        copied to pinned host memory on a side stream. ``nbytes``: the tensors' total size if the
        caller already knows it. Returns False when the record was dropped ("gap" policy or a
        closed writer); never raises for a logging fault.
        """
        t0 = time.perf_counter()
        try:
            if nbytes is None:
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if not self._reserve(nbytes, channel, iteration, micro_batch):
                return False
            item = QueueItem("rec")
            item.channel, item.iteration, item.micro_batch, item.nbytes = channel, iteration, micro_batch, nbytes
            try:
                self._stage(item, tensors, copy)
            except Exception as e:  # a staging failure must not reach the training step
                self._release(nbytes)
                self._fault("encode", f"staging failed: {type(e).__name__}: {e}", channel, iteration, micro_batch)
                self.gap(channel, iteration, micro_batch, f"staging failed: {e}")
                return False
            with self._cv:
                self._stats.records_submitted += len(tensors)
                self._stats.bytes_submitted += nbytes
                self._queue.append(item)
                if self._writer_idle and self._stats.queue_bytes >= self._wake_bytes:
                    self._cv.notify_all()
            return True
        finally:
            dt = time.perf_counter() - t0
            self._stats.submit_s += dt
            self._stats.submit_max_s = max(self._stats.submit_max_s, dt)

    def submit_digests(
        self,
        channel: Channel,
        iteration: int,
        micro_batch: int,
        tensors: Sequence[torch.Tensor],
        *,
        defer: bool = False,
    ) -> None:
        """Queue digest records of ``tensors`` (parts 0..n-1) under a DIGEST channel.

        ``defer=False``: CPU tensors are hashed now (xxh3), so the caller may reuse the buffers
        as soon as this returns. ``defer=True``: CPU tensors are kept by reference and hashed by
        the encode pool; the caller promises not to modify them before its next
        :meth:`settle_digests` call. CUDA tensors are copied to pinned memory on a side stream and
        hashed by the writer, and the current stream waits for that copy, so a later receive
        cannot overwrite the buffer before it was read. A buffer is let go once hashed. Beyond
        the digest bound (module docstring) a CPU buffer is hashed now and a CUDA buffer follows
        the overflow policy (its digest dropped is a recorded gap). Never raises.
        """
        t0 = time.perf_counter()
        item = QueueItem("rec")
        try:
            item.channel, item.iteration, item.micro_batch = channel, iteration, micro_batch
            item.hash_only = True
            on_cpu = all(t.device.type == "cpu" for t in tensors)
            if not on_cpu or defer:
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                held = self._hold_digest(nbytes, channel, iteration, micro_batch, can_hash_now=on_cpu)
                if not held and not on_cpu:
                    return  # dropped at the bound: a gap is queued
                item.held = nbytes if held else 0
            if not on_cpu:
                self._stage(item, tensors, copy=True, order_current_stream=True)
            elif item.held:
                item.tensors = list(tensors)
                item.nparts = len(item.tensors)
                self._unsettled.append(item)
            else:
                if defer:
                    self._stats.digests_hashed_at_bound += len(tensors)
                item.digests = [tensor_digest(t) for t in tensors]
                item.nparts = len(item.digests)
            with self._cv:
                self._stats.digests_submitted += len(tensors)
                self._queue.append(item)
        except Exception as e:
            self._release_digest(item)
            self._fault("encode", f"digest failed: {type(e).__name__}: {e}", channel, iteration, micro_batch)
        finally:
            self._stats.digest_s += time.perf_counter() - t0

    def settle_digests(self) -> None:
        """Make sure every digest deferred so far is computed, so that the buffers passed to
        ``submit_digests(defer=True)`` may be overwritten once this returns.

        Waits at most for one hash in progress on the pool; hashes on the calling thread what
        the pool has not reached (counted in ``digests_settled_inline``). Never waits on
        encoding or I/O; never raises (a failed hash is a fault and the record is dropped).
        """
        if not self._unsettled:
            return
        t0 = time.perf_counter()
        pending, self._unsettled = self._unsettled, []
        try:
            for item in pending:
                if item.digests is None:
                    try:
                        if self._hash_deferred(item):
                            self._stats.digests_settled_inline += len(item.digests or ())
                    except Exception as e:  # the pool will meet the same error and drop the record
                        self._fault(
                            "encode",
                            f"digest failed: {type(e).__name__}: {e}",
                            item.channel,
                            item.iteration,
                            item.micro_batch,
                        )
                        item.digests = []
                        item.tensors = []
                        self._release_digest(item)
        finally:
            self._stats.digest_s += time.perf_counter() - t0

    def _hash_deferred(self, item: QueueItem) -> bool:
        """Compute ``item.digests`` unless someone already did; True if this call hashed. A CPU
        item's buffers are let go once hashed (pinned copies go back to their pool after encoding)."""
        with self._hash_lock:
            if item.digests is not None:
                return False
            item.digests = [tensor_digest(t) for t in item.tensors]
            if not item.pinned:
                item.tensors = []
        if not item.pinned:
            self._release_digest(item)
        return True

    def kick(self) -> None:
        """Wake the writer now (e.g. at the end of an iteration) instead of at the next threshold."""
        with self._cv:
            self._cv.notify_all()

    def mark(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the writer thread once everything submitted before is written.

        Exceptions from ``fn`` are recorded as faults of kind "marker", never raised.
        """
        item = QueueItem("mark")
        item.fn = fn
        with self._cv:
            self._queue.append(item)
            self._cv.notify_all()

    def gap(self, channel: Channel, iteration: int, micro_batch: int, reason: str) -> None:
        """Queue a ``store.record_gap`` (the training thread never touches the store itself)."""
        item = QueueItem("gap")
        item.channel, item.iteration, item.micro_batch, item.reason = channel, iteration, micro_batch, reason
        with self._cv:
            self._queue.append(item)
            self._cv.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every item submitted so far is processed. Returns False on timeout."""
        with self._cv:
            if self._closing or not self._thread.is_alive():
                return not self._queue and self._busy == 0
        done = threading.Event()
        self.mark(done.set)
        return done.wait(timeout)

    # ================================================================ reporting
    def stats(self) -> WriterStats:
        """A snapshot of the counters (a copy; safe to keep)."""
        with self._cv:
            s = WriterStats(**{k: getattr(self._stats, k) for k in WriterStats.__slots__})
            s.faults_by_kind = dict(self._stats.faults_by_kind)
            s.queue_items = len(self._queue) + self._busy
            s.pinned_bytes = self._pinned.nbytes
            s.encode_threads = self._encode_threads
            return s

    def take_faults(self) -> list[Fault]:
        """Faults recorded since the previous call (oldest first)."""
        with self._cv:
            out, self._new_faults = self._new_faults, []
            return out

    def recent_faults(self) -> list[Fault]:
        """The last faults (up to 256), oldest first."""
        with self._cv:
            return list(self._faults)

    def note_fault(
        self,
        kind: str,
        message: str,
        *,
        channel: Channel | None = None,
        iteration: int | None = None,
        micro_batch: int | None = None,
    ) -> None:
        """Record a fault observed elsewhere (e.g. a capture hook) with the writer's faults."""
        self._fault(kind, message, channel, iteration, micro_batch)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Write everything queued, then stop the threads. Returns False if ``timeout`` hit first
        (the rest of the queue is then abandoned and counted as dropped). Idempotent."""
        with self._cv:
            if self._closing:
                return True
        ok = self.drain(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=None if ok else 1.0)
        if self._pool is not None:
            self._pool.shutdown(wait=ok, cancel_futures=not ok)
        if not ok:
            with self._cv:
                lost = [i for i in self._queue if i.kind == "rec"]
                self._queue.clear()
            for i in lost:
                self._drop(i, "writer closed before the record was written")
        return ok

    # ================================================================ internals: training side
    def _reserve(self, nbytes: int, channel: Channel, iteration: int, micro_batch: int) -> bool:
        with self._cv:
            st = self._stats
            if self._closing:
                st.records_dropped += 1
                st.bytes_dropped += nbytes
                self._fault_locked("closed", "submit after close", channel, iteration, micro_batch)
                return False

            def fits() -> bool:
                return st.queue_bytes == 0 or st.queue_bytes + nbytes <= self._max

            full = f"queue full ({st.queue_bytes} + {nbytes} > {self._max} bytes)"
            why = self._room(fits, full, channel, iteration, micro_batch)
            if why is None:
                st.queue_bytes += nbytes
                st.queue_peak_bytes = max(st.queue_peak_bytes, st.queue_bytes)
                return True
            st.overflow_drops += 1
            st.records_dropped += 1
            st.bytes_dropped += nbytes
        self.gap(channel, iteration, micro_batch, f"overflow: {why}")
        return False

    def _hold_digest(self, nbytes: int, channel: Channel, iteration: int, micro_batch: int, can_hash_now: bool) -> bool:
        """Count ``nbytes`` of received buffers in ``digest_bytes`` if the digest bound allows (or
        after a wait under "wait"); False otherwise: a CPU buffer is then hashed now, and for any
        other a gap is queued."""
        with self._cv:
            st = self._stats

            def fits() -> bool:
                return st.digest_bytes == 0 or st.digest_bytes + nbytes <= self._max

            if fits():
                why = None
            elif can_hash_now:  # hashing a CPU buffer costs less than waiting for room
                return False
            else:
                why = self._room(
                    fits,
                    f"digest buffers full ({st.digest_bytes} + {nbytes} > {self._max} bytes)",
                    channel,
                    iteration,
                    micro_batch,
                )
            if why is None:
                st.digest_bytes += nbytes
                st.digest_peak_bytes = max(st.digest_peak_bytes, st.digest_bytes)
                return True
            st.digest_gaps += 1
        self.gap(channel, iteration, micro_batch, f"overflow: {why}")
        return False

    def _room(
        self, fits: Callable[[], bool], full: str, channel: Channel, iteration: int, micro_batch: int
    ) -> str | None:
        """With ``self._cv`` held: None when ``fits()`` (at once, or after a wait under "wait");
        otherwise why not, recorded as a fault. A wait lasts at most ``overflow_wait``; after one
        timed out, none starts until the writer finishes an item."""
        st = self._stats
        if fits():
            return None
        if self._overflow == "gap":
            self._fault_locked("overflow", f"{full}: record dropped", channel, iteration, micro_batch)
            return full
        if self._stalled:
            why = f"{full}, and the writer has finished nothing since a wait timed out"
            self._fault_locked("overflow", f"{why}: record dropped without waiting", channel, iteration, micro_batch)
            return why
        st.overflow_waits += 1
        t0 = time.perf_counter()
        deadline = t0 + self._wait_s
        self._cv.notify_all()  # the writer may be sleeping below its wake threshold
        self._waiting += 1
        try:
            while not fits() and not self._closing:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.5))
        finally:
            self._waiting -= 1
        st.overflow_wait_s += time.perf_counter() - t0
        if fits() or self._closing:  # a closing writer drops what is still queued (close)
            return None
        self._stalled = True
        st.overflow_timeouts += 1
        why = f"{full} after waiting {self._wait_s:g} s (overflow_wait) for the writer to free memory"
        said = f"{why}: record dropped; until the writer finishes an item, what does not fit is dropped at once"
        self._fault_locked("overflow_timeout", said, channel, iteration, micro_batch)
        return why

    def _release_digest(self, item: QueueItem) -> None:
        """Stop counting ``item``'s received buffers in ``digest_bytes`` (idempotent)."""
        if item.held:
            with self._cv:
                self._stats.digest_bytes -= item.held
                item.held = 0
                if self._waiting:
                    self._cv.notify_all()

    def _release(self, nbytes: int) -> None:
        with self._cv:
            self._stats.queue_bytes -= nbytes
            self._cv.notify_all()

    def _stage(
        self, item: QueueItem, tensors: Sequence[torch.Tensor], copy: bool, order_current_stream: bool = False
    ) -> None:
        """Make host tensors the writer may read later without racing the training thread."""
        out: list[torch.Tensor] = []
        for t in tensors:
            if t.requires_grad:  # never keep an autograd graph alive (sends are already detached)
                t = t.detach()
            if t.device.type == "cuda":
                host, ev = self._copy_to_pinned(t, order_current_stream)
                out.append(host)
                item.events.append(ev)
                item.pinned = True
            elif t.device.type == "cpu":
                out.append(t.clone() if copy else t)
            else:
                out.append(t.to("cpu"))  # other accelerators: a synchronous copy (correct, not fast)
        item.tensors = out
        item.nparts = len(out)

    def _copy_to_pinned(self, t: torch.Tensor, order_current_stream: bool) -> tuple[torch.Tensor, Any]:
        dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
        stream = self._side_streams.get(dev)
        if stream is None:
            stream = self._side_streams[dev] = torch.cuda.Stream(device=dev)
        current = torch.cuda.current_stream(dev)
        host = self._pinned.get(t.shape, t.dtype)
        stream.wait_stream(current)  # the copy sees everything the training stream did so far
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the caching allocator must not recycle t before the copy ran
        ev = torch.cuda.Event()
        ev.record(stream)
        if order_current_stream:
            # received buffers are reused by the next receive: later work waits for our read
            current.wait_event(ev)
        return host, ev

    # ================================================================ internals: writer thread
    def _run(self) -> None:
        inflight: collections.deque[QueueItem] = collections.deque()
        while True:
            with self._cv:
                if (
                    not self._closing
                    and self._stats.queue_bytes < self._wake_bytes
                    and not any(i.kind != "rec" for i in self._queue)
                ):
                    # sleep until woken (threshold, marker, close) or for at most _POLL_S
                    self._writer_idle = True
                    self._cv.wait(_POLL_S)
                    self._writer_idle = False
                if self._closing and not self._queue and not inflight:
                    return
            self._refill(inflight)
            try:
                self._process(inflight)
            except Exception as e:  # the writer thread must survive anything
                logger.exception("swiftlog writer: unexpected error")
                self._fault("write", f"writer loop: {type(e).__name__}: {e}")

    def _refill(self, inflight: collections.deque[QueueItem]) -> None:
        """Move queued items into the in-flight window (up to ``_WINDOW``) and hand every record
        not yet encoding to the pool. Writer thread only."""
        with self._cv:
            while self._queue and len(inflight) < _WINDOW:
                inflight.append(self._queue.popleft())
                self._busy += 1
        for it in inflight:
            if it.kind == "rec" and it.future is None:
                if self._auto_threads:  # the first record says where the stage computes
                    self._start_pool(auto_encode_threads(it.pinned))
                if self._pool is not None:
                    it.future = self._pool.submit(self._encode, it)

    def _process(self, inflight: collections.deque[QueueItem]) -> None:
        batch: list[tuple[QueueItem, list[bytes]]] = []
        batch_bytes = 0
        while inflight:
            head = inflight[0]
            if head.kind == "rec":
                if head.future is not None and not head.future.done() and batch:
                    self._write(batch)
                    batch, batch_bytes = [], 0
                blobs = self._encoded(head)
                inflight.popleft()
                if blobs is None:
                    self._finish(head)
                    continue
                batch.append((head, blobs))
                batch_bytes += sum(len(r.blob) for r in blobs)
                if len(batch) >= self._batch_records or batch_bytes >= self._batch_bytes:
                    self._write(batch)
                    batch, batch_bytes = [], 0
            else:
                if batch:
                    self._write(batch)
                    batch, batch_bytes = [], 0
                inflight.popleft()
                self._control(head)
                self._finish(head)
            if not inflight:  # keep going while work is queued: fewer, larger batches
                self._refill(inflight)
        if batch:
            self._write(batch)

    def _start_pool(self, n: int) -> None:
        self._pool = ThreadPoolExecutor(n, thread_name_prefix=f"{self._name}-encode")
        self._auto_threads = False
        with self._cv:
            self._encode_threads = n

    def _encode(self, item: QueueItem) -> list[Encoded]:
        """Encode an item's tensors on a pool thread: compression and the blob checksum are done
        here so that the single writer thread only does I/O (``LogStore.put_encoded``)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            for ev in item.events:
                ev.synchronize()
            if item.hash_only:
                self._hash_deferred(item)
                if len(item.digests or ()) != item.nparts:
                    raise RuntimeError("hashing the received buffers failed at settle time")
                recs = [digest_record(d) for d in item.digests or ()]
                codec_name = "raw"
            else:
                recs, codec_name = item.tensors, self._codec
            out = []
            for part, t in enumerate(recs):
                blob = codec.encode_tensor(t, codec=codec_name)
                key = RecordKey(item.channel, item.iteration, item.micro_batch, part)
                out.append(Encoded(key, blob, t.numel() * t.element_size(), blob_checksum(blob)))
            return out
        finally:
            if item.pinned:
                for t in item.tensors:
                    self._pinned.put(t)
                self._release_digest(item)
            with self._cv:
                self._stats.encode_s += time.perf_counter() - t0
                self._stats.encode_cpu_s += time.thread_time() - c0

    def _encoded(self, item: QueueItem) -> list[Encoded] | None:
        try:
            if item.future is not None:
                return item.future.result()
            return self._encode(item)
        except Exception as e:
            self._fault("encode", f"{type(e).__name__}: {e}", item.channel, item.iteration, item.micro_batch)
            self._drop(item, f"encode failed: {type(e).__name__}: {e}")
            return None
        finally:
            item.tensors = []  # let the tensors go as soon as they are encoded
            self._release_digest(item)

    def _write(self, batch: list[tuple[QueueItem, list[bytes]]]) -> None:
        rows = [rec for _, recs in batch for rec in recs]
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._store.put_encoded(rows)
        except Exception as e:
            kind = (
                "store_full"
                if isinstance(e, StoreFullError)
                else "closed"
                if isinstance(e, StoreClosedError)
                else "write"
            )
            self._fault(
                kind, f"{type(e).__name__}: {e}", batch[0][0].channel, batch[0][0].iteration, batch[0][0].micro_batch
            )
            for item, _ in batch:
                self._drop(item, f"{kind}: {type(e).__name__}: {e}")
                self._finish(item)
            return
        finally:
            with self._cv:
                self._stats.write_s += time.perf_counter() - t0
                self._stats.write_cpu_s += time.thread_time() - c0
        with self._cv:
            st = self._stats
            st.batches_written += 1
            for item, blobs in batch:
                st.records_written += len(blobs)
                if not item.hash_only:
                    st.bytes_written += item.nbytes
                st.stored_bytes_written += sum(len(r.blob) for r in blobs)
        for item, _ in batch:
            self._finish(item)

    def _control(self, item: QueueItem) -> None:
        if item.kind == "gap":
            self._record_gap(item.channel, item.iteration, item.micro_batch, item.reason)
            return
        try:
            assert item.fn is not None
            item.fn()
        except Exception as e:
            logger.warning("swiftlog writer: marker failed: %s", e)
            self._fault("marker", f"{type(e).__name__}: {e}")

    def _drop(self, item: QueueItem, reason: str) -> None:
        item.tensors = []
        self._release_digest(item)
        with self._cv:
            self._stats.records_dropped += item.nparts
            self._stats.bytes_dropped += item.nbytes
        if item.channel is not None:
            self._record_gap(item.channel, item.iteration, item.micro_batch, reason)

    def _record_gap(self, channel: Channel | None, iteration: int, micro_batch: int, reason: str) -> None:
        if channel is None:
            return
        try:
            self._store.record_gap(channel, iteration, micro_batch, reason)
            with self._cv:
                self._stats.gaps_recorded += 1
        except (SwiftlogError, OSError) as e:
            self._fault(
                "gap_record",
                f"could not record gap ({reason}): {type(e).__name__}: {e}",
                channel,
                iteration,
                micro_batch,
            )

    def _finish(self, item: QueueItem) -> None:
        with self._cv:
            self._busy -= 1
            if item.kind == "rec":
                self._stats.queue_bytes -= item.nbytes
            self._stalled = False  # the writer moves again: waiting at the bound makes sense again
            self._cv.notify_all()

    def _fault(
        self,
        kind: str,
        message: str,
        channel: Channel | None = None,
        iteration: int | None = None,
        micro_batch: int | None = None,
    ) -> None:
        with self._cv:
            self._fault_locked(kind, message, channel, iteration, micro_batch)

    def _fault_locked(
        self, kind: str, message: str, channel: Channel | None, iteration: int | None, micro_batch: int | None
    ) -> None:
        f = Fault(time.time(), kind, message, None if channel is None else channel.name, iteration, micro_batch)
        st = self._stats
        st.faults += 1
        st.faults_by_kind[kind] = st.faults_by_kind.get(kind, 0) + 1
        st.last_fault = f"{kind}: {message}"
        self._faults.append(f)
        if len(self._new_faults) < MAX_FAULTS:
            self._new_faults.append(f)
        if st.faults_by_kind[kind] <= 3 or st.faults_by_kind[kind] % 100 == 0:
            where = ", ".join(
                [
                    kind,
                    *([f.channel] if f.channel else []),
                    *([f"it={iteration}"] if iteration is not None else []),
                    *([f"mb={micro_batch}"] if micro_batch is not None else []),
                ]
            )
            logger.warning("swiftlog logging fault (%s): %s", where, message)
