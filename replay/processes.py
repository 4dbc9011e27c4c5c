"""Process plumbing of a scheduler on one machine: a store host, a fork server, process handles.

A scheduler (:mod:`replay.launcher`, the example ``trainer_client.examples.launch``) hosts the
TCPStore outside the training ranks and starts every rank as a real, separate process:

- :class:`StoreHost`: a TCPStore server owned by this process (127.0.0.1 unless told otherwise);
- :func:`forkserver_context`: a multiprocessing fork server that imported torch (and whatever
  else the children need) once, so a child starts in milliseconds;
- :func:`start_process`: a child of that fork server, started without re-running the parent's
  ``__main__`` (:func:`main_module_hidden`), as a :class:`ProcessHandle`;
- :func:`run_module_main`: the body of such a child: output to a log file, then a module's
  ``main(argv)``;
- :func:`stop_all`: kill what still runs, reap everything.

Children find the packages the way the parent did: the fork server's children get the parent's
``sys.path``, and an installed package needs nothing more.

Never: leaves a process running (``stop_all`` kills and reaps); listens on another address than
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from trainer_client.commit import bound_store, gloo_on_loopback

__all__ = [
    "ProcessHandle",
    "StoreHost",
    "forkserver_context",
    "main_module_hidden",
    "run_module_main",
    "start_process",
    "stop_all",
]


class StoreHost:
    """A TCPStore server owned by this process, listening on ``host``:``port`` only (default
    127.0.0.1 and a free port; torch's own server listens on every interface)."""

    def __init__(
        self,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.store = bound_store(host, port, timeout)
        self.port: int = self.store.port


class ProcessHandle:
    """The subset of ``subprocess.Popen`` a scheduler uses (poll, kill, wait), over a
    ``multiprocessing.Process``."""

    def __init__(self, proc: Any) -> None:
        self._p = proc

    def poll(self) -> int | None:
        return None if self._p.is_alive() else self._p.exitcode

    def kill(self) -> None:
        self._p.kill()

    def wait(self) -> int:
        self._p.join()
        return self._p.exitcode

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    @property
    def sentinel(self) -> int:
        """A handle that becomes ready when the process ends (``multiprocessing.connection.wait``)."""
        return self._p.sentinel


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start processes inside this block so that they do not re-run the parent's ``__main__``.

    A multiprocessing child (spawn or forkserver) re-executes the parent's main script before
    running its target (CPython 3.11's fork server never preloads it), so a process started from
    the ``swiftlog`` CLI paid the CLI's imports before its first line. Stage and replacement
    targets live in importable modules and never need the parent's ``__main__``, so it is hidden
    (an empty module) while ``Process.start()`` collects the child's preparation data.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def forkserver_context(preload: Sequence[str]) -> Any:
    """The multiprocessing fork server context, with ``preload`` imported by the server before it
    forks anything (a list that applies when the server starts: on first use, kept for the life
    of this process). A module of ``preload`` that does not import is skipped by the server."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def start_process(ctx: Any, target: Callable[..., Any], args: Sequence[Any], name: str) -> ProcessHandle:
    """Start ``target(*args)`` as a child of ``ctx`` (e.g. :func:`forkserver_context`), without the
    parent's ``__main__``."""
    p = ctx.Process(target=target, args=tuple(args), name=name)
    with main_module_hidden():
        p.start()
    return ProcessHandle(p)


def run_module_main(argv: list[str], log_path: str, module: str, env: Mapping[str, str] | None = None) -> None:
    """Body of a child process: its output to ``log_path``, ``env`` into its environment, gloo on
    the loopback interface, then ``module.main(argv)``; exits with its return code (1 and the
    traceback in the log when it raised)."""
    import traceback

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env or {})
    gloo_on_loopback()  # the scheduler's processes run on this host
    try:
        rc = importlib.import_module(module).main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    except BaseException:  # noqa: BLE001 - report anything, exit non-zero
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def stop_all(procs: Iterable[Any]) -> None:
    """SIGKILL every process of ``procs`` still running, then reap them all (``subprocess.Popen`` or
    :class:`ProcessHandle`: both expose poll/kill/wait)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
