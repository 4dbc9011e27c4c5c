"""Where a replay reads its records: the hot tier, the cold tier (moto S3), node servers over HTTP.

Every source feeds an identical replay; a record on a survivor's disk is read there, not from the
object store; a corrupt or missing record fails the replay naming it; an unreachable node server
falls through to the next source; listings are shared and keys asked first of the source that
listed them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from logstore import Channel, LogStore, RecordKey
from logstore.errors import CorruptRecordError
from replay import (
    RemoteLogReader,
    SourceSpec,
    jobs_from_plan,
    plan_recovery,
    replay,
    replay_stage,
)
from replay.core import locate_logs
from replay.errors import ReplayInputMissingError
from replay.reader import LogReader
from replay.states import build_states, checkpoint_of
from server.testing import ServerProcess
from tests._replay_helpers import (
    CKPT,
    ITERS,
    NUM_STAGES,
    checkpoint_vs_live,
    copy_run_files,
    corrupt_hot_record,
    job_for,
    state_bytes_differ,
)
from trainer_client.examples.gpt import loss_fn

pytest_plugins = ["tests._replay_fixtures"]


class _ListingCounter:
    """A record source that counts its listings (``keys`` / ``list_records`` calls)."""

    def __init__(self, inner):
        self.inner, self.listings = inner, 0

    def keys(self, *a, **kw):
        self.listings += 1
        return self.inner.keys(*a, **kw)

    def list_records(self, *a, **kw):
        self.listings += 1
        return self.inner.list_records(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_locate_logs_lists_ahead_of_the_replay_and_never_raises(f1b_run, tmp_path):
    with f1b_run.store() as st:
        src = _ListingCounter(st)
        reader = LogReader([src])
        locate_logs(reader, [1], NUM_STAGES, CKPT)
        listed = src.listings
        assert listed > 0 and reader.meta(1, CKPT) is not None
        assert reader.part_keys(Channel.activation(0), CKPT, 0) and reader.part_keys(Channel.gradient(2), CKPT, 1)
        assert src.listings == listed  # the replay's first iteration finds them listed already
    with LogStore.open(tmp_path / "empty", "other-run") as empty:
        locate_logs(LogReader([empty]), [1], NUM_STAGES, CKPT)  # nothing there: left for the replay to report


@pytest.mark.slow
def test_replay_from_the_cold_tier_equals_replay_from_the_hot_tier(gpipe_s3_run, tmp_path):
    run = gpipe_s3_run
    hot = replay(job_for(run, 2, tmp_path / "hot", sources=[run.spec(cold=False)]))
    cold = replay(job_for(run, 2, tmp_path / "cold", sources=[run.cold_spec()]))
    assert hot.verified and cold.verified
    a, b = checkpoint_of(hot, 2), checkpoint_of(cold, 2)
    assert state_bytes_differ(a.model, a.optimizer, b.model, b.optimizer) == [] and a.lr_scheduler == b.lr_scheduler
    assert checkpoint_vs_live(b, run.results[2]) == []
    # the cold tier really served it: a cold-only store lists the records and has no hot tier
    with run.cold_store() as st:
        assert st.keys(Channel.activation(1), CKPT, ITERS) and st.stats()["hot"]["records"] == 0


def test_replay_through_a_node_server(f1b_run, tmp_path):
    with ServerProcess(Path(f1b_run.root), cold_url=f1b_run.cold_url) as srv:
        res = replay(job_for(f1b_run, 1, tmp_path, sources=[SourceSpec.parse(srv.url)]))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []
        with RemoteLogReader(srv.url, f1b_run.run_id) as reader:
            st = build_states(job_for(f1b_run, 2, tmp_path))[0]
            rep = replay_stage(st, reader, num_stages=NUM_STAGES, stop_iteration=ITERS, loss_fn=loss_fn, prefetch=1)
            assert rep.verified and rep.records_fetched > 0
            missing = RecordKey(Channel.activation(1), ITERS + 5, 0)
            with pytest.raises(ReplayInputMissingError) as ei:  # the server answers 404 for what it does not have
                reader.get(missing)
            assert ei.value.key == missing and str(missing) in str(ei.value)


@pytest.mark.slow
def test_the_python_api_plans_and_replays_over_a_node_server_and_a_root(f1b_run, tmp_path):
    """README's Python snippet with a node server among the sources: plan_recovery reads it through
    its API, jobs_from_plan turns each source object into its spec, the replay is exact."""
    from replay.remote import HttpRecordSource

    with (
        ServerProcess(Path(f1b_run.root)) as srv,
        HttpRecordSource(srv.url, f1b_run.run_id) as http,
        LogStore.open(f1b_run.root, f1b_run.run_id) as st,
        f1b_run.cold_store() as cold,
    ):
        plan = plan_recovery([http, st, cold], [1])
        # inputs and digests from the server (first, and it holds them hot); the failed stage's own META from
        # the cold tier
        # (its hot copy is on the failed stage's node: read only if nothing else has it)
        assert plan.possible and {(f.purpose, f.source) for f in plan.units[0].fetch} == {
            ("input", 0),
            ("verify", 0),
            ("meta", 2),
        }
        (job,) = jobs_from_plan(plan, sources=[http, st, cold], output=str(tmp_path / "out"), **f1b_run.job_fields())
        assert [(sp.kind, sp.location) for sp in job.sources] == [
            ("http", srv.url),
            ("store", f1b_run.root),
            ("cold", f1b_run.cold_url),
        ]
        res = replay(job)
    assert res.verified and checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []


def test_a_record_on_a_survivors_disk_is_read_there_not_from_the_object_store(f1b_run, tmp_path):
    """Sources in the order cold tier, node root: every record is asked of the node first (its hot
    tier lists it), not of the object store that listed it first (was: all of them from there)."""

    class Counting:  # the run's cold tier, counting what is read from it
        def __init__(self, inner):
            self.inner, self.gets = inner, 0

        def get(self, key):
            self.gets += 1
            return self.inner.get(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with f1b_run.cold_store() as cold, LogStore.open(f1b_run.root, f1b_run.run_id) as node:
        counting = Counting(cold)
        res = replay(job_for(f1b_run, 1, tmp_path), sources=[counting, node])
        assert res.verified and res.report.records_fetched > 0 and counting.gets == 0
    assert checkpoint_vs_live(checkpoint_of(res, 1), f1b_run.results[1]) == []


def test_a_corrupt_record_fails_the_replay_naming_it(f1b_run, tmp_path):
    root, _ = copy_run_files(f1b_run, tmp_path)
    key = RecordKey(Channel.gradient(3), 4, 2, 0)
    corrupt_hot_record(root, f1b_run.run_id, key)
    src = SourceSpec(kind="store", location=root)  # the node's hot tiers: their copy is the corrupt one
    with pytest.raises(CorruptRecordError) as ei:
        replay(job_for(f1b_run, 2, tmp_path, sources=[src], prefetch=2))
    assert str(key) in str(ei.value) and ei.value.key == key
    with LogStore.open(root, f1b_run.run_id) as st:
        plan = plan_recovery(st, [2], check_records=True)
    assert not plan.possible and plan.units[0].missing == [str(key)]


def test_a_missing_record_fails_the_replay_naming_it(f1b_run, tmp_path):
    _, cold = copy_run_files(f1b_run, tmp_path)
    seg_dir = Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "grad_2_1"
    for p in seg_dir.glob("000000000004-*"):
        p.unlink()
    src = SourceSpec(kind="cold", location=cold)
    with pytest.raises(ReplayInputMissingError) as ei:
        replay(job_for(f1b_run, 1, tmp_path, sources=[src]))
    assert str(ei.value.key) == "grad_2_1/it4/mb0/p0" and "grad_2_1" in str(ei.value)
    assert not (tmp_path / "out").exists()  # nothing is written when the replay failed


def test_an_unreachable_node_server_falls_through_to_the_next_source(f1b_run, tmp_path):
    from logstore.testing import free_port
    from replay.plan import cold_only_store

    dead = f"http://127.0.0.1:{free_port()}"
    with (
        cold_only_store(f1b_run.cold_url, f1b_run.run_id) as cold,
        RemoteLogReader(dead, f1b_run.run_id, fallback=[cold], retries=1) as reader,
    ):
        st = build_states(job_for(f1b_run, 1, tmp_path))[0]
        rep = replay_stage(st, reader, num_stages=NUM_STAGES, stop_iteration=ITERS, loss_fn=loss_fn)
    assert rep.verified
    from replay.errors import NodeUnavailableError
    from replay.remote import HttpRecordSource

    with HttpRecordSource(dead, f1b_run.run_id, retries=1) as src, pytest.raises(NodeUnavailableError) as ei:
        src.get(RecordKey(Channel.activation(0), CKPT, 0))
    assert ei.value.retryable and "unavailable" in str(ei.value)
    # every source unlistable: no plan of zero iterations "verified" (a QA check: a node server answering 500),
    # but why not
    with (
        HttpRecordSource(dead, f1b_run.run_id, retries=1) as src,
        pytest.raises(ValueError, match=r"no source could be read: listing channels of"),
    ):
        plan_recovery([src], [1])
    with HttpRecordSource(dead, f1b_run.run_id, retries=1) as src:  # the checkpoints known, the logs not
        plan = plan_recovery([src], [1], num_stages=NUM_STAGES)
    assert not plan.possible and plan.units[0].reasons[0].startswith(
        "no source could list the run's logs: listing channels of"
    ), plan.reasons


class _SlowListing:
    """A real store whose key listings take 50 ms and are counted (to make two readers overlap)."""

    def __init__(self, inner: LogStore) -> None:
        self.inner, self.listings = inner, 0

    def get(self, key):
        return self.inner.get(key)

    def keys(self, channel=None, it_lo=0, it_hi=None):
        self.listings += 1
        time.sleep(0.05)
        return self.inner.keys(channel, it_lo, it_hi)

    def gaps(self):
        return self.inner.gaps()


def test_concurrent_listings_of_one_window_share_one_call_per_source(f1b_run):
    with f1b_run.store() as st:
        src = _SlowListing(st)
        reader = LogReader([src])
        ch = Channel.activation(0)
        with ThreadPoolExecutor(4) as pool:  # the compute and the prefetch thread start on the same iteration
            got = list(pool.map(lambda mb: reader.part_keys(ch, CKPT, mb % 2), range(4)))
        assert src.listings == 1
        assert got[0] == got[2] == st.keys(ch, CKPT, CKPT + 1)[: len(got[0])] and got[0] and got[1] and got[0] != got[1]
        assert reader.part_keys(ch, CKPT + 1, 0) and src.listings == 1  # the window was listed at once


class _CountingGets:
    def __init__(self, inner: LogStore) -> None:
        self.inner, self.gets = inner, 0

    def get(self, key):
        self.gets += 1
        return self.inner.get(key)

    def keys(self, channel=None, it_lo=0, it_hi=None):
        return self.inner.keys(channel, it_lo, it_hi)

    def gaps(self):
        return self.inner.gaps()


def test_a_key_is_asked_first_of_the_source_that_listed_it(f1b_run, tmp_path):
    with LogStore.open(str(tmp_path / "empty"), f1b_run.run_id) as empty, f1b_run.store() as full:
        a, b = _CountingGets(empty), _CountingGets(full)
        reader = LogReader([a, b])
        ch = Channel.activation(1)
        parts = reader.require_parts(ch, CKPT, 1)
        assert parts and a.gets == 0 and b.gets == len(parts)
        assert all(torch.equal(p, full.get(k)) for p, k in zip(parts, reader.part_keys(ch, CKPT, 1), strict=True))
        with pytest.raises(ReplayInputMissingError):  # a key nobody listed is still looked for everywhere
            reader.get(RecordKey(ch, ITERS + 5, 0))
        assert a.gets == 1 and b.gets == len(parts) + 1
