"""What the data-parallel replicas of a stage share: the gradient average, and the whole state.

1. :func:`average_gradients_`: every iteration, the replicas average their gradients over the
   mesh's ``dp_replicate`` group. The layout is fixed by the arguments alone: gradients of one
   dtype laid end to end in parameter order, cut into buckets of ``bucket_bytes``, one
   ``all_reduce`` (sum) per bucket in order, then a division by the group's size. The same
   participants, world size and layout give the same bits, so replicas lost together replay the
   reduction among themselves exactly, without any gradient logged.
2. :func:`send_state` / :func:`receive_state`: when a replica is replaced while another of its
   stage lives, the live one (the donor) streams its state (parameters, buffers, optimizer and
   scheduler state, what the caller adds) over a process group in chunks; the receiver checks
   every tensor's xxh3 against the donor's before it returns anything.

Never: reorders a reduction between calls with the same arguments; returns a state whose digest
differs from the donor's.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer_client.digest import tensor_digest
from trainer_client.errors import ReplicaTransferError

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ReplicaTransferError",
    "TransferReport",
    "average_gradients_",
    "receive_state",
    "send_state",
]

#: the default bucket of the gradient average (torch DDP's default bucket is 25 MiB)
DEFAULT_BUCKET_BYTES = 25 << 20
#: the default chunk of a state transfer
DEFAULT_CHUNK_BYTES = 64 << 20


# ================================================================ the gradient average
def average_gradients_(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> dict[str, Any]:
    """Average ``grads`` in place over ``group``; returns the layout (for META).

    One all_reduce per bucket: per dtype and device, the gradients in the given order laid end to
    end, cut every ``bucket_bytes``. Every rank of the group calls it with gradients of the same
    shapes and dtypes in the same order (a collective). Raises ValueError for a bucket under 1 KiB."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1024:
        raise ValueError(f"bucket_bytes must be an int >= 1024, got {bucket_bytes!r}")
    world = dist.get_world_size(group)
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.dtype, g.device), []).append(i)
    buckets = 0
    for idx in by_kind.values():
        flat = torch.cat([grads[i].detach().reshape(-1) for i in idx])
        per = max(1, bucket_bytes // flat.element_size())
        for lo in range(0, flat.numel(), per):
            dist.all_reduce(flat[lo : lo + per], group=group)
            buckets += 1
        flat.div_(world)
        off = 0
        for i in idx:
            n = grads[i].numel()
            grads[i].copy_(flat[off : off + n].view_as(grads[i]))
            off += n
    return {"world": world, "bucket_bytes": bucket_bytes, "buckets": buckets, "ranks": _ranks(group)}


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


# ================================================================ the state transfer
@dataclass(frozen=True, slots=True)
class TransferReport:
    """One state transfer as one side saw it: bytes of tensor data, tensors, seconds (the data,
    not the header), and the peer's global rank."""

    role: str
    peer: int
    bytes: int
    tensors: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "peer": self.peer,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "seconds": self.seconds,
            "gb_per_s": self.gb_per_s,
        }


class _Slot:
    """Where a tensor was in the state (its index in the tensor list)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _split(obj: Any, tensors: list[torch.Tensor], paths: list[str], path: str = "") -> Any:
    """``obj`` with every tensor replaced by a :class:`_Slot` (the tensors appended to ``tensors``,
    their places, e.g. ``"model/0.weight"``, to ``paths``)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().to("cpu").contiguous())
        paths.append(path)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return type(obj)((k, _split(v, tensors, paths, f"{path}/{k}" if path else str(k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_split(v, tensors, paths, f"{path}/{i}") for i, v in enumerate(obj))
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.i]
    if isinstance(obj, dict):
        return type(obj)((k, _join(v, tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _target(into: Mapping[str, torch.Tensor] | None, path: str, dtype: torch.dtype, shape: Any) -> torch.Tensor:
    t = None if into is None else into.get(path)
    usable = (
        t is not None
        and t.dtype == dtype
        and tuple(t.shape) == tuple(shape)
        and t.is_contiguous()
        and t.device.type == "cpu"
    )
    return t.detach() if usable else torch.empty(shape, dtype=dtype)  # type: ignore[union-attr]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _chunks(sizes: Sequence[int], chunk: int) -> Iterator[list[tuple[int, int, int]]]:
    """The tensors' bytes laid end to end, cut every ``chunk`` bytes: each chunk as its pieces
    ``(tensor, offset, length)``. Both sides compute the same chunks from the sizes."""
    cur: list[tuple[int, int, int]] = []
    used = 0
    for i, n in enumerate(sizes):
        off = 0
        while off < n:
            take = min(n - off, chunk - used)
            cur.append((i, off, take))
            used += take
            off += take
            if used == chunk:
                yield cur
                cur, used = [], 0
    if cur:
        yield cur


def _stream(tensors: Sequence[torch.Tensor], chunk: int, move: Any, *, inbound: bool) -> None:
    """Move the tensors' bytes, laid end to end, in chunks (``move``: one send or receive). A chunk
    that is one piece of one tensor moves in place; smaller pieces share a staging buffer, packed
    before a send (``inbound`` False) or unpacked after a receive."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    views = [_bytes_of(t) for t in tensors]
    staging = torch.empty(min(chunk, max(sum(sizes), 1)), dtype=torch.uint8)
    for pieces in _chunks(sizes, chunk):
        if len(pieces) == 1:
            i, off, n = pieces[0]
            move(views[i][off : off + n])
            continue
        at, pos = [], 0  # (the piece, its place in the staging buffer)
        for i, off, n in pieces:
            at.append((views[i][off : off + n], staging[pos : pos + n]))
            pos += n
        if not inbound:
            for view, stage in at:
                stage.copy_(view)
        move(staging[:pos])
        if inbound:
            for view, stage in at:
                view.copy_(stage)


def send_state(
    state: Any, dst: int, *, group: dist.ProcessGroup | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> TransferReport:
    """Stream ``state`` (any picklable structure holding tensors, e.g. state dicts) to global rank
    ``dst``, which calls :func:`receive_state`. A chunk that is one piece of one tensor goes
    straight from the tensor's memory; smaller pieces are packed into one buffer first."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    skeleton = _split(state, tensors, paths)
    sizes = [t.numel() * t.element_size() for t in tensors]
    header = pickle.dumps(
        {
            "skeleton": skeleton,
            "meta": [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors],
            "paths": paths,
            "digests": [tensor_digest(t) for t in tensors],
            "chunk": chunk_bytes,
        }
    )
    dist.send(torch.tensor([len(header)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group)
    t0 = time.perf_counter()
    _stream(tensors, chunk_bytes, lambda t: dist.send(t, dst, group=group), inbound=False)
    return TransferReport("sent", dst, sum(sizes), len(tensors), time.perf_counter() - t0)


def receive_state(
    src: int, *, group: dist.ProcessGroup | None = None, into: Mapping[str, torch.Tensor] | None = None
) -> tuple[Any, TransferReport]:
    """Receive what :func:`send_state` on global rank ``src`` sends; returns (state, report).

    ``into``: tensors to receive into in place, by their place in the state (``"model/0.weight"``:
    e.g. ``{f"model/{k}": v for k, v in module.state_dict().items()}``, views of the parameters),
    used where dtype and shape match and the tensor is contiguous on the CPU; the others are
    allocated. Memory already in use saves the first touch of fresh pages, which costs as much as
    the copy itself. Raises ReplicaTransferError naming the first tensor whose digest differs from
    the donor's (what was received in place then holds the bytes received)."""
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    raw = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(raw, src, group=group)
    header = pickle.loads(raw.numpy().tobytes())  # noqa: S301 - from our own donor, over the job's group
    tensors = [
        _target(into, path, getattr(torch, dtype), shape)
        for path, (dtype, shape) in zip(header["paths"], header["meta"], strict=True)
    ]
    sizes = [t.numel() * t.element_size() for t in tensors]
    t0 = time.perf_counter()
    _stream(tensors, int(header["chunk"]), lambda t: dist.recv(t, src, group=group), inbound=True)
    seconds = time.perf_counter() - t0
    for i, (t, want) in enumerate(zip(tensors, header["digests"], strict=True)):
        if tensor_digest(t) != want:
            raise ReplicaTransferError(
                f"tensor {i} of the state received from rank {src} ({tuple(t.shape)} {t.dtype}) "
                "does not match the donor's digest"
            )
    return _join(header["skeleton"], tensors), TransferReport("received", src, sum(sizes), len(tensors), seconds)
