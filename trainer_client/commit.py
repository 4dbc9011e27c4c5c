"""The commit step: every surviving stage applies iteration t, or none does.

Before its optimizer step, each stage calls :meth:`CommitCoordinator.commit` for the iteration
whose backward it just finished. The decision lives in a ``torch.distributed.Store`` (a TCPStore
hosted outside the training ranks, so it survives any of them) under
``{prefix}/gen{generation}/it{iteration}/decision`` and is written exactly once, by
``compare_set(key, "", value)``: the first writer wins and everyone reads the same value
(``"commit:<stage>"`` or ``"abort:<stage>:<reason>"``).

- Each stage marks itself done (``.../done/{stage}``) and increments ``.../done``; the stage that
  brings the count to ``num_stages`` writes "commit".
- A stage that saw a failure during the iteration calls :meth:`abort` (writes "abort"); an
  orchestrator that knows a stage died calls :meth:`mark_failed` for the generation, and every
  waiting stage then writes "abort" itself.
- A stage that waited ``timeout`` writes "abort" too. Since only one value can ever be written,
  a timeout can never leave one stage committed and another aborted.

So after a failure all survivors stand at the same iteration: either all applied it (the
decision was "commit" before the failure was noticed) or none did.

META in the store: a stage may pass its iteration's META document to :meth:`CommitCoordinator.commit`;
it is written under ``{prefix}/meta/{stage}/it{iteration}`` in the same request as the done mark
(``multi_set``), so every committed iteration's META of every stage is in the store, which
survives the stage's machine, before anyone applies the iteration. A replacement reads it there
(:func:`stored_metas`) when the dead stage's own log, which ships META to the cold tier only
after the fact, lost the last iterations. :meth:`CommitCoordinator.forget_metas` deletes a stage's
META keys below its checkpoint (the same rule as the log GC); the lowest key that may remain is
kept in the store too (``.../meta/{stage}/floor``), so a replacement deletes its predecessor's.

With data-parallel replicas, a stage's replicas commit the same META document but for the timings
each measures (:data:`RANK_FIELDS`): each writes the rest under a key named by its xxh3
(:func:`shared_meta_key`, so the store holds one copy per stage), and its own key holds ``@``, that
key and its timings; :func:`stored_metas` puts the whole document back together.

Checkpoint registrations in the store (:class:`SharedRegistrations`): each stage puts its newest
registration under ``{prefix}/ckpt/{stage}``; a node without a cold tier learns the others' there
(its GC frees what they received from its stage only once it knows their checkpoints).

Waiting polls the store with a short exponential backoff (0.1 ms to 5 ms), two cheap requests
per poll. Never: decides anything locally, retries a decided iteration, or raises anything but
:class:`IterationAbortedError` / :class:`CommitStoreError` from ``commit``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import xxhash

from trainer_client.errors import CommitStoreError, IterationAbortedError

__all__ = [
    "CommitCoordinator",
    "CommitResult",
    "SharedRegistrations",
    "COMMIT",
    "ABORT",
    "meta_key",
    "shared_meta_key",
    "stored_metas",
    "loopback_store",
    "gloo_on_loopback",
]

logger = logging.getLogger(__name__)

COMMIT = "commit"
ABORT = "abort"


def gloo_on_loopback() -> None:
    """For a process whose process groups stay on this host (the launchers' stages, a spawned
    parallel replay): gloo listens on the loopback interface (``GLOO_SOCKET_IFNAME=lo`` unless
    set), not on whatever address the host name resolves to. Linux only (elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def loopback_store(timeout: timedelta = timedelta(seconds=300)) -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1 only, on a free port (``.port``), for processes of this host."""
    return bound_store("127.0.0.1", 0, timeout)


def bound_store(host: str, port: int, timeout: timedelta = timedelta(seconds=300)) -> dist.TCPStore:
    """A TCPStore server listening on ``host``:``port`` only (port 0: a free one, then ``.port``).

    ``dist.TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host`` says;
    here the listening socket is bound to ``host`` first and handed over (torch owns and closes it).
    Raises OSError when the address cannot be bound (in use, not this host's).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.detach()
    )


@dataclass(frozen=True, slots=True)
class CommitResult:
    """Outcome of a committed iteration: who decided and how long this stage waited (seconds)."""

    iteration: int
    generation: int
    decided_by: int | None
    wait_s: float


def _parse(value: str) -> tuple[str, int | None, str]:
    """A decision value ``"commit:<stage>"`` / ``"abort:<stage>:<reason>"`` -> (decision, stage, reason)."""
    decision, _, rest = value.partition(":")
    by, _, why = rest.partition(":")
    return decision, int(by) if by.isdigit() else None, why


def meta_key(prefix: str, stage: int, iteration: int) -> str:
    """Store key of ``stage``'s META document of ``iteration`` under the commit ``prefix``."""
    return f"{prefix.rstrip('/')}/meta/{stage}/it{iteration}"


#: META fields each rank measures for itself (timings): kept beside the shared copy, per rank
RANK_FIELDS = ("step_s", "time")


def _dump(doc: dict[str, Any]) -> bytes:
    """As ``trainer_client.meta.encode_meta`` writes a document: the same bytes for the same fields."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def split_meta(meta: bytes) -> tuple[bytes, bytes]:
    """(what a stage's replicas share, this rank's own fields) of a META document."""
    doc = json.loads(meta)
    own = {k: doc.pop(k) for k in RANK_FIELDS if k in doc}
    return _dump(doc), _dump(own)


def join_meta(pointer: bytes, shared: bytes) -> bytes:
    """The rank's whole META document from its pointer (``@key`` newline own fields) and the copy."""
    _, _, own = pointer.partition(b"\n")
    doc = json.loads(shared)
    doc.update(json.loads(own) if own else {})
    return _dump(doc)


def shared_meta_key(prefix: str, stage: int, iteration: int, meta: bytes) -> str:
    """Where the replicas of ``stage`` keep one copy of a META document they share: named by the
    document's xxh3, so replicas with the same document write the same key."""
    return f"{prefix.rstrip('/')}/meta/s{stage}/it{iteration}/{xxhash.xxh3_64_hexdigest(meta)}"


def stored_metas(store: dist.Store, prefix: str, stage: int, iterations: range) -> dict[int, bytes]:
    """The META documents (encoded JSON) of ``stage`` (a rank, in a mesh) that the store holds for
    ``iterations``: iteration -> bytes, missing ones left out. A rank's key holding ``@key`` names
    the copy its stage's replicas share. One request when all are there (``multi_get``), else one
    ``check`` and ``get`` per key; never waits for a key to appear. Raises what the store client
    raises when the store cannot be reached."""
    keys = [meta_key(prefix, stage, it) for it in iterations]
    if not keys:
        return {}
    if store.check(keys):
        found = {it: bytes(v) for it, v in zip(iterations, store.multi_get(keys), strict=True)}
    else:
        found = {it: bytes(store.get(k)) for it, k in zip(iterations, keys, strict=True) if store.check([k])}
    shared = {it: v for it, v in found.items() if v.startswith(b"@")}
    for it, v in shared.items():
        k = v[1:].partition(b"\n")[0].decode()
        if store.check([k]):
            found[it] = join_meta(v, bytes(store.get(k)))
        else:  # its copy is gone (a checkpoint deleted it): as if never stored
            del found[it]
    return found


class SharedRegistrations:
    """The newest checkpoint registration of every stage, shared through the commit store.

    Without a cold tier, a registration is written to the registering node's index only, while
    what the stage received lies on the senders' nodes. Each stage publishes its registration
    document (JSON) under ``{prefix}/ckpt/{stage}`` (:meth:`publish`); :meth:`others` reads those
    of the other stages. Never waits for a key to appear; raises what the store client raises when
    the store cannot be reached.
    """

    def __init__(self, store: dist.Store, *, prefix: str, stage: int, num_stages: int) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")
        self.stage = stage
        self.num_stages = num_stages

    def key(self, stage: int) -> str:
        return f"{self.prefix}/ckpt/{stage}"

    def publish(self, doc: dict[str, Any]) -> None:
        """Put this stage's registration ``doc`` (a newer one replaces it)."""
        self.store.set(self.key(self.stage), json.dumps(doc, sort_keys=True))

    def others(self) -> list[dict[str, Any]]:
        """The registrations the other stages published (those that have one); a value that is
        not a JSON object is skipped with a warning."""
        out = []
        for s in range(self.num_stages):
            if s == self.stage or not self.store.check([self.key(s)]):
                continue
            raw = self.store.get(self.key(s))
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                out.append(doc)
            else:
                logger.warning("commit store key %s holds no registration document: skipped", self.key(s))
        return out


class CommitCoordinator:
    """Store-based, first-writer-wins commit decisions for one stage of one run.

    Args:
        store: a ``torch.distributed.Store`` reachable by every stage (e.g. a TCPStore client
            whose server runs outside the training ranks).
        stage / num_stages: this stage and the pipeline size (data-parallel replicas would use
            one coordinator per replica prefix).
        prefix: key prefix, e.g. ``swiftlog/{run_id}``.
        timeout: how long ``commit`` waits for the decision before writing "abort".
        generation: process-group generation; bump it with :meth:`set_generation` after the
            pipeline re-forms so old keys are never reused.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        stage: int,
        num_stages: int,
        prefix: str,
        timeout: timedelta = timedelta(seconds=120),
        generation: int = 0,
        shared_stage: int | None = None,
    ) -> None:
        self.store = store
        self.stage = stage
        self.num_stages = num_stages
        # with data-parallel replicas: the pipeline stage whose replicas store one copy of a META
        # they share (the key of this rank then holds "@" and that copy's key)
        self.shared_stage = shared_stage
        self._shared: dict[int, set[str]] = {}  # iteration -> the shared copies this rank wrote
        self.prefix = prefix.rstrip("/")
        self.timeout = timeout
        self.generation = generation
        self._floor_known = False  # the store has this stage's META floor (set at the first META commit)

    # -- keys ------------------------------------------------------------------------------
    def _it_key(self, iteration: int, generation: int | None = None) -> str:
        g = self.generation if generation is None else generation
        return f"{self.prefix}/gen{g}/it{iteration}"

    def _floor_key(self) -> str:
        return f"{self.prefix}/meta/{self.stage}/floor"

    def _failed_key(self, generation: int | None = None) -> str:
        g = self.generation if generation is None else generation
        return f"{self.prefix}/gen{g}/failed"

    def amend_meta(self, iteration: int, meta: bytes) -> None:
        """Replace the stored META of ``iteration`` (already committed) with ``meta``: the document
        amended with what the optimizer step used. Raises what the store client raises."""
        keys, values = self._meta_items(iteration, meta)
        self.store.multi_set(keys, values)

    def _meta_items(self, iteration: int, meta: bytes) -> tuple[list[str], list[bytes]]:
        """The keys and values that store ``meta``: this rank's key, or (replicas) the shared
        copy and this rank's pointer to it."""
        own = meta_key(self.prefix, self.stage, iteration)
        if self.shared_stage is None:
            return [own], [meta]
        common, mine = split_meta(meta)  # the ranks' timings apart: the rest is the same on every replica
        shared = shared_meta_key(self.prefix, self.shared_stage, iteration, common)
        self._shared.setdefault(iteration, set()).add(shared)
        return [shared, own], [common, b"@" + shared.encode() + b"\n" + mine]

    def set_generation(self, generation: int) -> None:
        """Use keys of ``generation`` from now on (after the pipeline re-formed)."""
        self.generation = generation

    # -- protocol --------------------------------------------------------------------------
    def _done_items(self, iteration: int, meta: bytes | None) -> tuple[list[str], list[bytes]]:
        """The keys and values that report this participant done with ``iteration`` (its META first)."""
        done = f"{self._it_key(iteration)}/done/{self.stage}"
        if meta is None:
            return [done], [b"1"]
        if not self._floor_known:  # the lowest META key of this stage (kept if a predecessor set it)
            self.store.compare_set(self._floor_key(), "", str(iteration))
            self._floor_known = True
        keys, values = self._meta_items(iteration, meta)
        return [*keys, done], [*values, b"1"]

    def commit(
        self,
        iteration: int,
        meta: bytes | None = None,
        *,
        also: Sequence[tuple[CommitCoordinator, bytes | None]] = (),
    ) -> CommitResult:
        """Report this stage done with ``iteration`` and wait for the decision.

        ``meta``: the iteration's META document, stored with the done mark in one request (see
        the module docstring). ``also``: the other participants this process reports for, with
        their META (the other stages of a rank in a multi-stage schedule; coordinators over the
        same store, prefix and generation): every done mark goes in the same request. Returns
        when the decision is "commit". Raises IterationAbortedError when it is "abort" (a stage
        failed, the generation was marked failed, or the wait timed out), and CommitStoreError
        when the store cannot be reached (outcome unknown: treat as a failure).
        """
        key = self._it_key(iteration)
        dec = key + "/decision"
        t0 = time.monotonic()
        try:
            # one request: every META is in the store before its stage counts as done
            keys, values = self._done_items(iteration, meta)
            for other, other_meta in also:
                k, v = other._done_items(iteration, other_meta)
                keys, values = [*keys, *k], [*values, *v]
            self.store.multi_set(keys, values)
            last_to_report = self.store.add(key + "/done", 1 + len(also)) >= self.num_stages
            if last_to_report and _parse(self._str(self.store.compare_set(dec, "", f"{COMMIT}:{self.stage}"))) == (
                COMMIT,
                self.stage,
                "",
            ):
                self._forget(iteration - 2)
            deadline = t0 + self.timeout.total_seconds()
            sleep = 1e-4
            while not self.store.check([dec]):
                if self.store.check([self._failed_key()]):
                    why = f"generation {self.generation} was marked failed ({self._get_str(self._failed_key())})"
                    self.store.compare_set(dec, "", f"{ABORT}:{self.stage}:{why}")
                    break
                if time.monotonic() >= deadline:
                    why = f"timeout after {self.timeout.total_seconds():g} s"
                    self.store.compare_set(dec, "", f"{ABORT}:{self.stage}:{why}")
                    break
                time.sleep(sleep)
                sleep = min(sleep * 2, 5e-3)
            value = self._get_str(dec)
        except Exception as e:  # RuntimeError/DistStoreError from the store client
            raise CommitStoreError(
                f"stage {self.stage}: commit of iteration {iteration} (generation {self.generation}) "
                f"could not reach the store: {e}",
                iteration=iteration,
                generation=self.generation,
                hint="the store host must run outside the training ranks; treat this iteration as failed",
            ) from e
        decision, by, why = _parse(value)
        wait_s = time.monotonic() - t0
        if decision == COMMIT:
            return CommitResult(iteration, self.generation, by, wait_s)
        missing = self._missing(key)
        reason = f"aborted by stage {by}" + (f": {why}" if why else "")
        msg = f"stage {self.stage}: iteration {iteration} (generation {self.generation}) {reason}"
        if missing:
            msg += f"; stages that had not reported done: {missing}"
        logger.warning(msg)
        raise IterationAbortedError(
            msg, iteration=iteration, generation=self.generation, reason=reason, missing=missing
        )

    def abort(self, iteration: int, reason: str = "") -> str:
        """Write "abort" for ``iteration`` unless a decision exists; return the decision in force.

        Call it when this stage saw a failure during the iteration (e.g. a communication error).
        Never raises for a store error (returns "unknown" and logs it): the caller is already on
        its failure path.
        """
        try:
            value = self.store.compare_set(self._it_key(iteration) + "/decision", "", f"{ABORT}:{self.stage}:{reason}")
            value = value.decode() if isinstance(value, bytes) else str(value)
            logger.info(
                "stage %d: abort of iteration %d requested (%s): decision is %s", self.stage, iteration, reason, value
            )
            return _parse(value)[0]
        except Exception as e:
            logger.warning("stage %d: could not write abort of iteration %d: %s", self.stage, iteration, e)
            return "unknown"

    def forget_metas(self, below: int) -> int:
        """Delete this stage's META keys of iterations below ``below`` (its durable checkpoint:
        a replay starts there or later), from the floor the store records (what this stage or a
        predecessor left) up; returns how many iterations were cleared. Housekeeping: never raises
        (a store error is logged and the keys are left for the next call)."""
        floor_key = self._floor_key()
        try:
            low = int(self._get_str(floor_key)) if self.store.check([floor_key]) else below
            for it in range(low, below):
                own = meta_key(self.prefix, self.stage, it)
                doomed = self._shared.pop(it, set())
                if self.shared_stage is not None and self.store.check([own]):  # a predecessor's copy too
                    v = bytes(self.store.get(own))
                    if v.startswith(b"@"):
                        doomed.add(v[1:].partition(b"\n")[0].decode())
                for k in doomed:  # another replica may have deleted it already
                    self.store.delete_key(k)
                self.store.delete_key(own)
            if below > low:
                self.store.set(floor_key, str(below))
            return max(0, below - low)
        except Exception as e:
            logger.warning(
                "stage %d: deleting META keys below iteration %d from the commit store failed: %s", self.stage, below, e
            )
            return 0

    def mark_failed(self, who: str = "", generation: int | None = None) -> None:
        """Mark the whole generation failed: every stage waiting in ``commit`` aborts."""
        self.store.set(self._failed_key(generation), who or f"stage{self.stage}")

    def decision(self, iteration: int, generation: int | None = None) -> str | None:
        """The decision written for ``iteration`` ("commit" / "abort"), or None if undecided."""
        dec = self._it_key(iteration, generation) + "/decision"
        if not self.store.check([dec]):
            return None
        return _parse(self._get_str(dec))[0]

    # -- helpers ---------------------------------------------------------------------------
    def _get_str(self, key: str) -> str:
        return self._str(self.store.get(key))

    @staticmethod
    def _str(v: object) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    def _forget(self, iteration: int) -> None:
        """Delete the keys of an old iteration. Safe for ``iteration <= t - 1`` once ``t`` is
        decided by count: every stage read that decision before reporting done with ``t``."""
        if iteration < 0:
            return
        key = self._it_key(iteration)
        try:
            for k in [f"{key}/done/{s}" for s in range(self.num_stages)] + [key + "/done", key + "/decision"]:
                self.store.delete_key(k)
        except Exception as e:  # housekeeping only
            logger.debug("commit key cleanup failed: %s", e)

    def _missing(self, key: str) -> list[int]:
        try:
            return [s for s in range(self.num_stages) if not self.store.check([f"{key}/done/{s}"])]
        except Exception:
            return []
