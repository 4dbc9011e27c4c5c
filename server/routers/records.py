"""Records of a run: a filtered, paginated listing; one record's metadata and tensor summary; the raw blob."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from logstore.keys import MAX_MICRO_BATCH
from logstore.segment import blob_checksum
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


_STREAM_CHUNK = 1 << 20  # bytes per body write of a big blob


async def _slices(mv: memoryview) -> AsyncIterator[memoryview]:
    for off in range(0, len(mv), _STREAM_CHUNK):
        yield mv[off : off + _STREAM_CHUNK]


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
        return await run_in_threadpool(node.records, run, channel=channel, kind=kind, it_lo=it_lo, it_hi=it_hi,
                                       micro_batch=micro_batch, limit=limit, cursor=cursor)  # fmt: skip

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
        k, blob, h = await run_in_threadpool(node.blob, run, key)
        csum = f"{blob_checksum(blob):016x}"
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
        if len(blob) <= _STREAM_CHUNK:
            return Response(content=blob, media_type="application/octet-stream", headers=headers)
        # big blobs go out in slices: one huge write would make asyncio's transport buffer shuffle
        # the whole remainder after every partial send (quadratic copying on Python < 3.12)
        headers["Content-Length"] = str(len(blob))
        return StreamingResponse(_slices(memoryview(blob)), media_type="application/octet-stream", headers=headers)

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
