"""The hot tier: LMDB as the index of append-only segment files, one environment per writer.

Layout under a node's store root::

    <root>/<run>/<writer>/index/          LMDB environment (data.mdb, lock.mdb)
    <root>/<run>/<writer>/segments/<id>.seg   segment files (see logstore.segment)
    <root>/<run>/<writer>/writer.lock     flock held by the one process that appends

Why this layout: record bytes never enter LMDB, so a rolling window (append new iterations,
GC old ones) cannot fragment LMDB's free pages; deleting a dead segment returns its space to the
filesystem at once. LMDB holds only small fixed-size index entries and segment states, and gives
other processes (server, CLI) consistent reads while the trainer writes.

Sub-databases:
- ``records``:  encoded RecordKey -> (segment id, blob offset, blob length, blob xxh3, raw length)
- ``segments``: segment id (u64) -> JSON SegmentMeta (channel, iteration range, state, sizes)
- ``meta``:     counters and small documents (next segment id, checkpoints, what GC collected)

Durability modes (``durability``):
- ``"process"`` (default): a put returns after the frame was written (page cache) and the index
  transaction committed without fsync. Survives the death of the writing process (SIGKILL,
  OOM). A power loss or kernel crash can lose the last records (file pages and index pages
  reach the disk independently) and can damage the index; the next open names what is lost
  (gaps) and never serves wrong bytes (see crash consistency).
- ``"fsync"``: segment data is fdatasync'ed and the LMDB commit is synced before a put returns;
  ``segments/`` is synced after a segment file is created or deleted.

The environment is opened without ``writemap``: a commit writes its pages with write() calls, so
a full disk is an error the writer reports (StoreFullError; logging degrades, training goes on),
never a SIGBUS from a page of a sparse mapped file the disk cannot back (what ``writemap`` did).
It costs little: a commit of 8 index entries takes 13.5 us instead of 9.3 us (0.7 % of the store
bench's hot-ingest round). LMDB's copy-on-write tree
keeps a killed writer's uncommitted pages unreachable either way.

Crash consistency: frames are written before the index entry that points to them commits, so
an acknowledged record is always complete after a process death. On open, the writer walks its
index, truncates every open segment to the end recorded in the index (dropping frames whose
commit never happened) and seals it. After a power loss: an open segment file shorter than that
end keeps its whole frames, and each record acknowledged past them is recorded as a gap; an
index that cannot be read is moved aside (``index.damaged-<time>``, kept) and the segment files
are re-indexed (a frame cut short that names its record is a gap). Every read compares the
frame header (key, length, checksum) with the index entry and the bytes with the checksum.

Modules: ``_tier`` (:class:`HotTier`: open, append, seal, GC), ``_index`` (the LMDB index: its
entries, transactions and queries), ``_recovery`` (what the writer does at open), ``_env`` (LMDB
environments shared in a process, and the lock around a map resize).

Never: holds an LMDB transaction across user code; returns bytes it did not checksum.
"""

from logstore.hot._index import EVICTED, OPEN, SEALED, UPLOADED, Location, SegmentMeta
from logstore.hot._tier import HotTier

__all__ = ["HotTier", "SegmentMeta", "Location", "OPEN", "SEALED", "UPLOADED", "EVICTED"]
