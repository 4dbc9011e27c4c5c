"""A logging group replayed as a pipeline across its members' processes (in-place group recovery).

Inside a logging group the sends are not logged, so a failure takes the whole group back to its
checkpoint. Instead of every member's replacement replaying the whole group in one process, each
member replays its own stage (:func:`replay_member`): a live member in its own process, with its
own objects reloaded from the checkpoint, the failed stage's replacement in its new one. What a
member's group neighbours send it (activations from the one before, gradients from the one after)
comes from them over a process group of the members, and what it regenerates for them goes the same
way; the group's two edges read the logs as any replay does. Each member runs its stage's live
order of forwards and backwards, so the exchanges happen in the order the live pipeline's did, and
sends never wait for the receiver (a thread per neighbour ships them): the replay cannot deadlock
where the live run did not. Every stage computes what it computed live from the same inputs, so
the result is the one a single process replaying the group gets, bit for bit on CPU.

:class:`PeerLinks` is the transport: per neighbour, a sender thread draining a queue and a
receiver thread filling a table; a message is one send (channel, iteration, micro-batch, its
tensors), framed as a fixed int64 header and one buffer of the tensors' bytes over gloo ``send``/``recv``.

Never: reads a record of a boundary inside the group from the logs, or waits without a deadline.
"""

from __future__ import annotations

import datetime
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from logstore import Channel
from logstore.keys import Kind
from replay.core import replay_stages
from replay.errors import ReplayError
from replay.reader import LogReader, RecordSource
from replay.report import ReplayReport
from replay.stage import ReplayHooks, StageState
from trainer_client.errors import RecoveryTimeoutError

__all__ = ["PeerLinks", "member_group", "replay_member"]

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_END = -1  # a header's first field: no more messages from this neighbour
_HEAD = 64  # int64 fields of a message header: kind, src, iteration, micro-batch, parts, bytes, then per part


class PeerLinks:
    """Messages between this member and its group neighbours over ``group`` (the members' gloo
    process group object, ranked as ``members``: :func:`member_group`). Each message is the
    regenerated send of one (channel, iteration, micro-batch): ``send`` queues it for the receiving
    stage, ``parts`` waits for one (at most ``timeout``). ``close`` ends the exchange (every
    neighbour is told, threads joined)."""

    def __init__(
        self,
        group: Any,
        members: Sequence[int],
        stage: int,
        timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    ) -> None:
        self.group, self.stage, self.timeout = group, stage, timeout
        self.rank_of = {s: i for i, s in enumerate(members)}
        self.neighbours = [s for s in (stage - 1, stage + 1) if s in self.rank_of]
        self._received: dict[tuple[int, int, int, int], list[torch.Tensor]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.wait_s = 0.0  # time ``parts`` waited for a neighbour
        self._queues: dict[int, queue.Queue[Any]] = {s: queue.Queue() for s in self.neighbours}
        self._threads = [
            threading.Thread(target=self._send_loop, args=(s,), name=f"swiftlog-peer-send-{s}", daemon=True)
            for s in self.neighbours
        ] + [
            threading.Thread(target=self._recv_loop, args=(s,), name=f"swiftlog-peer-recv-{s}", daemon=True)
            for s in self.neighbours
        ]
        for t in self._threads:
            t.start()

    def send(self, channel: Channel, iteration: int, micro_batch: int, tensors: Sequence[torch.Tensor]) -> bool:
        """Queue a send for ``channel.dst`` if it is a neighbour in the group; whether it was."""
        if channel.dst not in self._queues:
            return False
        parts = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]  # the replay goes on
        self._queues[channel.dst].put((channel, iteration, micro_batch, parts))
        return True

    def parts(self, channel: Channel, iteration: int, micro_batch: int) -> list[torch.Tensor]:
        """The tensors the neighbour ``channel.src`` sent on ``channel`` for (iteration, micro-batch)."""
        key = (int(channel.kind), channel.src, iteration, micro_batch)
        t0 = time.monotonic()
        deadline = t0 + self.timeout.total_seconds()
        with self._cond:
            while key not in self._received:
                if self._error is not None:
                    raise ReplayError(f"stage {self.stage}: the exchange with its group failed: {self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoveryTimeoutError(
                        f"stage {self.stage}: no {channel.name} from stage {channel.src} for iteration {iteration} "
                        f"micro-batch {micro_batch} within {self.timeout.total_seconds():.0f} s"
                    )
                self._cond.wait(min(left, 1.0))
            self.wait_s += time.monotonic() - t0
            return self._received.pop(key)

    def close(self) -> None:
        """Tell every neighbour there is nothing more, and wait for the exchange to end."""
        for q in self._queues.values():
            q.put(None)
        deadline = time.monotonic() + self.timeout.total_seconds()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- the threads --------------------------------------------------------------------
    def _send_loop(self, dst: int) -> None:
        peer = self.rank_of[dst]
        try:
            while True:
                item = self._queues[dst].get()
                head = torch.zeros(_HEAD, dtype=torch.int64)
                if item is None:
                    head[0] = _END
                    self._send(head, peer)
                    return
                channel, it, mb, parts = item
                fields = [int(channel.kind), channel.src, it, mb, len(parts), sum(p.nbytes for p in parts)]
                for p in parts:
                    fields += [_DTYPES.index(p.dtype), p.dim(), *p.shape]
                if len(fields) > _HEAD:
                    raise ReplayError(f"{channel.name}: a send of {len(parts)} parts does not fit a message header")
                head[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
                # two writes a message: the header, then every part's bytes in one buffer (small writes
                # in a row would wait on TCP's delayed acknowledgements)
                self._send(head, peer)
                self._send(torch.cat([p.reshape(-1).view(torch.uint8) for p in parts]), peer)
        except BaseException as e:  # a dead neighbour: the receiving side times out or fails too
            self._fail(e)

    def _recv_loop(self, src: int) -> None:
        peer = self.rank_of[src]
        try:
            while True:
                head = torch.empty(_HEAD, dtype=torch.int64)
                self._recv(head, peer)
                h = head.tolist()
                if h[0] == _END:
                    return
                kind, s, it, mb, count, total = h[:6]
                payload = torch.empty(total, dtype=torch.uint8)
                self._recv(payload, peer)
                pos, off, parts = 6, 0, []
                for _ in range(count):
                    dtype, ndim = _DTYPES[h[pos]], h[pos + 1]
                    shape = h[pos + 2 : pos + 2 + ndim]
                    pos += 2 + ndim
                    n = math.prod(shape) * dtype.itemsize
                    parts.append(payload[off : off + n].clone().view(dtype).reshape(shape))
                    off += n
                with self._cond:
                    self._received[(kind, s, it, mb)] = parts
                    self._cond.notify_all()
        except BaseException as e:
            self._fail(e)

    def _send(self, t: torch.Tensor, peer: int) -> None:
        self.group.send([t], peer, 0).wait()

    def _recv(self, t: torch.Tensor, peer: int) -> None:
        self.group.recv([t], peer, 0).wait()

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = self._error or e
            self._cond.notify_all()


def member_group(
    store: dist.Store, prefix: str, index: int, size: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """The gloo process group of a group's members (``index`` of ``size``), met under ``prefix`` of
    ``store``; apart from any default group (the members' pipeline group is down while they replay)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), index, size, timeout)


class _PeerReader(LogReader):
    """A LogReader whose group-internal input channels come from :class:`PeerLinks`."""

    def __init__(self, sources: Sequence[RecordSource], links: PeerLinks, peer_channels: set[Channel]) -> None:
        super().__init__(list(sources))
        self.links, self.peer_channels = links, peer_channels

    def require_parts(self, channel: Channel, iteration: int, micro_batch: int) -> list[torch.Tensor]:
        if channel in self.peer_channels:
            return self.links.parts(channel, iteration, micro_batch)
        return super().require_parts(channel, iteration, micro_batch)


def replay_member(
    state: StageState,
    members: Sequence[int],
    sources: Sequence[RecordSource],
    *,
    group: Any,
    num_stages: int,
    stop_iteration: int,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    data_source: Callable[[int], tuple[Any, Any]] | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
) -> ReplayReport:
    """Replay ``state``'s stage as one member of the logging group ``members`` (consecutive stages,
    one process each, ranked in ``group`` in that order), every member calling it at once.

    ``state``: this stage's objects, loaded from the group's checkpoint (advanced in place).
    ``sources``: the logs of the group's edges (and META). Returns this stage's report: its sends at
    the group's edges are checked against the neighbours' digests, the ones inside go to the members.
    Raises what the replay raises, RecoveryTimeoutError when a member sends nothing for ``timeout``.
    """
    members = list(members)
    if state.stage not in members or members != list(range(members[0], members[0] + len(members))):
        raise ReplayError(f"stage {state.stage}: the group {members} must be consecutive stages holding it")
    peer_in = set()
    if state.stage - 1 in members:  # the activations the member before sends
        peer_in.add(Channel(Kind.ACTIVATION, state.stage - 1, state.stage))
    if state.stage + 1 in members:  # the gradients the member after sends
        peer_in.add(Channel(Kind.GRADIENT, state.stage + 1, state.stage))
    links = PeerLinks(group, members, state.stage, timeout)
    try:
        reader = _PeerReader(sources, links, peer_in)
        report = replay_stages(
            [state],
            reader,
            num_stages=num_stages,
            stop_iteration=stop_iteration,
            loss_fn=loss_fn,
            data_source=data_source,
            prefetch=0,
            hooks=ReplayHooks(send=links.send, live_order=True),
        )
        report.warnings.append(f"waited {links.wait_s:.3f} s for the group's members")
        return report
    finally:
        links.close()
