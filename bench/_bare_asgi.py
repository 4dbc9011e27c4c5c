"""The ceiling of record downloads over HTTP from Python here: a bare ASGI app under the uvicorn
configuration ``swiftlog serve`` ships (``server.serve.uvicorn_config``: event loop, HTTP protocol
and its limits) that serves blobs already in its memory, in 4 MiB writes, and does nothing else
(no index lookup, no read, no checksum).

Used by bench/api_bench.py: ``python bench/_bare_asgi.py PORT BLOBS.json`` where BLOBS.json lists
``[path, offset, length]`` triples; GET /{i} returns blob i.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.serve import uvicorn_config  # noqa: E402
from server.settings import Settings  # noqa: E402

CHUNK = 4 << 20


def main() -> None:
    port, spec = int(sys.argv[1]), sys.argv[2]
    blobs = []
    for path, offset, length in json.loads(open(spec).read()):
        fd = os.open(path, os.O_RDONLY)
        try:
            blobs.append(os.pread(fd, length, offset))
        finally:
            os.close(fd)

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        body = memoryview(blobs[int(scope["path"].strip("/"))])
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
        )
        for off in range(0, len(body), CHUNK):
            await send(
                {"type": "http.response.body", "body": body[off : off + CHUNK], "more_body": off + CHUNK < len(body)}
            )

    settings = Settings.build(root=Path(spec).parent, port=port, log_level="warning")
    uvicorn.Server(uvicorn_config(app, settings)).run()


if __name__ == "__main__":
    main()
