"""The same-host transport of exact parallel replay's gradient chain: running sums in shared memory.

Worker 0 creates a file in ``/dev/shm`` that every worker maps (:class:`SharedChain`); worker 0
writes its gradients there, each next worker adds its share in place, and only each bucket's small
"present" flags go over gloo, as the signal that the bucket is ready. Two buffers alternate by
iteration parity. Workers that cannot all map the file fall back to gloo, all of them.
``docs/parallel-replay.md`` ("Same host") says more.

Never: used unless every worker mapped the same file; leaves the file behind
(:func:`remove_stale_chains` removes one a killed worker 0 left).
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

__all__ = ["CHAIN_PREFIX", "PG_TIMEOUT", "SHM_DIR", "SharedChain", "remove_stale_chains"]

logger = logging.getLogger(__name__)

#: the rendezvous timeout of parallel replay (and of its collectives); a chain file older than it is stale
PG_TIMEOUT = datetime.timedelta(minutes=10)
SHM_DIR = "/dev/shm"
CHAIN_PREFIX = "swiftlog-chain-"


def remove_stale_chains(directory: str, older_than_s: float = PG_TIMEOUT.total_seconds()) -> list[str]:
    """Unlink shared-chain files in ``directory`` older than ``older_than_s`` (default: the
    rendezvous timeout); returns their names. Worker 0 unlinks its file as soon as every worker
    has mapped it, which happens within that timeout or never; a file older than it was left by a
    worker 0 killed in between (its memory is tmpfs RAM until unlinked). Never touches a younger
    file or anything not named like a chain."""
    gone = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(CHAIN_PREFIX)]
    except OSError:
        return gone
    now = time.time()
    for n in names:
        path = os.path.join(directory, n)
        try:
            if now - os.stat(path).st_mtime > older_than_s:
                os.unlink(path)
                gone.append(n)
        except OSError:  # gone already, or not ours to remove
            continue
    if gone:
        logger.info(
            "parallel replay: removed %d stale shared-chain file(s) from %s: %s",
            len(gone),
            directory,
            ", ".join(gone[:3]),
        )
    return gone


class SharedChain:
    """Same-host transport for the exact chain's running sums: two flat buffers per dtype (one per
    iteration parity) in one shared-memory file that every worker maps. Worker 0 writes its
    gradients there, each next worker adds its stash in place, and only the buckets' small
    "present" flags travel over gloo, as the signal that a bucket is ready: no socket copies of
    the gradients. Two buffers because a worker may still copy iteration ``i``'s total out while
    worker 0 already writes iteration ``i + 1``'s; iteration ``i + 2``'s writes wait for every
    worker's part in ``i + 1``'s chain, which comes after its copy.

    Never: used unless every worker mapped the same file (a random token written by worker 0 is
    read back by each; workers on other hosts, or in another IPC namespace, fail that and every
    worker keeps gloo), or leaves the file behind (it is unlinked once mapped, or on failure; one
    that a worker 0 killed in between left is removed by the next :meth:`create` once it is older
    than the rendezvous timeout, :func:`remove_stale_chains`).
    """

    ALIGN = 64

    def __init__(self, flat: torch.Tensor, sizes: dict[torch.dtype, int]) -> None:
        offsets, _ = self._layout(sizes)
        self.bufs = [
            {dt: flat[off : off + sizes[dt] * dt.itemsize].view(dt) for dt, off in offs.items()} for offs in offsets
        ]

    @classmethod
    def _layout(cls, sizes: dict[torch.dtype, int]) -> tuple[list[dict[torch.dtype, int]], int]:
        """Byte offset of each parity's buffer of each dtype (after the token), and the file's size."""
        offsets: list[dict[torch.dtype, int]] = [{}, {}]
        off = cls.ALIGN
        for parity in (0, 1):
            for dt, n in sizes.items():
                offsets[parity][dt] = off
                off += -(-n * dt.itemsize // cls.ALIGN) * cls.ALIGN
        return offsets, off

    @staticmethod
    def create(directory: str, size: int, token: bytes) -> str | None:
        """A new file of ``size`` bytes in ``directory`` (space reserved, so a full tmpfs fails here
        and not later as SIGBUS) starting with ``token``; its path, or None when that is not possible."""
        if not hasattr(os, "posix_fallocate"):
            return None
        remove_stale_chains(directory)
        fd, path = -1, None
        try:
            fd, path = tempfile.mkstemp(prefix=CHAIN_PREFIX, dir=directory)
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, token, 0)
            return path
        except OSError as e:
            logger.info("parallel replay: no shared-memory chain (%s); gradients go over gloo", e)
            if path is not None:
                os.unlink(path)
            return None
        finally:
            if fd >= 0:
                os.close(fd)

    @classmethod
    def open(
        cls, sizes: dict[torch.dtype, int], rank: int, wanted: bool = True, directory: str = SHM_DIR
    ) -> SharedChain | None:
        """Collective (every worker calls it after the process group is up, with worker 0's
        ``wanted`` and ``directory`` deciding): the shared buffers, or None (gloo carries the
        gradients) when not ``wanted``, when worker 0 cannot make the file (:meth:`create`: no
        ``/dev/shm``, no room) or when any worker cannot map it."""
        _, size = cls._layout(sizes)
        token = uuid.uuid4().bytes
        path = cls.create(directory, size, token) if rank == 0 and wanted else None
        mine = path
        flat: torch.Tensor | None = None
        try:
            where = [path, token]
            dist.broadcast_object_list(where, src=0)
            path, token = where
            if path is not None and os.path.exists(path):  # (from_file would create a missing one)
                try:
                    flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                    if bytes(flat[: len(token)].tolist()) != token:
                        flat = None
                except (OSError, RuntimeError):
                    flat = None
            ok = torch.tensor([flat is not None], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every worker has mapped it (or failed) after this
        finally:
            if mine is not None:
                os.unlink(mine)
        if not ok.item():
            if path is not None:
                logger.info(
                    "parallel replay: not every worker could map the shared-memory chain; gradients go over gloo"
                )
            return None
        assert flat is not None
        return cls(flat, sizes)
