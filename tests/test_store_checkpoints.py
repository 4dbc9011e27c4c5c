"""Checkpoint registrations: caps on meta, documents cross-checked with their names, unregistering.

Registrations make logs garbage, so a wrong one must be refusable before it is stored, visible
when it is damaged, and undoable once it is stored. The cold-tier cases run over every backend
(``cold_env``: file://, moto S3, SeaweedFS).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from logstore import Channel, Kind, LogStore, RecordKey
from logstore.errors import ConfigError, RecordNotFoundError
from logstore.hot import HotTier

ACT = Channel.activation(1)  # received by stage 2: stage 2's checkpoints govern it


def _deep(levels: int) -> dict:
    meta: dict = {}
    cur = meta
    for _ in range(levels - 1):
        cur["a"] = {}
        cur = cur["a"]
    return meta


def _fill(store: LogStore, iters: range) -> None:
    for it in iters:
        store.put(RecordKey(ACT, it, 0), torch.full((4,), float(it)))


def test_checkpoint_meta_is_capped_in_depth_and_size(tmp_path: Path) -> None:
    """M4: a meta nested 400 deep was stored, and from then on every summary of the run failed to
    serialise (500, a traceback in ``stat --json``). Depth and size are refused before storing,
    naming the limit; what fits is stored as given."""
    with LogStore.open(tmp_path, "run1", writer="stage2") as s:
        with pytest.raises(ConfigError, match=r"meta of stage 2 iteration 4 .*nested more than 16 levels deep"):
            s.register_checkpoint(2, 4, meta=_deep(400))
        with pytest.raises(ConfigError, match=r"meta of stage 2 iteration 4 .*more than 16384"):
            s.register_checkpoint(2, 4, meta={"x": "y" * 20_000})
        with pytest.raises(ConfigError, match=r"meta must be a JSON object"):
            s.register_checkpoint(2, 4, meta=[1, 2])  # type: ignore[arg-type]
        assert s.checkpoints() == [] and s.watermarks() == {}
        s.register_checkpoint(2, 4, meta=_deep(16))
        assert s.checkpoints()[0].meta == _deep(16)


def test_a_registration_stored_over_the_caps_is_read_with_its_meta_replaced(tmp_path: Path) -> None:
    """M4: registrations stored before the caps existed stay readable: the registration stands,
    its meta is replaced by a note (it used to fail every read of the run's checkpoints)."""
    with LogStore.open(tmp_path, "run1", writer="stage2") as s:
        s.hot.put_doc(
            "ckpt/stage00002/000000000004",
            {"stage": 2, "iteration": 4, "uri": None, "registered_at": 1.0, "meta": _deep(400)},
        )
        (c,) = s.checkpoints()
        assert (c.stage, c.iteration) == (2, 4) and "nested more than 16 levels deep" in c.meta["unreadable_meta"]
        assert s.watermarks() == {2: 4}


def test_a_registration_whose_content_disagrees_with_its_name_is_left_out(tmp_path: Path, cold_env, caplog) -> None:
    """L5: documents were keyed by content, not by name: a bit flip in ``iteration`` raised the
    watermark (the next GC deleted logs a replay needs), and an unknown field made every read a
    TypeError (a 500, a GC fault). The content is cross-checked with the name (a mismatch is left
    out, warned about and listed by verify); an unknown field is ignored with a warning."""
    cold = {"cold_url": cold_env.url, "cold_options": cold_env.storage_options}
    s = LogStore.open(tmp_path / "node", "run1", writer="stage2", **cold)
    _fill(s, range(8))
    s.flush()
    s.register_checkpoint(2, 4, uri="file:///ckpt/2/4.pt")
    flipped = {"stage": 2, "iteration": 4 | 1 << 40, "uri": "file:///ckpt/2/6.pt", "registered_at": 2.0, "meta": {}}
    s.cold.put_doc("run1/checkpoints/stage00002/000000000006.json", flipped)
    s.hot.put_doc("ckpt/stage00002/000000000007", {**flipped, "iteration": 5})
    s.cold.put_doc(
        "run1/checkpoints/stage00003/000000000002.json",
        {"stage": 3, "iteration": 2, "uri": None, "registered_at": 3.0, "meta": {}, "signed_by": "a newer writer"},
    )
    with caplog.at_level(logging.WARNING, logger="logstore._retention"):
        r = LogStore.open(tmp_path / "node", "run1", **cold)
        assert [(c.stage, c.iteration) for c in r.checkpoints()] == [(2, 4), (3, 2)]
        assert r.watermarks() == {2: 4, 3: 2}
        assert sorted(k.iteration for k in r.keys(ACT)) == [4, 5, 6, 7]
        rep = r.gc()
        assert rep.hot_records == 4 and r.watermarks() == {2: 4, 3: 2}
    text = caplog.text
    assert "its content says stage 2 iteration 1099511627780, its name stage 2 iteration 6" in text
    assert "its content says stage 2 iteration 5, its name stage 2 iteration 7" in text
    assert "unknown field(s) signed_by" in text
    problems = [p for p in r.verify().problems if "checkpoint registration" in p["error"]]
    assert sorted(p["where"] for p in problems) == [
        "ckpt/stage00002/000000000007 in " + str(tmp_path / "node" / "run1" / "stage2"),
        "run1/checkpoints/stage00002/000000000006.json",
    ], problems
    r.close()
    s.close()


def test_unregister_lowers_the_watermark_in_every_process(tmp_path: Path) -> None:
    """M4/L4: a wrong registration could not be undone: unregistering left the watermark where it
    was in every process that had seen it (a long-lived server kept hiding the records), and a
    store opened without a writer (the server, the CLI) could not remove a registration from the
    hot indexes at all. Now the registrations as they stand decide, in every process."""
    w = LogStore.open(tmp_path, "run1", writer="stage1")
    _fill(w, range(10))
    server = LogStore.open(tmp_path, "run1")  # a reader that lives on, like the admin server
    w.register_checkpoint(2, 4, uri="file:///ckpt/2/4.pt")
    server.register_checkpoint(2, 9, uri="file:///ckpt/2/9.pt")  # the wrong one, through the server: in a hot index
    assert server.watermarks() == w.watermarks() == {2: 9}
    with pytest.raises(RecordNotFoundError, match="garbage-collected"):
        server.get(RecordKey(ACT, 6, 0))
    gone = LogStore.open(tmp_path, "run1").unregister_checkpoint(2, 9)
    assert gone is not None and gone.uri == "file:///ckpt/2/9.pt"
    assert server.watermarks() == w.watermarks() == {2: 4}
    assert torch.equal(server.get(RecordKey(ACT, 6, 0)), torch.full((4,), 6.0))
    assert [c.iteration for c in server.checkpoints()] == [4]
    assert server.unregister_checkpoint(2, 9) is None  # nothing left to remove
    for h in (HotTier(tmp_path / "run1" / "stage1", owner=False),):
        assert list(h.docs("ckpt/")) == ["ckpt/stage00002/000000000004"]
        h.close()
    server.close()
    w.close()


def test_unregister_preview_shows_what_the_remaining_registrations_keep(tmp_path: Path) -> None:
    """M4: before confirming, an operator sees the effect: the watermarks before and after, what a
    GC would delete now, and what it would delete once the registration is gone. The preview
    changes nothing."""
    with LogStore.open(tmp_path, "run1", writer="stage1", segment_iters=2) as s:
        _fill(s, range(10))
        s.register_checkpoint(2, 4)
        s.register_checkpoint(2, 8)
        p = s.preview_unregister(2, 8)
        assert p.checkpoint.iteration == 8
        assert p.watermarks_before == {2: 8} and p.watermarks_after == {2: 4}
        assert p.gc_before.dry_run and p.gc_before.hot_records == 8 and p.gc_after.hot_records == 4
        assert s.watermarks() == {2: 8} and [c.iteration for c in s.checkpoints()] == [4, 8]  # unchanged
        p4 = s.preview_unregister(2, 4)  # an older one: the watermark stays, GC frees the same
        assert p4.watermarks_after == {2: 8} and p4.gc_after.hot_records == p4.gc_before.hot_records == 8
        assert s.preview_unregister(2, 5) is None
        s.unregister_checkpoint(2, 8)
        assert s.gc().hot_records == 4 and sorted(k.iteration for k in s.keys(ACT)) == [4, 5, 6, 7, 8, 9]


def test_checkpoint_meta_written_by_an_older_version_round_trips(tmp_path: Path) -> None:
    """Documents written before this change (no unknown fields, flat meta) read as before."""
    with LogStore.open(tmp_path, "run1", writer="stage2") as s:
        doc = {
            "stage": 2,
            "iteration": 4,
            "uri": "file:///c.pt",
            "registered_at": 5.0,
            "meta": {"logging_groups": [2, 2]},
        }
        s.hot.put_doc("ckpt/stage00002/000000000004", doc)
        assert json.loads(json.dumps(doc)) == doc
        (c,) = s.checkpoints()
        assert (c.stage, c.iteration, c.uri, c.registered_at, c.meta) == (
            2,
            4,
            "file:///c.pt",
            5.0,
            {"logging_groups": [2, 2]},
        )


@pytest.mark.slow
def test_without_a_cold_tier_every_node_learns_the_registrations_that_free_its_logs(tmp_path: Path) -> None:
    """M7: without a cold tier a registration lived only in the registering node's index, so GC on
    the node holding what that stage received (the sender's node) never freed it and the disk
    filled. A real 4-stage pipeline, one store root per stage (four nodes), no cold tier: each
    client publishes its registrations in the commit store and takes the others' before its GC,
    so every node frees exactly what lies below the receivers' checkpoints."""
    from tests._client_mp import NUM_STAGES, run_pipeline

    roots = {k: tmp_path / f"node{k}" for k in range(NUM_STAGES)}
    per_stage = {k: ["--store-root", str(roots[k]), "--checkpoint-url", (tmp_path / "ckpt").as_uri()] for k in roots}
    run = run_pipeline(tmp_path, "m7", schedule="gpipe", iters=6, ckpt_at="4", cold=False, per_stage=per_stage)
    for k, root in roots.items():
        with LogStore.open(root, run.run_id) as s:
            assert s.watermarks() == dict.fromkeys(range(NUM_STAGES), 4), (k, s.checkpoints())
            held = {(key.channel.name, key.iteration) for key in s.keys()}
            sent = [c for c in s.channels() if c.kind in (Kind.ACTIVATION, Kind.GRADIENT)]
            assert sent and all(c.src == k for c in sent), (k, sent)  # a node holds what its stage sent
            for ch in sent:  # owned by the receiver: below its checkpoint, gone from this node's disk
                left = sorted(it for name, it in held if name == ch.name)
                assert left == [4, 5], (k, ch.name, left)
            for w in s.writers():
                h = HotTier(root / run.run_id / w, owner=False)
                try:
                    assert sorted({key.iteration for key, _ in h.keys()}) == [4, 5], (k, w)
                finally:
                    h.close()


def test_a_client_says_when_its_registrations_cannot_reach_other_nodes(tmp_path: Path, caplog) -> None:
    """M7: with neither a cold tier nor a commit store, nothing carries a registration to the nodes
    holding what the stage received: the client says so when it starts, instead of letting the
    disks fill in silence. With a commit store it publishes there (a real TCPStore on loopback)."""
    from trainer_client import ClientConfig, SwiftlogClient
    from trainer_client.commit import SharedRegistrations, loopback_store

    cfg = ClientConfig(run_id="r", stage=1, num_stages=2, store_root=str(tmp_path / "a"))
    with caplog.at_level(logging.WARNING, logger="trainer_client.client"):
        SwiftlogClient(cfg).close()
    assert "no cold tier and no commit store" in caplog.text and "never free it" in caplog.text
    caplog.clear()
    store = loopback_store()
    cfg = ClientConfig(run_id="r", stage=1, num_stages=2, store_root=str(tmp_path / "b"))
    with caplog.at_level(logging.WARNING, logger="trainer_client.client"):
        client = SwiftlogClient(cfg, commit_store=store)
    client.checkpoint(3, torch.nn.Linear(2, 2))
    client.close()
    assert "no commit store" not in caplog.text
    (doc,) = SharedRegistrations(store, prefix="swiftlog/r", stage=0, num_stages=2).others()
    assert (doc["stage"], doc["iteration"]) == (1, 3) and doc["uri"].endswith("it000000000003.pt")


def test_run_documents_round_trip_in_both_tiers_and_refuse_what_is_not_json(tmp_path: Path) -> None:
    from logstore.errors import InvalidNameError

    cold = f"file://{tmp_path / 'cold'}"
    with LogStore.open(tmp_path / "a", "r", cold_url=cold) as st:
        assert st.get_document("profile") is None
        st.put_document("profile", {"num_stages": 4, "bytes": [1.5, 2]})
        assert st.get_document("profile") == {"num_stages": 4, "bytes": [1.5, 2]}
        with pytest.raises(ConfigError, match="not portable JSON"):
            st.put_document("profile", {"x": float("nan")})
        with pytest.raises(ConfigError, match="JSON object"):
            st.put_document("profile", [1, 2])  # type: ignore[arg-type]
        with pytest.raises(InvalidNameError):
            st.put_document("../escape", {})
    with LogStore.open(tmp_path / "b", "r", cold_url=cold) as other:  # another node: through the cold tier
        assert other.get_document("profile") == {"num_stages": 4, "bytes": [1.5, 2]}
    with LogStore.open(tmp_path / "c", "r", writer="w") as hot_only:  # no cold tier: this node's hot tier
        hot_only.put_document("profile", {"k": 1})
        assert hot_only.get_document("profile") == {"k": 1}
