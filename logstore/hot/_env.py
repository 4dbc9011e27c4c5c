"""LMDB environments shared by the hot tiers of one process, and the lock around their map.

LMDB forbids opening one environment twice in a process: every hot tier of a path shares one
:class:`EnvHandle`, counted by reference (``open_env`` / ``release_env``), and a forked child
opens its own. :class:`RWLock` lets many transactions run at once, or one map resize alone.

Never: hands a parent's environment to a forked child; creates an index for a reader
(``create=False``); reads through the map past the end of a truncated file (a SIGBUS).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from logstore.errors import CorruptIndexError

__all__ = ["DAMAGED_HINT", "RWLock", "EnvHandle", "open_env", "release_env", "forget_env", "salvage_docs"]

DAMAGED_HINT = (
    "swiftlog verify lists it; what its writer uploaded is still read from the cold tier"  # a CorruptIndexError's
)


class RWLock:
    """Many readers or one exclusive holder; used so an LMDB map resize never races a transaction."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class EnvHandle:
    """One LMDB environment per process and path (LMDB forbids opening it twice in a process)."""

    def __init__(self, path: Path, sync: bool, map_size: int, create: bool = True) -> None:
        """``create=False`` (a reader of another writer's index): never creates the environment or
        its databases (a damaged or emptied index would be overwritten by a fresh one, and the
        evidence lost), and refuses one whose file is shorter than its last page: reading it
        through the memory map would kill the process (SIGBUS)."""
        self.path = path
        self.pid = os.getpid()
        if not create and not (path / "data.mdb").is_file():  # LMDB would create a fresh one in the directory
            raise CorruptIndexError(
                f"the LMDB index of {path.parent} is missing (no {path / 'data.mdb'}): its segment files are not "
                "readable until its writer reopens the store (it re-indexes them)"
            )
        self.env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=4,
            subdir=True,
            sync=sync,
            metasync=sync,
            readahead=False,
            max_readers=512,
            lock=True,
            writemap=False,
            create=create,
        )
        try:
            if (path / "data.mdb").is_file():  # a read through the map past the file's end is a SIGBUS
                size, need = (
                    os.path.getsize(path / "data.mdb"),
                    (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"],
                )
                if size < need:
                    raise CorruptIndexError(
                        f"the LMDB index of {path.parent} is truncated: {size} bytes, its pages need {need}",
                        hint=DAMAGED_HINT,
                    )
            # stale reader slots of dead processes would pin old pages forever
            self.env.reader_check()
            self.rw = RWLock()
            self.refs = 0
            self.db_rec = self.env.open_db(b"records", create=create)
            self.db_seg = self.env.open_db(b"segments", create=create)
            self.db_meta = self.env.open_db(b"meta", create=create)
        except BaseException:
            self.env.close()
            raise


_ENVS: dict[str, EnvHandle] = {}
_ENVS_LOCK = threading.Lock()


def open_env(path: Path, sync: bool, map_size: int, create: bool = True) -> EnvHandle:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        h = _ENVS.get(key)
        if h is None or h.pid != os.getpid():  # after fork, never reuse the parent's env
            h = EnvHandle(Path(key), sync, map_size, create)
            _ENVS[key] = h
        h.refs += 1
        return h


def release_env(h: EnvHandle) -> None:
    with _ENVS_LOCK:
        h.refs -= 1
        if h.refs <= 0 and h.pid == os.getpid():
            if _ENVS.get(str(h.path)) is h:
                del _ENVS[str(h.path)]
            h.env.close()


def forget_env(h: EnvHandle) -> None:
    """Release ``h`` and never hand it out again: its directory is being replaced (another holder
    in this process keeps it until it releases it)."""
    with _ENVS_LOCK:
        if _ENVS.get(str(h.path)) is h:
            del _ENVS[str(h.path)]
    release_env(h)


def salvage_docs(path: Path) -> dict[bytes, bytes]:
    """The documents (``doc/...`` entries: gaps, checkpoint registrations) still readable in the
    damaged index at ``path``, best effort: what a damaged page hides is left behind. Opens it
    read-only, and only when its file holds all its pages (reading past the end is a SIGBUS)."""
    out: dict[bytes, bytes] = {}
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, create=False, max_dbs=4, subdir=True, readahead=False)
    except lmdb.Error:
        return out
    try:
        if os.path.getsize(path / "data.mdb") < (env.info()["last_pgno"] + 1) * env.stat()["psize"]:
            return out
        db = env.open_db(b"meta", create=False)
        with env.begin(db=db) as txn:
            for k, v in txn.cursor():
                if k.startswith(b"doc/"):
                    k[4:].decode()
                    json.loads(v)
                    out[bytes(k)] = bytes(v)
    except (lmdb.Error, OSError, UnicodeDecodeError, ValueError):
        pass
    finally:
        env.close()
    return out
