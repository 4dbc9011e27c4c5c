"""The ``file://`` backend: plain files under a local or shared directory.

Every write goes through a temporary file: write, fsync, rename (or hard link, for an exclusive
write), fsync of the directory. Temporaries are named ``.<base>.tmp-<pid>-<hex>`` and never
listed; ``abort_stale`` removes old ones.

Never: writes a name in place; reads an unlistable directory as an empty tier.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from logstore.cold._backend import Backend, SourceReader
from logstore.errors import ColdTierError, ColdTierUnavailableError, ObjectExistsError, StoreError

__all__ = ["FileBackend"]

logger = logging.getLogger(__name__)

_TMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-\d+-[0-9a-f]+$")
_NOT_FENCED_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})  # hard links refused

T = TypeVar("T")


class FileBackend(Backend):
    """file://: plain files under ``root``; atomic writes by temp file + fsync + rename + fsync dir."""

    def __init__(self, root: str, *, part_size: int) -> None:
        self.root = Path(root)
        self.part_size = part_size

    def _path(self, key: str) -> Path:
        return self.root / key

    def _what(self, op: str, key: str) -> str:
        return f"cold tier file://{self.root}: {op} {key!r}"

    def _makedirs(self, d: Path) -> None:
        # Create missing directories and fsync each parent, so a committed name survives power loss.
        missing = []
        p = d
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            try:
                m.mkdir()
            except FileExistsError:
                pass
            _fsync_dir(m.parent)

    def _write_atomic(self, key: str, write: Callable[[Any], T], *, exclusive: bool = False) -> tuple[T, str]:
        """Write through a temporary file, then rename it over ``key`` (``exclusive``: hard-link it
        to ``key``, which fails if ``key`` exists: :class:`ObjectExistsError`). Returns what ``write``
        returned and the file's tag."""
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            self._makedirs(path.parent)
            with open(tmp, "wb") as f:
                result = write(f)
                f.flush()
                os.fsync(f.fileno())
                tag = _file_tag(os.fstat(f.fileno()))
            if exclusive and not self._link(tmp, path):
                _unlink_quiet(tmp)
                raise ObjectExistsError(key)
            if exclusive:
                _unlink_quiet(tmp)
            else:
                os.replace(tmp, path)
            _fsync_dir(path.parent)
            return result, tag
        except OSError as e:
            _unlink_quiet(tmp)
            raise _local_error(e, self._what("write", key), key=key) from e
        except BaseException:
            _unlink_quiet(tmp)
            raise

    @staticmethod
    def _link(tmp: Path, path: Path) -> bool:
        """Hard-link ``tmp`` to ``path``: False if ``path`` exists. A filesystem without hard links
        gets a plain rename (not fenced: ``fenced_writes`` finds that out)."""
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NOT_FENCED_ERRNOS:
                raise
            os.replace(tmp, path)
            return True

    def put_stream(self, key: str, src: SourceReader) -> tuple[int, int, str | None]:
        def write(f: Any) -> tuple[int, int]:
            h = xxhash.xxh3_64()
            n = 0
            for i, chunk in enumerate(src.chunks(self.part_size), 1):
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
                if src.size > self.part_size:
                    f.flush()
                    self._after_part(key, i)
            return n, h.intdigest()

        (size, checksum), tag = self._write_atomic(key, write)
        return size, checksum, tag

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        self._write_atomic(key, lambda f: f.write(data), exclusive=exclusive)

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("read", key), key=key) from e

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("stat", key), key=key) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def stat(self, key: str) -> tuple[int, str | None] | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("stat", key), key=key) from e
        return (st.st_size, _file_tag(st)) if stat.S_ISREG(st.st_mode) else None

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                pos = max(size + start, 0) if start < 0 else start
                if pos >= size or length == 0:
                    return b""
                f.seek(pos)
                return f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("read", key), key=key) from e

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise _local_error(e, self._what("delete", key), key=key) from e
        try:
            _fsync_dir(path.parent)
        except OSError as e:
            raise _local_error(e, self._what("delete", key), key=key) from e

    def _walk(self, prefix: str) -> Iterator[tuple[Path, str, bool]]:
        """(path, key, is_temp) of every file under the directory that holds ``prefix``."""
        head = prefix.rpartition("/")[0]
        base = self.root / head if head else self.root

        def unreadable(
            e: OSError,
        ) -> None:  # os.walk would skip a directory it cannot list: an unreadable cold tier read as empty
            if not isinstance(e, FileNotFoundError):
                raise e

        try:
            for dirpath, dirnames, filenames in os.walk(base, onerror=unreadable):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel_dir = os.path.relpath(dirpath, self.root)
                for fn in filenames:
                    key = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                    if fn.startswith("."):
                        if _TMP_RE.match(fn):
                            yield Path(dirpath) / fn, key, True
                        continue
                    if key.startswith(prefix):
                        yield Path(dirpath) / fn, key, False
        except OSError as e:  # a directory that cannot be listed (onerror), stat and friends
            raise _local_error(e, self._what("list", prefix)) from e

    def list(self, prefix: str) -> dict[str, int]:
        return {k: size for k, (size, _) in self.list_modified(prefix).items()}

    def list_modified(self, prefix: str) -> dict[str, tuple[int, datetime]]:
        out = {}
        for path, key, is_temp in self._walk(prefix):
            if is_temp:
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted while listing
            except OSError as e:
                raise _local_error(e, self._what("list", prefix), key=key) from e
            out[key] = (st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))
        return out

    def modified(self, key: str) -> datetime | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _local_error(e, self._what("stat", key), key=key) from e
        return datetime.fromtimestamp(st.st_mtime, UTC) if stat.S_ISREG(st.st_mode) else None

    def abort_stale(self, prefix: str, cutoff: datetime) -> list[str]:
        out = []
        limit = cutoff.timestamp()
        for path, key, is_temp in self._walk(prefix):
            if not is_temp:
                continue
            m = _TMP_RE.match(path.name)
            assert m is not None
            target = key.rpartition("/")[0]
            target = f"{target}/{m['base']}" if target else m["base"]
            if not target.startswith(prefix):
                continue
            try:
                if path.stat().st_mtime > limit:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _local_error(e, self._what("remove stale temporary", key), key=key) from e
            logger.info("cold tier file://%s: removed stale upload temporary %s", self.root, key)
            out.append(target)
        return out

    def health(self) -> None:
        try:
            self._makedirs(self.root)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.root))
        except OSError as e:
            raise ColdTierUnavailableError(
                f"cold tier file://{self.root} is not usable: {e}",
                hint="mount / create the directory and make it writable",
            ) from e


_UNAVAILABLE_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.ESTALE,
        errno.ETIMEDOUT,
        errno.ENOTCONN,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.EAGAIN,
    }
)


def _local_error(e: OSError, what: str, *, key: str | None = None) -> StoreError:
    """An OSError of the file:// tier as the same errors the s3 tier raises.

    Full disk and a failing (network) filesystem -> ColdTierUnavailableError (retryable, the
    records stay hot); anything else (permissions, read-only filesystem...) -> ColdTierError.
    """
    if e.errno in _UNAVAILABLE_ERRNOS:
        return ColdTierUnavailableError(
            f"{what}: {e.strerror or e}", key=key, hint="free space on / repair the cold tier's filesystem; retry later"
        )
    return ColdTierError(f"{what}: {e.strerror or e}", key=key, hint="check the cold tier directory's permissions")


def _file_tag(st: os.stat_result) -> str:
    """A file's identity as a tag: another write of the name (a rename over it) is another inode.
    Not the mtime: damage in place keeps the file, and its checksums are what catch that."""
    return f"{st.st_dev}-{st.st_ino}"


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass
