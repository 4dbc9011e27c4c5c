"""HTTP clients of the admin API reopen a keep-alive connection the server closed while it was idle.

uvicorn closes a connection idle past its keep-alive timeout (5 s). A client that sends its next
request on it races that close: bench/api_bench.py failed twice with ``RemoteDisconnected``, and
``HttpRecordSource`` spent one of its attempts (or, with ``retries=1``, failed) on it.
"""

from __future__ import annotations

import importlib.util
import select
import socket
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch

from logstore import codec
from logstore.keys import Channel, RecordKey
from logstore.segment import blob_checksum
from replay.remote import HttpRecordSource
from server.testing import REPO_ROOT, ServerProcess


def _api_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_bench", REPO_ROOT / "bench" / "api_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _ClosingServer:
    """A loopback HTTP server that answers the first request of a connection with keep-alive, and
    closes the connection when the next one arrives, without an answer: the moment a server's
    keep-alive timer fires just as the client reuses the connection."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.recv(65536)
                head = (
                    f"HTTP/1.1 200 OK\r\nContent-Length: {len(self.blob)}\r\nContent-Type: application/octet-stream\r\n"
                    f"X-Swiftlog-Checksum: {blob_checksum(self.blob):016x}\r\n\r\n"
                )
                conn.sendall(head.encode() + self.blob)
                conn.recv(65536)  # the next request: closed unanswered

    def close(self) -> None:
        self.sock.close()


def test_the_record_source_reopens_a_connection_closed_as_it_was_reused() -> None:
    t = torch.arange(12, dtype=torch.float32)
    blob = codec.encode_tensor(t)
    srv = _ClosingServer(blob)
    key = RecordKey(Channel.activation(0), 0, 0)
    try:
        with HttpRecordSource(f"http://127.0.0.1:{srv.port}", "run-a", retries=1) as src:
            assert torch.equal(src.get(key), t)
            assert torch.equal(src.get(key), t)  # reused, closed unanswered, reopened: no attempt spent
            assert srv.connections == 2
    finally:
        srv.close()


def test_the_bench_client_reopens_a_connection_closed_as_it_was_reused() -> None:
    blob = b"x" * 1000
    srv = _ClosingServer(blob)
    conn = _api_bench().KeepAliveConnection("127.0.0.1", srv.port)
    try:
        assert conn.get("/a")[::2] == (200, blob)
        assert conn.get("/a")[::2] == (200, blob)  # reused, closed unanswered, reopened once
        assert conn.reopened == 1 and srv.connections == 2
    finally:
        conn.close()
        srv.close()


@pytest.mark.slow
def test_the_bench_client_reopens_a_connection_uvicorn_closed_while_idle(tmp_path: Path) -> None:
    """The real server: uvicorn's keep-alive timeout closes an idle connection; the next GET on it
    goes out again on a new one (http.client alone raises RemoteDisconnected)."""
    root = tmp_path / "node"
    root.mkdir()
    with ServerProcess(root) as srv:
        conn = _api_bench().KeepAliveConnection("127.0.0.1", srv.port)
        try:
            status, _, body = conn.get("/v1/health")
            assert status == 200 and b'"status":"ok"' in body
            sock = conn._conn.sock
            readable, _, _ = select.select([sock], [], [], 60)
            assert readable and sock.recv(1, socket.MSG_PEEK) == b"", "the server did not close the idle connection"
            status, _, body = conn.get("/v1/health")
            assert status == 200 and b'"status":"ok"' in body
            assert conn.reopened == 1
        finally:
            conn.close()
