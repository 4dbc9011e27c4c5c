"""The cold tier: immutable segments and small JSON documents in object storage.

One class, :class:`ColdTier`, with the same contract over two backends:

- ``file:///abs/dir`` (or a plain directory path): the embedded default, a local or shared
  filesystem; every write is temp file + fsync + rename + fsync of the directory.
- ``s3://bucket/prefix``: any S3-compatible server through s3fs's aiobotocore client
  (``storage_options`` go to ``s3fs.S3FileSystem``: ``key``, ``secret``,
  ``client_kwargs={"endpoint_url": ..., "region_name": ...}``, ``config_kwargs``...).

Layout under the tier root (names are caller-chosen ``/``-separated paths, every component a
:func:`logstore.keys.validate_name` name)::

    <name>                      a segment's bytes; immutable once committed
    <name>.commit               its commit marker, written LAST and only if none exists: JSON
                                {v, size, checksum (xxh3-64 of the bytes, as
                                logstore.segment.blob_checksum), algo, created, meta, tag (the
                                object as the store reported it: ETag on s3, device and inode
                                on file://)}
    _docs/<name>                small JSON documents (checkpoint registry, gaps)
    .<base>.tmp-<pid>-<hex>     file:// temporaries, never listed (abort_stale_uploads removes them)

What is promised:

- A segment is visible to :meth:`ColdTier.list_segments` only once its marker exists, and the
  marker is written only after the whole object is stored, so the listing is the index: a store
  rebuilds its state after a crash from one listing plus marker reads (no HEAD per object).
- No partial object is ever visible under a segment name (file: rename; s3: one PUT or a
  completed multipart upload). A crash mid-upload leaves at most an uncommitted object or an
  in-progress multipart upload / temp file, which a re-put overwrites and
  :meth:`ColdTier.abort_stale_uploads` reclaims (:meth:`ColdTier.remove_uncommitted` the objects).
- ``put_segment`` is idempotent: re-putting identical bytes under a committed name is a no-op.
- Of two uploaders of one name with different bytes (a stage thought dead and its replacement),
  at most one commits: the marker is written conditionally (``If-None-Match: *`` on s3, a hard
  link on file://) and both marker and object are read back. An object replaced after its
  commit is caught by :meth:`ColdTier.confirm_segment`, which says whether a committed copy is
  exactly given bytes (a writer drops its own copy only then); a re-put of the committed bytes
  repairs it.
  :meth:`ColdTier.fenced_writes` probes whether the store refuses a second conditional write
  (some S3-compatible stores ignore the header).
- Deletes remove the marker first, then the object; not-found counts as success.
- Backend errors are translated at this boundary (``raise ... from e``): unreachable / timeouts
  / 5xx / throttling -> :class:`ColdTierUnavailableError` (retryable, after a bounded number of
  short retries), refusals (403, 400, missing bucket...) -> :class:`ColdTierError`, a missing
  object -> :class:`RecordNotFoundError`. No call waits without a bound: connect and read
  timeouts are set on the client and retries stop at ``timeout_s``.
- Safe to share between threads, and usable after ``fork()`` (the s3fs client is re-created per
  process).

What is never done: reading or writing outside the tier root, listing an uncommitted segment,
rewriting a committed marker for other bytes, writing over a committed object with other bytes
once its marker was seen (two uploaders that both saw none race; the loser fails, and the
winner's :meth:`ColdTier.confirm_segment` says so if the loser's object landed last), loading a
whole source file into memory for a multipart upload, and (for ``read``) checking the marker
unless ``verify=True``.

Modules: ``_tier`` (:class:`ColdTier`, the contract), ``_backend`` (what a backend must do),
``_file`` and ``_s3`` (the two backends), ``_names`` (names and URLs).
"""

from logstore.cold._backend import Source
from logstore.cold._names import DOCS_PREFIX, MARKER_SUFFIX, parse_cold_url
from logstore.cold._tier import MIN_PART_SIZE, ColdTier, SegmentInfo

__all__ = ["ColdTier", "SegmentInfo", "Source", "parse_cold_url", "MARKER_SUFFIX", "DOCS_PREFIX", "MIN_PART_SIZE"]
