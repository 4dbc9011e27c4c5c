"""Records of a run: a filtered, paginated listing; one record's metadata and tensor summary; the raw blob."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from logstore.keys import MAX_MICRO_BATCH
from logstore.segment import BlobStream
from server.models import MAX_API_ITERATION, KindName, RecordDetail, RecordPage
from server.node import Node
from server.routers._common import API_PREFIX, CHANNEL_PATTERN, RecordKeyPath, RunId, errors, get_node
from server.settings import Settings

__all__ = ["build", "BLOB_HEADERS"]

BLOB_HEADERS = {
    "X-Swiftlog-Key": "the record key",
    "X-Swiftlog-Checksum": "xxh3-64 (hex) of the body: verify it before use",
    "X-Swiftlog-Raw-Checksum": "xxh3-64 (hex) of the decoded tensor's raw bytes",
    "X-Swiftlog-Dtype": "tensor dtype, e.g. bfloat16",
    "X-Swiftlog-Shape": "tensor shape, comma-separated (empty for a 0-d tensor)",
    "X-Swiftlog-Codec": "raw, zstd or planes",
    "X-Swiftlog-Raw-Length": "raw tensor bytes",
}


async def _chunks(stream: BlobStream) -> AsyncIterator[bytes]:
    """The stream's chunks. The first was read on a worker thread (with the index lookup); the
    rest are read here, in the event loop: a page-cached 4 MiB pread + hash takes ~0.5 ms, and a
    thread hop per chunk measured 1.8x slower end to end (bench/api_bench.py)."""
    try:
        for chunk in stream:
            yield chunk
    finally:
        stream.close()


def build(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["records"])

    @router.get("/runs/{run}/records", response_model=RecordPage, responses=errors(), summary="List records (one page)")
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
        "/runs/{run}/records/{key:path}/raw",
        response_class=Response,
        responses={
            200: {
                "description": "exactly the encoded record (a logstore.codec blob), verified against its stored checksum",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                "headers": {h: {"description": d, "schema": {"type": "string"}} for h, d in BLOB_HEADERS.items()},
            },
            **errors(),
        },
        summary="Download one record's encoded blob",
    )
    async def record_raw(run: RunId, key: RecordKeyPath, node: Node = Depends(get_node)) -> Response:
        k, stream, h = await run_in_threadpool(node.blob_stream, run, key)
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
        }
        if stream.length <= len(stream.head):  # one chunk, already verified
            stream.close()
            return Response(content=stream.head, media_type="application/octet-stream", headers=headers)
        # sent while it is read: the checksum (from the index) goes out first; the stream holds
        # back the last chunk until the bytes match it, so a corrupt record ends the response
        # short (the client sees a truncated body), never complete
        headers["Content-Length"] = str(stream.length)
        return StreamingResponse(_chunks(stream), media_type="application/octet-stream", headers=headers)

    @router.get(
        "/runs/{run}/records/{key:path}",
        response_model=RecordDetail,
        responses=errors(),
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
