"""The admin server's HTTP layer under hostile clients: what one connection may make the server hold.

Each test runs ``swiftlog serve`` in a real process and talks to it over raw loopback sockets, so
that nothing normalises what is sent. Memory is read from the server's /proc entry.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from server.testing import TOKEN, ServerProcess

MiB = 2**20


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no {field}")


class _PeakRss:
    """The peak resident memory of a process from now on: VmHWM after resetting it (``clear_refs``),
    or, where the reset is not allowed, the largest VmRSS seen by a sampling thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start_kib = _status_kib(pid, "VmRSS")
        self._samples = [self.start_kib]
        self._stop = threading.Event()
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            self._hwm = True
        except OSError:
            self._hwm = False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            try:
                self._samples.append(_status_kib(self.pid, "VmRSS"))
            except (OSError, AssertionError):
                return

    def growth_bytes(self) -> int:
        self._stop.set()
        self._thread.join()
        peak = max(self._samples)
        if self._hwm:
            peak = max(peak, _status_kib(self.pid, "VmHWM"))
        return (peak - self.start_kib) * 1024


def _read_response(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def test_a_huge_header_block_is_refused_without_being_held(tmp_path: Path) -> None:
    """300,000 headers of 1 KB before any authentication (the attack of issue 22, H1): the server
    refuses the request early, and its resident memory grows by at most 20 MB."""
    root = tmp_path / "node"
    root.mkdir()
    header = b"X-Pad: " + b"a" * 1016 + b"\r\n"  # 1 KiB a line
    batch = header * 1000  # 1,000 headers a send
    with ServerProcess(root, token=TOKEN) as srv:
        peak = _PeakRss(srv.proc.pid)
        sent = 0
        with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
            try:
                s.sendall(b"POST /v1/runs/run-a/flush HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                for _ in range(300):
                    s.sendall(batch)
                    sent += len(batch)
                s.sendall(b"Content-Length: 0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server closed the connection while the headers were still coming
            response = _read_response(s)
        growth = peak.growth_bytes()
        assert growth <= 20 * MiB, f"server RSS grew by {growth / MiB:.0f} MiB"
        assert response.startswith(b"HTTP/1.1 431 "), (sent, response[:300])
        assert b'"code":"request_header_fields_too_large"' in response.replace(b" ", b"")
        assert sent < 300 * len(batch), "the whole header block was read"


def _request(port: int, raw: bytes, timeout: float = 60) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        return _read_response(s)


def test_the_head_bound_is_exact_for_a_head_sent_at_once(tmp_path: Path) -> None:
    """A head a little under ``--max-header-bytes`` is served; one a little over is a 431, also
    when it arrives in one piece with its end."""
    root = tmp_path / "node"
    root.mkdir()
    with ServerProcess(root, args=["--max-header-bytes", "4096"]) as srv:

        def head(pad: int) -> bytes:
            return (
                b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"p" * pad + b"\r\nConnection: close\r\n\r\n"
            )

        assert _request(srv.port, head(3800)).startswith(b"HTTP/1.1 200 ")
        assert _request(srv.port, head(4200)).startswith(b"HTTP/1.1 431 ")


@pytest.mark.slow
def test_a_request_must_arrive_within_the_read_timeout(tmp_path: Path) -> None:
    """A head trickled in a byte at a time, a body that stops short, and a connection that sends
    nothing are each closed at the read deadline (408 where a request had begun)."""
    root = tmp_path / "node"
    root.mkdir()
    with ServerProcess(root, args=["--request-read-timeout", "1"]) as srv:
        head = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"p" * 400 + b"\r\nConnection: close\r\n\r\n"
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.settimeout(0.05)
            sent = 0
            for b in head:  # on a server without a deadline, the whole head arrives (20 s) and is answered 200
                try:
                    s.sendall(bytes([b]))
                    sent += 1
                    if s.recv(1, socket.MSG_PEEK):
                        break  # the server answered
                except TimeoutError:
                    continue
                except OSError:
                    break
            s.settimeout(30)
            response = _read_response(s)
        assert response.startswith(b"HTTP/1.1 408 "), (sent, response[:200])
        assert sent < len(head)
        # a body that stops short: the app waits for it, the deadline ends the wait
        short = (
            b"POST /v1/runs/run-a/gc HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 40\r\n\r\n{}"
        )
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(short)
            assert _read_response(s).startswith(b"HTTP/1.1 408 ")
        # a connection that never sends anything is closed without an answer
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            assert _read_response(s) == b""
        assert "Traceback" not in srv.log()


def test_connections_beyond_the_bound_are_refused_at_once(tmp_path: Path) -> None:
    root = tmp_path / "node"
    root.mkdir()
    with ServerProcess(root, args=["--max-connections", "4"]) as srv:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(4)]
        try:
            for s in held:  # each is served, and stays open (keep-alive)
                s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as extra:
                response = _read_response(
                    extra
                )  # answered without being asked: on a server without the bound, a timeout
            assert response.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in response
            assert b"retry-after: 5" in response.lower()
        finally:
            for s in held:
                s.close()
        # once they are gone, new connections are served again (the server notices the closes soon)
        for _ in range(200):
            response = _request(srv.port, b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            if response.startswith(b"HTTP/1.1 200 "):
                break
        assert response.startswith(b"HTTP/1.1 200 "), response[:200]
