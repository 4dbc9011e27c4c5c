"""The recovery protocol in the shared store: its key names, and the waits on them.

Both sides of a recovery use them: the survivors (``trainer_client.survivor``) and a replacement
(``replay.replacement``), which meet only in the store hosted outside the training ranks. Every
wait has a deadline and raises :class:`RecoveryTimeoutError` naming what it waited for; nothing
sleeps a fixed time (polls back off from 1 ms to 20 ms).

Never: writes a key (the protocol's writers do); waits without a deadline.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch.distributed as dist

from trainer_client.config import ENV_RESTART_COUNT
from trainer_client.errors import RecoveryFailedError, RecoveryTimeoutError

__all__ = ["RecoveryKeys", "as_str", "pg_prefix", "wait_for_keys", "wait_until_woken"]


def pg_prefix(run_id: str, generation: int) -> str:
    """Store prefix of the process group of ``generation`` (generation 0 is the initial one); under
    a torchrun restart, of that attempt (the agent's store keeps the earlier attempts' keys)."""
    restart = os.environ.get(ENV_RESTART_COUNT, "0").strip()
    return f"{run_id}/pg/gen{generation}" + (f"/restart{restart}" if restart not in ("", "0") else "")


class RecoveryKeys:
    """Names of the recovery keys of one run in the shared store (one place, used by both sides)."""

    def __init__(self, run_id: str, commit_prefix: str | None = None) -> None:
        self.run_id = run_id
        self.commit_prefix = (commit_prefix or f"swiftlog/{run_id}").rstrip("/")
        # the protocol's keys live with the commit prefix (a torchrun restart has its own); the
        # job-wide marks (progress, kill times) span every attempt
        self.base = f"{self.commit_prefix}/recovery"
        self.run_base = f"swiftlog/{run_id}/recovery"

    def failed(self, g: int) -> str:
        """The commit coordinator's "generation failed" key (its presence aborts every commit wait)."""
        return f"{self.commit_prefix}/gen{g}/failed"

    def failed_stages(self, g: int) -> str:
        """JSON list of the stages the scheduler replaces after generation ``g`` failed."""
        return f"{self.base}/gen{g}/failed_stages"

    def survivor(self, g: int, stage: int) -> str:
        return f"{self.base}/gen{g}/survivor/{stage}"

    def ready(self, g: int, stage: int) -> str:
        return f"{self.base}/gen{g}/ready/{stage}"

    def fallback(self, g: int) -> str:
        return f"{self.base}/gen{g}/fallback"

    def rejoined(self, g: int, stage: int) -> str:
        return f"{self.base}/gen{g}/rejoined/{stage}"

    def healed(self, g: int, rank: int) -> str:
        """The state transfer (``TransferReport.to_dict``) that healed ``rank`` after generation ``g``."""
        return f"{self.base}/gen{g}/healed/{rank}"

    def heartbeat(self, g: int, stage: int) -> str:
        return f"{self.base}/gen{g}/hb/{stage}"

    def finished(self, g: int, stop: int, stage: int) -> str:
        """Set by ``stage`` when it applied iteration ``stop - 1``, the last one of a ``run``, in
        generation ``g`` (the end-of-run barrier)."""
        return f"{self.base}/gen{g}/finished/{stop}/{stage}"

    def ready_count(self, g: int) -> str:
        """Counter of the replacements of generation ``g`` that reported ready."""
        return f"{self.base}/gen{g}/ready_count"

    def wake(self, g: int) -> str:
        """Set once every replacement of ``g`` is ready ("ready") or recovery was abandoned
        ("fallback"): what the survivors block on while the replacement replays."""
        return f"{self.base}/gen{g}/wake"

    def replay_job(self, g: int, stage: int) -> str:
        """JSON the replacement of ``stage`` publishes for its replay helpers: the job, the world
        size and the rendezvous prefix; or ``{"cancel": reason}`` when it replays without them."""
        return f"{self.base}/gen{g}/replay_job/{stage}"

    def replay_rendezvous(self, g: int, stage: int) -> str:
        """Prefix of the replay workers' process-group rendezvous keys (replacement = rank 0)."""
        return f"{self.base}/gen{g}/replay_pg/{stage}/"

    def group_job(self, g: int, first: int) -> str:
        """The replay job of the logging group starting at stage ``first`` after generation ``g``
        failed, replayed in place by its members (JSON, written by its lowest replacement)."""
        return f"{self.base}/gen{g}/group/{first}/job"

    def group_report(self, g: int, stage: int) -> str:
        """A group member's replay report: ``{"ok", "digests_checked", "why"}``."""
        return f"{self.base}/gen{g}/group/report/{stage}"

    def group_rendezvous(self, g: int, first: int) -> str:
        """Store prefix of the members' process group of that group's in-place replay."""
        return f"{self.base}/gen{g}/group/{first}/pg/"

    def progress(self) -> str:
        """Appended by the example script's last stage after every applied iteration (plots)."""
        return f"{self.run_base}/progress"

    def rates(self) -> str:
        """JSON: the fetch rates (MB/s) per tier the job's replays measured (``replay.measured_rates``)."""
        return f"{self.run_base}/rates"

    def kill_time(self, stage: int) -> str:
        """Fault injection only: when the injected SIGKILL of ``stage`` was sent."""
        return f"{self.run_base}/kill_time/{stage}"


def as_str(v: Any) -> str:
    """A store value as text (the store client returns bytes)."""
    return v.decode() if isinstance(v, bytes) else str(v)


_WAIT_HINT = "is the replacement running, and does it reach the store? raise rejoin_timeout for slow replays"


def wait_for_keys(
    store: dist.Store,
    keys: list[str],
    *,
    timeout: datetime.timedelta,
    what: str,
    abort_keys: list[str] | None = None,
    max_poll_s: float = 0.02,
) -> dict[str, str]:
    """Poll until every key in ``keys`` exists; return their values.

    The poll period grows from 1 ms to ``max_poll_s`` (how late a key may be noticed, traded
    against store requests while waiting). Raises RecoveryFailedError as soon as one of
    ``abort_keys`` appears (its value in the message), RecoveryTimeoutError after ``timeout``
    naming the keys still missing.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    sleep = 1e-3
    while True:
        for ak in abort_keys or ():
            if store.check([ak]):
                raise RecoveryFailedError(f"{what}: gave up, {ak} = {as_str(store.get(ak))}")
        missing = [k for k in keys if not store.check([k])]
        if not missing:
            return {k: as_str(store.get(k)) for k in keys}
        if time.monotonic() >= deadline:
            raise RecoveryTimeoutError(
                f"{what}: still missing after {timeout.total_seconds():g} s: {missing}",
                hint=_WAIT_HINT,
            )
        time.sleep(sleep)
        sleep = min(sleep * 1.5, max_poll_s)


def wait_until_woken(store: dist.Store, keys: RecoveryKeys, g: int, *, timeout: datetime.timedelta, what: str) -> str:
    """Block in the store until generation ``g``'s wake-up key is set: every replacement reported
    ready (``"ready"``) or recovery was abandoned (``"fallback"``); return that value.

    One ``Store.wait``: woken the moment the key is set, no polling while the replay runs.
    Raises RecoveryTimeoutError (naming ``what``) after ``timeout``.
    """
    try:
        store.wait([keys.wake(g)], timeout)
    except dist.DistStoreError as e:
        raise RecoveryTimeoutError(
            f"{what}: not ready after {timeout.total_seconds():g} s",
            hint=_WAIT_HINT,
        ) from e
    return as_str(store.get(keys.wake(g)))
