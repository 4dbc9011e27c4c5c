"""What the stores of a recovery plan hold, listed once: :class:`LogIndex`.

The planner asks the same questions many times (which micro-batches of a channel are listed in an
iteration, a stage's META of an iteration), so :class:`LogIndex` lists and reads each answer once
and keeps it: checkpoint registrations, channels, gaps, key indexes per channel, META documents. A
node root whose cold tier cannot be read is planned from its hot tiers alone, with a warning.
:func:`cold_only_store` opens a store that sees only a cold tier.

Never: writes to a store, or reads activation or gradient bytes (only indexes and META).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

from logstore import Channel, LogStore, RecordKey
from logstore.errors import ColdTierError, ColdTierUnavailableError, StoreError, SwiftlogError
from trainer_client.meta import decode_meta

__all__ = ["LogIndex", "cold_only_store"]


def cold_only_store(
    store_or_url: LogStore | str, run: str | None = None, options: dict[str, Any] | None = None
) -> LogStore:
    """A read-only LogStore that sees only a cold tier (no hot tier is ever opened).

    Give a LogStore (its run and cold tier are used) or a cold URL with ``run`` and fsspec
    ``options``. The caller closes it.
    """
    if isinstance(store_or_url, LogStore):
        if store_or_url.cold is None or not store_or_url.config.cold_url:
            raise ValueError(f"store of run {store_or_url.run!r} has no cold tier")
        url, run, options = store_or_url.config.cold_url, store_or_url.run, dict(store_or_url.config.cold_options)
    else:
        url = store_or_url
        if run is None:
            raise ValueError("cold_only_store(url) needs run=")
    # a root that does not exist: LogStore lists hot tiers under root/run only if it is a directory
    root = os.path.join(tempfile.gettempdir(), f"swiftlog-cold-only-{uuid.uuid4().hex}")
    return LogStore.open(root, run, cold_url=url, cold_options=dict(options or {}))


class LogIndex:
    """The listings and META documents of ``stores`` (in preference order), cached.

    ``warnings`` is the planner's list: what could not be listed or read goes there. ``channel_set``:
    every channel any store lists (set by the planner once listed); ``unlisted``: why no store could
    list its channels, when none could; ``metas``: the META documents read, by (stage, iteration).
    """

    def __init__(self, stores: list[LogStore], warnings: list[str]) -> None:
        self.stores = stores
        self.warnings = warnings
        self._keys: dict[Channel, dict[int, dict[int, set[int]]]] = {}  # channel -> it -> mb -> parts
        self._keys_lo: dict[Channel, int] = {}
        self._views: list[tuple[int, LogStore]] | None = None
        self._hot_views: list[LogStore] = []
        self.channel_set: set[Channel] | None = None
        # every source failed to list its channels (the reasons): nothing is known of the logs
        self.unlisted: list[str] = []
        self.metas: dict[tuple[int, int], dict[str, Any] | None] = {}

    def close(self) -> None:
        for v in [*(v for _, v in self._views or []), *self._hot_views]:
            v.close()

    def hot_only_where_the_cold_tier_is_down(self) -> None:
        """A node root whose cold tier cannot be listed is planned from its hot tiers alone (a
        view of the same root without the cold tier), with a warning: a recovery during an
        object-store outage uses what the survivors' disks hold. A cold-only source stays as it
        is (its error is the plan's)."""
        for i, s in enumerate(self.stores):
            if s.cold is None or s.is_cold_only():
                continue
            try:
                s.checkpoints()  # lists the cold tier's registrations
            except (
                ColdTierUnavailableError,
                ColdTierError,
            ) as e:  # down, or refusing (credentials, bucket, permissions)
                view = LogStore.open(s.root, s.run)
                self._hot_views.append(view)
                self.stores[i] = view
                self.warnings.append(
                    f"the cold tier of {self.describe(s)} cannot be read ({e.message}): planned from that root's hot "
                    "tiers only (the checkpoints registered on this node; records only the cold tier holds are not "
                    "considered)"
                )

    def checkpoints(self) -> dict[int, dict[int, Any]]:
        out: dict[int, dict[int, Any]] = {}
        for s in self.stores:
            try:
                found = s.checkpoints()
            except StoreError as e:
                if not (hasattr(s, "describe") and e.retryable):
                    raise
                self.warnings.append(
                    f"{self.describe(s)} is unreachable, planned without it: {e.message}"
                )  # a node server down
                continue
            for c in found:
                out.setdefault(c.stage, {})[c.iteration] = c
        return out

    def channels(self) -> set[Channel]:
        found: set[Channel] = set()
        failures = []
        for s in self.stores:
            try:
                found.update(s.channels())
            except SwiftlogError as e:
                failures.append(f"listing channels of {self.describe(s)} failed: {e}")
        self.warnings.extend(failures)
        if self.stores and len(failures) == len(
            self.stores
        ):  # knowing nothing of the logs is no plan of zero iterations
            self.unlisted = failures
        return found

    def gaps(self) -> list[dict[str, Any]]:
        seen: dict[tuple, dict[str, Any]] = {}
        for s in self.stores:
            try:
                for g in s.gaps():
                    seen[(g["channel"], g["iteration"], g["micro_batch"])] = g
            except SwiftlogError as e:
                self.warnings.append(f"reading the gaps of {self.describe(s)} failed: {e}")
        return [seen[k] for k in sorted(seen)]

    def index(self, ch: Channel, lo: int) -> dict[int, dict[int, set[int]]]:
        """iteration -> micro-batch -> parts of ``ch`` listed by any store (at least from ``lo`` on)."""
        if ch in self._keys and self._keys_lo[ch] <= lo:
            return self._keys[ch]
        if self.channel_set is not None and ch not in self.channel_set:
            return {}  # no store holds any record of it: no listing needed (pipelines can be wide)
        idx: dict[int, dict[int, set[int]]] = {}
        for s in self.stores:
            try:
                for k in s.keys(ch, lo, None):
                    idx.setdefault(k.iteration, {}).setdefault(k.micro_batch, set()).add(k.part)
            except SwiftlogError as e:
                self.warnings.append(f"listing {ch.name} in {self.describe(s)} failed: {e}")
        self._keys[ch] = idx
        self._keys_lo[ch] = lo
        return idx

    def meta(self, stage: int, it: int) -> dict[str, Any] | None:
        k = (stage, it)
        if k not in self.metas:
            self.metas[k] = self.meta_record(stage, it, 0)
        return self.metas[k]

    def own_meta(self, stage: int, it: int, lo: int) -> dict[str, Any]:
        """``stage``'s own META document of ``it`` where a store lists it (from ``lo`` on), else {}."""
        return (self.meta(stage, it) or {}) if it in self.index(Channel.meta(stage), lo) else {}

    def meta_record(self, stage: int, it: int, micro_batch: int) -> dict[str, Any] | None:
        """A META record (micro-batch 0: the document; 1: its amendment) from the first store that
        has it intact, or None."""
        for s in self.stores:
            try:
                return decode_meta(s.get(RecordKey(Channel.meta(stage), it, micro_batch)))
            except SwiftlogError:
                continue
            except ValueError:  # not JSON: treat as absent
                continue
        return None

    def any_meta(self, it: int, prefer: Sequence[int], num_stages: int) -> tuple[int, dict[str, Any]] | None:
        for k in list(prefer) + [k for k in range(num_stages) if k not in prefer]:
            if it in self.index(Channel.meta(k), 0) and (m := self.meta(k, it)) is not None:
                return k, m
        return None

    def describe(self, s: LogStore) -> str:
        if hasattr(s, "describe"):  # a node server (replay.remote.HttpRecordSource)
            return str(s.describe())
        cold = getattr(s.config, "cold_url", None)
        return f"store root {s.root}" + (f" + cold tier {cold}" if cold else "")

    def cold_views(self) -> list[tuple[int, LogStore]]:
        """(store index, cold-only view) for every store with a cold tier: a record listed hot on a
        failed stage's writer may also be in the cold tier, which a replacement can always read."""
        if self._views is None:
            self._views = []
            for i, s in enumerate(self.stores):
                if (
                    s.cold is None
                    or not s.config.cold_url
                    or any(v.config.cold_url == s.config.cold_url for _, v in self._views)
                ):
                    continue
                self._views.append((i, cold_only_store(s)))
        return self._views
