"""Records of a run: a filtered, paginated listing; one record's metadata and tensor summary; the raw blob.

The raw blob is what a replay fetches, record after record: :class:`RawDownloads` answers the plain
case of it before FastAPI's routing (see there).
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from logstore import codec
from logstore.errors import CorruptRecordError
from logstore.keys import MAX_MICRO_BATCH, RecordKey
from logstore.segment import BlobStream
from server.auth import token_matches
from server.models import MAX_API_ITERATION, KindName, RecordDetail, RecordPage
from server.node import Node
from server.routers._common import (
    API_PREFIX,
    CHANNEL_PATTERN,
    KEY_PATTERN,
    RUN_PATTERN,
    RecordKeyPath,
    RunId,
    errors,
    get_node,
)
from server.settings import Settings

__all__ = ["build", "BLOB_HEADERS", "RAW_PATH", "RawDownloads"]

logger = logging.getLogger(__name__)

RAW_PATH = API_PREFIX + "/runs/{run}/records/{key:path}/raw"

BLOB_HEADERS = {
    "X-Swiftlog-Key": "the record key",
    "X-Swiftlog-Checksum": "xxh3-64 (hex) of the body: verify it before use",
    "X-Swiftlog-Raw-Checksum": "xxh3-64 (hex) of the decoded tensor's raw bytes",
    "X-Swiftlog-Dtype": "tensor dtype, e.g. bfloat16",
    "X-Swiftlog-Shape": "tensor shape, comma-separated (empty for a 0-d tensor)",
    "X-Swiftlog-Codec": "raw, zstd or planes",
    "X-Swiftlog-Raw-Length": "raw tensor bytes",
}


class _StreamResponse(Response):
    """A 200 whose body is a :class:`BlobStream`'s chunks, read and checked in the event loop as they
    are sent (a thread hop per chunk costs more than a page-cached read or a map's view).

    The checksum header goes out first; the stream hands out its last chunk only once the record
    matched, so a corrupt one ends short (the connection is closed under the client), never complete.
    Lighter than StreamingResponse: no task group, no disconnect listener; a client that went away
    makes the sends no-ops and the stream stops at its end. Never sends an error status.
    """

    def __init__(self, k: RecordKey, stream: BlobStream, h: codec.TensorHeader) -> None:
        csum = f"{stream.checksum:016x}"
        headers = {
            "X-Swiftlog-Key": str(k),
            "X-Swiftlog-Checksum": csum,
            "X-Swiftlog-Raw-Checksum": f"{h.checksum:016x}",
            "X-Swiftlog-Dtype": str(h.dtype).removeprefix("torch."),
            "X-Swiftlog-Shape": ",".join(str(d) for d in h.shape),
            "X-Swiftlog-Codec": h.codec,
            "X-Swiftlog-Raw-Length": str(h.raw_len),
            "ETag": f'"{csum}"',
            "Content-Length": str(stream.length),
        }
        super().__init__(media_type="application/octet-stream", headers=headers)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            for chunk in self.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except CorruptRecordError as e:
            logger.warning("download of %s cut short: %s", self.stream.key, e)
        finally:
            self.stream.close()


def _open_here(node: Node, run: str, key: str) -> _StreamResponse | None:
    """The record's response when the run's store is open and this node's memory and disk alone can
    answer (``LogStore.open_local_blob``), else None. Runs in the event loop: the lookup costs less
    than a hop to a worker thread. Never opens a store or reaches the object store."""
    st = node.opened(run)
    if st is None:
        return None
    k = RecordKey.parse(key)
    stream = st.open_local_blob(k, node.stream_chunk_bytes)
    if stream is None:
        return None
    try:
        return _StreamResponse(k, stream, codec.read_header(stream.head, key=k, total_length=stream.length))
    except BaseException:  # a header longer than the first chunk, or a damaged one: the route sorts it out
        stream.close()
        raise


class RawDownloads:
    """ASGI middleware that answers ``GET {RAW_PATH}`` itself when nothing about it can go wrong, and
    passes every other request on. It sits inside every other middleware of the app: the Host and
    Origin checks, the body limit and the metrics see its requests as they see the route's.

    1. It answers only when the run id and the key match the route's own patterns and lengths, the
       token is there when reads need one (read as ``require_read`` reads it:
       :func:`server.auth.token_matches`), the run's store is open, and the record is in a local
       segment file (``LogStore.open_local_blob``).
    2. Anything else goes on to the route, which answers it the documented way: a bad id or key, no
       token or a wrong one, an unopened run, a record elsewhere or garbage, a damaged header, and
       every exception raised on the way.
    3. Its requests carry the route's label in /metrics.

    A replay fetches record after record, and FastAPI's routing, dependencies and validation, with
    a hop to a worker thread, weigh on each.

    Never: answers an error itself, or a request the route would not answer 200.
    """

    _PATH = re.compile(re.escape(API_PREFIX) + r"/runs/([^/]+)/records/(.+)/raw")
    #: what MetricsMiddleware reads of ``scope["route"]``: the route's label
    route = SimpleNamespace(path_format=RAW_PATH.replace("{key:path}", "{key}"))

    def __init__(self, app: ASGIApp, settings: Settings, node: Node) -> None:
        self.app, self.node, self.settings = app, node, settings
        self._run = re.compile(RUN_PATTERN)
        self._key = re.compile(KEY_PATTERN)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            response = self._plain(scope)
            if response is not None:
                scope["route"] = self.route
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _plain(self, scope: Scope) -> _StreamResponse | None:
        m = self._PATH.fullmatch(scope["path"])
        if m is None:
            return None
        run, key = m.groups()
        if len(run) > 128 or len(key) > 128 or not self._run.fullmatch(run) or not self._key.fullmatch(key):
            return None
        if self.settings.reads_need_token:
            given = next((v for n, v in scope["headers"] if n == b"authorization"), None)
            if given is None or not token_matches(self.settings, given.decode("latin-1")):
                return None
        try:
            return _open_here(self.node, run, key)
        except Exception:  # any error is the route's to answer
            return None


def build(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["records"])

    @router.get(
        "/runs/{run}/records",
        response_model=RecordPage,
        responses=errors(400, 404, 503),
        summary="List records (one page)",
    )
    async def list_records(
        run: RunId,
        channel: str | None = Query(None, pattern=CHANNEL_PATTERN, description="e.g. act_0_1, grad_2_1, input_0"),
        kind: KindName | None = Query(None),
        it_lo: int = Query(0, ge=0, le=MAX_API_ITERATION, description="first iteration (inclusive)"),
        it_hi: int | None = Query(None, ge=0, le=MAX_API_ITERATION, description="end iteration (exclusive)"),
        micro_batch: int | None = Query(None, ge=0, le=MAX_MICRO_BATCH),
        limit: int = Query(settings.default_page_size, ge=1, le=settings.max_page_size, description="page size"),
        cursor: str | None = Query(None, pattern=r"^[0-9a-f]{38}$", description="next_cursor of the previous page"),
        node: Node = Depends(get_node),
    ) -> RecordPage:
        return await run_in_threadpool(
            node.records,
            run,
            channel=channel,
            kind=kind,
            it_lo=it_lo,
            it_hi=it_hi,
            micro_batch=micro_batch,
            limit=limit,
            cursor=cursor,
        )

    # declared before /records/{key} so that ".../raw" is not read as part of a key
    @router.get(
        RAW_PATH.removeprefix(API_PREFIX),
        response_class=Response,
        responses={
            200: {
                "description": "exactly the encoded record (a logstore.codec blob), "
                "verified against its stored checksum",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                "headers": {h: {"description": d, "schema": {"type": "string"}} for h, d in BLOB_HEADERS.items()},
            },
            **errors(400, 404, 409, 502, 503),
        },
        summary="Download one record's encoded blob",
    )
    async def record_raw(run: RunId, key: RecordKeyPath, node: Node = Depends(get_node)) -> Response:
        k, stream, h = await run_in_threadpool(node.blob_stream, run, key)
        return _StreamResponse(k, stream, h)

    @router.get(
        "/runs/{run}/records/{key:path}",
        response_model=RecordDetail,
        responses=errors(400, 404, 409, 502, 503),
        summary="One record's metadata and tensor summary",
    )
    async def record_detail(
        run: RunId,
        key: RecordKeyPath,
        stats: bool = Query(True, description="decode the tensor and compute min/max/mean/norm"),
        node: Node = Depends(get_node),
    ) -> RecordDetail:
        return await run_in_threadpool(node.record, run, key, with_stats=stats)

    return router
