"""The ``s3://`` backend: objects under a bucket and prefix through s3fs's aiobotocore client.

Requests that fail transiently are retried a bounded number of times, never past ``timeout_s``;
every botocore / aiohttp error is classified (:func:`_classify`) and translated into
:mod:`logstore.errors`. One aiobotocore session is shared by the process's tiers, and a forked
child builds its own client without touching the parent's.

Never: waits without a bound; closes or reuses a client inherited from a parent process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import xxhash

from logstore.cold._backend import Backend, SourceReader
from logstore.errors import (
    ColdTierError,
    ColdTierUnavailableError,
    ObjectExistsError,
    RecordNotFoundError,
    StoreError,
)

__all__ = ["S3Backend"]

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000
_MARKER_READ_CONCURRENCY = 16

T = TypeVar("T")


def _utc(t: datetime) -> datetime:
    """``t`` with a time zone (S3 clients give UTC; a naive value is taken as UTC)."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
        "OperationAborted",
        "XAmzContentSHA256Mismatch",
        "BadDigest",
        "ConditionalRequestConflict",  # two conditional writes of one key at once: retried, then one of them fails
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})


def _classify(e: BaseException) -> str:
    """'missing', 'transient' or 'fatal' for an exception raised by an aiobotocore call."""
    from botocore import exceptions as bx
    from botocore.parsers import ResponseParserError  # throttling replies with invalid XML (s3fs #484)

    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {}) or {}
        code = str(err.get("Code", ""))
        status = (e.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") or 0
        if code in _MISSING_CODES or (status == 404 and code != "NoSuchBucket"):
            return "missing"
        if code == "PreconditionFailed" or status == 412:
            return "exists"  # a conditional write (If-None-Match: *) found the key taken
        if code in _TRANSIENT_CODES or status >= 500 or status in (408, 429):
            return "transient"
        return "fatal"
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.ParamValidationError)):
        return "fatal"
    if isinstance(
        e,
        (
            bx.EndpointConnectionError,
            bx.ConnectionClosedError,
            bx.HTTPClientError,
            bx.ConnectTimeoutError,
            bx.ReadTimeoutError,
            bx.ResponseStreamingError,
            bx.IncompleteReadError,
            ResponseParserError,
        ),
    ):
        return "transient"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return "transient"
    try:
        import aiohttp

        if isinstance(e, aiohttp.ClientError):
            return "transient"
    except ImportError:  # pragma: no cover - s3fs depends on aiohttp
        pass
    if isinstance(e, OSError):
        return "transient"
    if isinstance(e, bx.BotoCoreError):
        return "fatal"
    return "bug"


_session: list[Any] = [None, -1]  # [AioSession, pid]
_session_lock = threading.Lock()


def _shared_session() -> Any:
    """One aiobotocore session per process for every cold tier: each client still gets its own
    endpoint and credentials, but the service models are loaded once (~0.2 s of CPU per tier)."""
    with _session_lock:
        if _session[0] is None or _session[1] != os.getpid():
            import aiobotocore.session

            _session[0], _session[1] = aiobotocore.session.AioSession(), os.getpid()
        return _session[0]


# Fork safety. The parent's event loop (fsspec's IO loop) and its pooled aiohttp connections are
# copied into a forked child and share the kernel's epoll instance, self-pipe and sockets with the
# parent. Whatever the child does through them hits the parent: closing a pooled connection (aiohttp
# does so when a connector is garbage-collected) runs epoll_ctl(DEL) on the PARENT's epoll, whose
# next request on that connection then waits for its read timeout (seen with SeaweedFS keep-alive
# connections); loop.close() would even unregister the parent's self-pipe and wedge its loop. So in
# the child we only mark our copy of every loop a cold tier used as closed (no system call at all):
# asyncio's and aiohttp's clean-up paths then return early. The parent's clients are also kept
# referenced so that nothing of theirs is finalized while the child runs.
_loops_in_use: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_inherited_clients: list[Any] = []


def _after_fork_in_child() -> None:
    global _session_lock
    _session_lock = threading.Lock()  # a parent thread may have held it at fork() time
    for loop in list(_loops_in_use):
        try:
            loop._thread_id = None  # type: ignore[attr-defined]  # its thread did not survive fork()
            loop._closed = True  # type: ignore[attr-defined]  # NOT loop.close(): see above
        except Exception:  # noqa: BLE001 - never fail a fork
            pass
    _loops_in_use.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class S3Backend(Backend):
    """s3://: objects under ``bucket``/``prefix`` through s3fs's aiobotocore client."""

    def __init__(
        self,
        url: str,
        bucket: str,
        prefix: str,
        storage_options: dict[str, Any],
        *,
        part_size: int,
        multipart_threshold: int,
        retries: int,
        timeout_s: float,
    ) -> None:
        self.url = url
        self.bucket = bucket
        self.root = prefix + "/" if prefix else ""
        self.part_size = part_size
        self.threshold = multipart_threshold
        self.retries = retries
        self.timeout_s = timeout_s
        opts = dict(storage_options)
        opts["skip_instance_cache"] = True
        opts["use_listings_cache"] = False
        config = {
            "connect_timeout": min(2.0, timeout_s),  # a dead endpoint fails in seconds, not minutes
            "read_timeout": timeout_s,
            "retries": {"total_max_attempts": 1, "mode": "standard"},
        }
        config.update(opts.get("config_kwargs") or {})
        opts["config_kwargs"] = config
        client_kwargs = dict(opts.get("client_kwargs") or {})
        if not opts.get("region_name") and not client_kwargs.get("region_name"):
            client_kwargs["region_name"] = "us-east-1"
        opts["client_kwargs"] = client_kwargs
        self.endpoint = client_kwargs.get("endpoint_url") or opts.get("endpoint_url") or "AWS S3"
        self._opts = opts
        self._fs: Any = None
        self._pid = -1
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------
    def _get_fs(self) -> Any:
        # s3fs instances are bound to the event loop of the process that made them; a forked
        # child makes its own (and must not close the parent's).
        if self._pid != os.getpid():
            # A lock some parent thread held at fork() time would never be released in this child.
            self._lock = threading.Lock()
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                import s3fs

                if self._fs is not None:
                    _inherited_clients.append(self._fs)  # a parent's client: never close it here
                opts = dict(self._opts)
                if "session" not in opts and "profile" not in opts:
                    opts["session"] = _shared_session()
                fs = s3fs.S3FileSystem(**opts)
                fs.retries = 1  # s3fs's own retry loop off: _call retries with our classification
                _loops_in_use.add(fs.loop)
                self._fs, self._pid = fs, os.getpid()
            return self._fs

    def _key(self, key: str) -> str:
        return self.root + key

    def _rel(self, full: str) -> str:
        return full[len(self.root) :]

    def _run(self, coro_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        from fsspec.asyn import sync

        fs = self._get_fs()
        return sync(fs.loop, coro_fn, fs, *args)

    async def _call(self, fs: Any, op: str, key: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``fn(client)`` with bounded retries of transient failures; translate errors."""
        try:
            client = await fs.set_session()  # no network I/O: builds the client once per process
        except Exception as e:  # noqa: BLE001 - a configuration the client library refuses
            raise ColdTierError(
                f"cannot create an S3 client for {self.url}: {type(e).__name__}: {e}",
                key=key or None,
                hint="check the cold tier storage options",
            ) from e
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        delay = 0.05
        attempt = 0
        while True:
            try:
                return await fn(client)
            except Exception as e:  # noqa: BLE001 - classified and re-raised below
                kind = _classify(e)
                if kind == "transient" and attempt < self.retries and loop.time() + delay < deadline:
                    attempt += 1
                    logger.debug("cold %s %s: transient %r, retry %d in %.2fs", op, key, e, attempt, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise self._translate(e, kind, op, key, attempt + 1) from e

    def _translate(self, e: BaseException, kind: str, op: str, key: str, attempts: int) -> BaseException:
        where = f"{self.url} (endpoint {self.endpoint})"
        op = f"{op} {key!r}" if key else op
        if kind == "exists":
            return ObjectExistsError(key)
        if kind == "missing":
            return RecordNotFoundError(f"{op}: not found in {where}", key=key)
        if kind == "transient":
            return ColdTierUnavailableError(
                f"{op} on {where} failed after {attempts} attempt(s): {type(e).__name__}: {e}",
                key=key,
                hint="the object store is unreachable or failing; retry later (records stay in the hot tier)",
            )
        if kind == "fatal":
            return ColdTierError(
                f"{op} refused by {where}: {type(e).__name__}: {e}",
                key=key,
                hint="check the bucket, credentials and permissions in the cold tier storage options",
            )
        return StoreError(f"{op} on {where}: unexpected {type(e).__name__}: {e}", key=key)

    # -- operations -----------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        self._put_object(key, data, exclusive)

    def _put_object(self, key: str, data: bytes, exclusive: bool = False) -> str | None:
        """One PUT; its ETag. ``exclusive``: If-None-Match: * (:class:`ObjectExistsError` when refused, also when
        the refusal reaches us as another error, e.g. a connection closed, and the key is taken)."""
        full = self._key(key)
        kw: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}

        async def go(fs: Any) -> str | None:
            r = await self._call(fs, "put", key, lambda c: c.put_object(Bucket=self.bucket, Key=full, Body=data, **kw))
            return r.get("ETag")

        try:
            return self._run(go)
        except StoreError:
            if exclusive and self.stat(key) is not None:
                raise ObjectExistsError(key) from None
            raise

    def put_stream(self, key: str, src: SourceReader) -> tuple[int, int, str | None]:
        if src.size <= self.threshold:
            h = xxhash.xxh3_64()
            data = b"".join(bytes(c) for c in src.chunks(max(src.size, 1)))
            h.update(data)
            tag = self._put_object(key, data)
            return len(data), h.intdigest(), tag
        return self._put_multipart(key, src)

    def _put_multipart(self, key: str, src: SourceReader) -> tuple[int, int, str | None]:
        full = self._key(key)
        part_size = max(self.part_size, -(-src.size // MAX_PARTS))

        async def create(fs: Any) -> str:
            r = await self._call(
                fs, "create_multipart_upload", key, lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=full)
            )
            return r["UploadId"]

        async def upload(fs: Any, upload_id: str, number: int, body: bytes) -> str:
            r = await self._call(
                fs,
                f"upload_part {number}",
                key,
                lambda c: c.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body),
            )
            return r["ETag"]

        async def complete(fs: Any, upload_id: str, parts: list[dict[str, Any]]) -> str | None:
            r = await self._call(
                fs,
                "complete_multipart_upload",
                key,
                lambda c: c.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
            return r.get("ETag")

        async def abort(fs: Any, upload_id: str) -> None:
            client = await fs.set_session()
            await client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)

        upload_id = self._run(create)
        h = xxhash.xxh3_64()
        n = 0
        parts: list[dict[str, Any]] = []
        try:
            # Parts are read here, in the caller's thread, one at a time: memory stays at one part.
            for number, chunk in enumerate(src.chunks(part_size), 1):
                h.update(chunk)
                n += len(chunk)
                etag = self._run(upload, upload_id, number, bytes(chunk))
                parts.append({"ETag": etag, "PartNumber": number})
                self._after_part(key, number)
            tag = self._run(complete, upload_id, parts)
        except BaseException:
            try:
                self._run(abort, upload_id)
            except Exception as e:  # noqa: BLE001 - best effort; abort_stale_uploads reclaims it
                logger.warning("cold tier %s: could not abort upload %s of %s: %r", self.url, upload_id, key, e)
            raise
        return n, h.intdigest(), tag

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[key]

    def get_many(self, keys: list[str]) -> dict[str, bytes | None]:
        async def go(fs: Any) -> dict[str, bytes | None]:
            sem = asyncio.Semaphore(_MARKER_READ_CONCURRENCY)

            async def one(k: str) -> tuple[str, bytes | None]:
                async def fetch(c: Any) -> bytes:
                    r = await c.get_object(Bucket=self.bucket, Key=self._key(k))
                    async with r["Body"] as body:
                        return await body.read()

                async with sem:
                    try:
                        return k, await self._call(fs, "get", k, fetch)
                    except RecordNotFoundError:
                        return k, None

            return dict(await asyncio.gather(*(one(k) for k in keys)))

        return self._run(go) if keys else {}

    def size(self, key: str) -> int | None:
        st = self.stat(key)
        return None if st is None else st[0]

    def stat(self, key: str) -> tuple[int, str | None] | None:
        full = self._key(key)

        async def go(fs: Any) -> tuple[int, str | None] | None:
            try:
                r = await self._call(fs, "head", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
            except RecordNotFoundError:
                return None
            return int(r["ContentLength"]), r.get("ETag")

        return self._run(go)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        full = self._key(key)
        if length == 0:

            async def head(fs: Any) -> bytes | None:
                try:
                    await self._call(fs, "head", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
                except RecordNotFoundError:
                    return None
                return b""

            return self._run(head)
        rng = f"bytes={start}-{start + length - 1}" if start >= 0 else f"bytes={start}"

        async def fetch(c: Any) -> bytes:
            from botocore.exceptions import ClientError

            try:
                r = await c.get_object(Bucket=self.bucket, Key=full, Range=rng)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "InvalidRange":
                    return b""  # start at or past the end (or an empty object)
                raise
            async with r["Body"] as body:
                return await body.read()

        async def go(fs: Any) -> bytes | None:
            try:
                return await self._call(fs, "read_range", key, fetch)
            except RecordNotFoundError:
                return None

        data = self._run(go)
        if data is not None and start < 0:
            data = data[:length]  # a suffix range returns up to -start bytes
        return data

    def delete(self, key: str) -> None:
        full = self._key(key)

        async def go(fs: Any) -> None:
            try:
                await self._call(fs, "delete", key, lambda c: c.delete_object(Bucket=self.bucket, Key=full))
            except RecordNotFoundError:
                pass

        self._run(go)

    def list(self, prefix: str) -> dict[str, int]:
        return {k: size for k, (size, _) in self.list_modified(prefix).items()}

    def modified(self, key: str) -> datetime | None:
        full = self._key(key)

        async def go(fs: Any) -> datetime | None:
            try:
                r = await self._call(fs, "head", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
            except RecordNotFoundError:
                return None
            return _utc(r["LastModified"])

        return self._run(go)

    def list_modified(self, prefix: str) -> dict[str, tuple[int, datetime]]:
        full = self._key(prefix)

        async def go(fs: Any) -> dict[str, tuple[int, datetime]]:
            out: dict[str, tuple[int, datetime]] = {}
            token = None
            while True:
                kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
                if token:
                    kw["ContinuationToken"] = token
                page = await self._call(fs, "list", prefix, lambda c, kw=kw: c.list_objects_v2(**kw))
                for obj in page.get("Contents", []) or []:
                    k = obj["Key"]
                    if k.endswith("/"):
                        continue  # directory placeholders some servers keep
                    t = obj.get("LastModified")
                    t = _utc(t) if isinstance(t, datetime) else datetime.now(UTC)  # (left out: never stale)
                    out[self._rel(k)] = (int(obj.get("Size", 0)), t)
                if not page.get("IsTruncated"):
                    return out
                token = page.get("NextContinuationToken")
                if not token:
                    return out

        return self._run(go)

    def abort_stale(self, prefix: str, cutoff: datetime) -> list[str]:
        full = self._key(prefix)

        async def go(fs: Any) -> list[str]:
            stale: list[tuple[str, str]] = []
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            while True:
                page = await self._call(fs, "list_multipart_uploads", prefix, lambda c: c.list_multipart_uploads(**kw))
                for up in page.get("Uploads", []) or []:
                    initiated = up.get("Initiated")
                    if isinstance(initiated, datetime):
                        if initiated.tzinfo is None:
                            initiated = initiated.replace(tzinfo=UTC)
                        if initiated > cutoff:
                            continue
                    stale.append((up["Key"], up["UploadId"]))  # initiated before the cutoff
                if not page.get("IsTruncated"):
                    break
                kw["KeyMarker"] = page.get("NextKeyMarker")
                kw["UploadIdMarker"] = page.get("NextUploadIdMarker")
                if not kw["KeyMarker"]:
                    break
            out = []
            for k, uid in stale:
                rel = self._rel(k)
                try:
                    if await self._last_part_time(fs, k, uid, rel) > cutoff:
                        continue  # parts still arriving: a long upload, not an abandoned one
                    await self._call(
                        fs,
                        "abort_multipart_upload",
                        rel,
                        lambda c, k=k, uid=uid: c.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=uid),
                    )
                except RecordNotFoundError:
                    continue  # completed or aborted meanwhile
                logger.info("cold tier %s: aborted stale multipart upload %s of %s", self.url, uid, rel)
                out.append(rel)
            return out

        return self._run(go)

    async def _last_part_time(self, fs: Any, full: str, upload_id: str, rel: str) -> datetime:
        """When the upload last received a part (datetime.min if none)."""
        latest = datetime.min.replace(tzinfo=UTC)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id}
        while True:
            page = await self._call(fs, "list_parts", rel, lambda c, kw=kw: c.list_parts(**kw))
            for part in page.get("Parts", []) or []:
                t = part.get("LastModified")
                if isinstance(t, datetime):
                    latest = max(latest, t if t.tzinfo else t.replace(tzinfo=UTC))
            marker = page.get("NextPartNumberMarker")
            if not page.get("IsTruncated") or not marker:
                return latest
            kw["PartNumberMarker"] = marker

    def health(self) -> None:
        async def go(fs: Any) -> None:
            try:
                await self._call(fs, "head_bucket", "", lambda c: c.head_bucket(Bucket=self.bucket))
            except RecordNotFoundError as e:
                raise ColdTierError(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint}",
                    hint="create the bucket or fix the cold tier url",
                ) from e

        self._run(go)

    def close(self) -> None:
        with self._lock:
            fs, self._fs = self._fs, None
            if fs is None or self._pid != os.getpid():
                return
        creator = getattr(fs, "_s3creator", None)
        if creator is not None and getattr(fs, "_s3", None) is not None:
            try:
                type(fs).close_session(fs.loop, creator)
            except Exception as e:  # noqa: BLE001 - closing is best effort
                logger.debug("cold tier %s: closing the s3 session failed: %r", self.url, e)
