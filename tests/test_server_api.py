"""The admin API, over a real uvicorn server in a subprocess and a store written by real writer processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import xxhash

from logstore import codec
from logstore.keys import Channel, Kind, RecordKey
from server.testing import TOKEN, ServerProcess, StoreFixture, sample_tensor, start_writer, stop_writer, subprocess_env

pytest_plugins = ["server.pytest_fixtures"]


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=api_server.url, timeout=30) as c:
        yield c


def _all_pages(client: httpx.Client, run: str, **params: object) -> list[dict]:
    out, cursor = [], None
    while True:
        q = {**params, **({"cursor": cursor} if cursor else {})}
        r = client.get(f"/v1/runs/{run}/records", params=q)
        assert r.status_code == 200, r.text
        page = r.json()
        out += page["records"]
        cursor = page["next_cursor"]
        if cursor is None:
            return out


def test_health_and_runs(client: httpx.Client, written_store: StoreFixture) -> None:
    h = client.get("/v1/health").json()
    assert h["status"] == "ok" and h["root_exists"] and h["cold_tier"] and h["auth"] == "token" and h["runs"] == 1
    runs = client.get("/v1/runs").json()["runs"]
    assert runs == [{"run": "run-a", "writers": ["stage0", "stage1", "stage2", "stage3"]}]


def test_summary(client: httpx.Client, written_store: StoreFixture) -> None:
    s = client.get("/v1/runs/run-a", params={"fresh": "true"}).json()
    assert s["stages"] == [0, 1, 2, 3]
    names = {c["name"] for c in s["channels"]}
    assert {"act_0_1", "act_2_3", "grad_3_2", "grad_1_0", "input_0", "target_3", "digest_3_2", "meta_2"} <= names
    by = {c["name"]: c for c in s["channels"]}
    # stage 3 evicted everything it uploaded: its channels are cold-only, iterations 0..7
    assert by["grad_3_2"]["hot"] is None and by["grad_3_2"]["cold"]["first_iteration"] == 0
    assert by["grad_3_2"]["cold"]["last_iteration"] == 7 and by["grad_3_2"]["cold"]["records"] == 16
    assert by["act_0_1"]["hot"]["records"] == 16 and by["act_0_1"]["owner"] == 1
    assert s["hot"]["writers"] == ["stage0", "stage1", "stage2", "stage3"]
    assert s["hot"]["segments"]["evicted"] > 0 and s["hot"]["segments"]["sealed"] > 0
    assert s["cold"]["segments"] > 0 and s["cold"]["error"] is None
    assert s["raw_bytes"] > 0 and s["stored_bytes"] > 0 and s["compression_ratio"] > 0
    assert s["checkpoints"] == [] and s["watermarks"] == []
    assert [(g["channel"], g["iteration"]) for g in s["gaps"]] == [("act_1_2", 3)]
    # served from the cache within the TTL: same as_of
    assert client.get("/v1/runs/run-a").json()["as_of"] == client.get("/v1/runs/run-a").json()["as_of"]


def test_records_pagination_covers_every_record_once(client: httpx.Client, written_store: StoreFixture) -> None:
    got = _all_pages(client, "run-a", limit=7)
    assert [r["key"] for r in got] == [str(k) for k in written_store.keys()]
    tiers = {r["channel"]: r["tier"] for r in got}
    assert tiers["grad_3_2"] == "cold" and tiers["act_0_1"] == "hot"
    r0 = got[0]
    assert set(r0) == {
        "key",
        "channel",
        "kind",
        "iteration",
        "micro_batch",
        "part",
        "tier",
        "writer",
        "stored_bytes",
        "raw_bytes",
        "checksum",
    }


@pytest.mark.parametrize(
    ("params", "pred"),
    [
        ({"channel": "act_1_2"}, lambda k: k.channel == Channel.activation(1)),
        ({"kind": "gradient"}, lambda k: k.channel.kind is Kind.GRADIENT),
        ({"kind": "target", "it_lo": 2, "it_hi": 5}, lambda k: k.channel.kind is Kind.TARGET and 2 <= k.iteration < 5),
        ({"micro_batch": 1, "it_lo": 6}, lambda k: k.micro_batch == 1 and k.iteration >= 6),
        (
            {"channel": "grad_3_2", "micro_batch": 0, "it_hi": 3},
            lambda k: k.channel == Channel.gradient(3) and k.micro_batch == 0 and k.iteration < 3,
        ),
    ],
)
def test_record_filters(client: httpx.Client, written_store: StoreFixture, params: dict, pred) -> None:
    got = [r["key"] for r in _all_pages(client, "run-a", limit=5, **params)]
    assert got == [str(k) for k in written_store.keys() if pred(k)]
    assert got


def test_record_detail_and_raw_download(client: httpx.Client) -> None:
    for key in (
        RecordKey(Channel.activation(0), 3, 1),
        RecordKey(Channel.gradient(3), 5, 0),
        RecordKey(Channel.input(0), 0, 1),
    ):
        want = sample_tensor(key.channel, key.iteration, key.micro_batch)
        d = client.get(f"/v1/runs/run-a/records/{key}")
        assert d.status_code == 200, d.text
        d = d.json()
        assert (
            d["key"] == str(key)
            and d["shape"] == list(want.shape)
            and d["dtype"] == str(want.dtype).removeprefix("torch.")
        )
        w64 = want.to(torch.float64)
        assert d["stats"]["min"] == pytest.approx(float(w64.min())) and d["stats"]["max"] == pytest.approx(
            float(w64.max())
        )
        assert d["stats"]["mean"] == pytest.approx(float(w64.mean())) and d["stats"]["norm"] == pytest.approx(
            float(w64.norm())
        )
        assert d["tier"] == ("cold" if key.channel.src == 3 else "hot")
        raw = client.get(f"/v1/runs/run-a/records/{key}/raw")
        assert raw.status_code == 200 and raw.headers["content-type"] == "application/octet-stream"
        assert raw.headers["x-swiftlog-checksum"] == f"{xxhash.xxh3_64_intdigest(raw.content):016x}" == d["checksum"]
        assert raw.headers["x-swiftlog-key"] == str(key)
        assert torch.equal(codec.decode_tensor(raw.content), want)
    # short forms of a key: mb and part default to 0
    assert client.get("/v1/runs/run-a/records/meta_2/it4").json()["key"] == "meta_2/it4/mb0/p0"


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/runs/run-a/records/act_0_1/it99/mb0", 404, "record_not_found"),
        ("/v1/runs/run-a/records/act_0_1/it99/mb0/raw", 404, "record_not_found"),
        ("/v1/runs/run-a/records/act_0_5/it1", 400, "invalid_key"),
        ("/v1/runs/run-a/records/bogus", 422, "invalid_request"),
        ("/v1/runs/nope", 404, "run_not_found"),
        ("/v1/runs/nope/records", 404, "run_not_found"),
        ("/v1/runs/run-a/records?cursor=" + "ff" * 19, 400, "bad_request"),
        ("/v1/runs/run-a/records?channel=act_0_1&kind=gradient", 400, "bad_request"),
        ("/v1/runs/run-a/records?it_lo=5&it_hi=2", 400, "bad_request"),
        ("/v1/runs/run-a/records?limit=100000", 422, "invalid_request"),
        ("/v1/runs/run-a/records?limit=0", 422, "invalid_request"),
        ("/v1/runs/run-a/records?it_lo=-1", 422, "invalid_request"),
        ("/v1/nothing-here", 404, "not_found"),
    ],
)
def test_errors_are_json_4xx(client: httpx.Client, path: str, status: int, code: str) -> None:
    r = client.get(path)
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code and body["message"]


def test_recovery_plan_from_the_replay_planner(client: httpx.Client) -> None:
    # the shared store has no registered checkpoint: replay is impossible and the plan says why
    r = client.get("/v1/runs/run-a/recovery-plan", params={"failed": [1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["planner"] == "replay.plan:plan_recovery" and body["failed_stages"] == [1]
    plan = body["plan"]
    assert plan["possible"] is False and plan["recommended"] == "global_rollback"
    assert "no registered checkpoint" in plan["reasons"][0] and plan["fallback"]["iteration"] is None
    assert client.get("/v1/runs/run-a/recovery-plan", params={"failed": [9]}).status_code == 400  # outside the pipeline
    missing = client.get("/v1/runs/run-a/recovery-plan")  # a failed stage (or rank) is required
    assert missing.status_code == 400 and "no failed stage given" in missing.text
    by_rank = client.get("/v1/runs/run-a/recovery-plan", params={"rank": [1], "stages_per_rank": 1})
    assert by_rank.status_code == 200 and by_rank.json()["plan"]["failed_ranks"] == {"1": [1]}
    bad_style = client.get("/v1/runs/run-a/recovery-plan", params={"rank": [1], "stage_style": "w"})
    assert bad_style.status_code == 422
    # the planner's options pass through
    r = client.get(
        "/v1/runs/run-a/recovery-plan",
        params={"failed": [1], "target_iteration": 3, "bandwidth_mbps": 50, "workers": 2},
    )
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan["target_iteration"] == 3 and plan["assumptions"].get("bandwidth_mbps") == 50, plan["assumptions"]
    assert client.get("/v1/runs/run-a/recovery-plan", params={"failed": [1], "bandwidth_mbps": 0}).status_code == 422


def test_metrics(client: httpx.Client) -> None:
    for path in ("/v1/runs/run-a", "/docs", "/openapi.json"):
        assert client.get(path).status_code == 200
    text = client.get("/metrics").text
    for route in ("/v1/runs/{run}", "/docs", "/openapi.json"):  # the schema's routes are routes too, not "unmatched"
        assert f'swiftlog_http_requests_total{{method="GET",route="{route}",status="200"}}' in text, route
    assert "swiftlog_http_request_duration_seconds_bucket" in text
    for tier in ("hot", "cold"):
        line = next(
            ln for ln in text.splitlines() if ln.startswith(f'swiftlog_store_stored_bytes{{run="run-a",tier="{tier}"}}')
        )
        assert float(line.split()[-1]) > 0
    assert 'swiftlog_store_hot_disk_bytes{run="run-a"}' in text


def test_openapi_schema_is_complete(client: httpx.Client) -> None:
    s = client.get("/openapi.json").json()
    paths = s["paths"]
    expected = {
        ("get", "/v1/health"),
        ("get", "/v1/runs"),
        ("get", "/v1/runs/{run}"),
        ("get", "/v1/runs/{run}/records"),
        ("get", "/v1/runs/{run}/records/{key}"),
        ("get", "/v1/runs/{run}/records/{key}/raw"),
        ("get", "/v1/runs/{run}/checkpoints"),
        ("post", "/v1/runs/{run}/checkpoints"),
        ("post", "/v1/runs/{run}/checkpoints/unregister"),
        ("post", "/v1/runs/{run}/gc"),
        ("post", "/v1/runs/{run}/flush"),
        ("get", "/v1/runs/{run}/recovery-plan"),
        ("get", "/v1/runs/{run}/profile"),
        ("get", "/v1/runs/{run}/logging-groups"),
        ("get", "/metrics"),
    }
    assert {(m, p) for p, ops in paths.items() for m in ops} == expected
    for p, ops in paths.items():
        for m, op in ops.items():
            if p == "/metrics":
                continue
            if "{run}" in p:
                assert "404" in op["responses"] and "422" in op["responses"], (m, p)
            ok = op["responses"].get("200") or op["responses"].get("201")
            content = ok["content"]
            assert "application/json" in content or "application/octet-stream" in content
            if m == "post":
                assert op.get("security") == [{"bearerToken": []}], p
    schemas = s["components"]["schemas"]
    assert {
        "RunSummary",
        "RecordPage",
        "RecordDetail",
        "ErrorResponse",
        "CheckpointRequest",
        "GcResult",
        "FlushResult",
    } <= set(schemas)


@pytest.mark.slow
def test_openapi_operations_are_named_and_list_only_their_errors(client: httpx.Client) -> None:
    """operationIds a client generator can use as method names; per route, the errors it can give
    (the HTTP layer's on every route: 421 for a foreign Host, 401 where the token is needed, 400,
    403, 413 and 415 on mutating routes; 422 in the API's error body)."""
    s = client.get("/openapi.json").json()
    ops = {(m, p): op for p, methods in s["paths"].items() for m, op in methods.items()}
    ids = {k: op["operationId"] for k, op in ops.items()}
    assert len(set(ids.values())) == len(ids)
    named = {
        ("get", "/v1/health"): "health",
        ("get", "/v1/runs/{run}/records"): "list_records",
        ("get", "/v1/runs/{run}/records/{key}/raw"): "record_raw",
        ("post", "/v1/runs/{run}/gc"): "gc",
        ("get", "/v1/runs/{run}/recovery-plan"): "recovery_plan",
    }
    assert {k: ids[k] for k in named} == named
    assert all(i.isidentifier() and "_v1_" not in i for i in ids.values()), ids
    errs = {k: {int(c) for c in op["responses"] if int(c) >= 400} for k, op in ops.items()}
    for path in ("/v1/health", "/metrics", "/v1/runs"):
        assert errs[("get", path)] == {421}, path  # reads need no token on this server
    assert errs[("get", "/v1/runs/{run}")] == {404, 421, 422, 503}
    assert errs[("get", "/v1/runs/{run}/records/{key}/raw")] == {400, 404, 409, 421, 422, 502, 503}
    assert errs[("get", "/v1/runs/{run}/recovery-plan")] == {400, 404, 421, 422, 501, 502, 503}
    assert errs[("post", "/v1/runs/{run}/flush")] == {400, 401, 403, 404, 409, 413, 415, 421, 422, 502, 503, 507}
    for (m, p), codes in errs.items():
        assert (m == "post") == ({400, 403, 413, 415} <= codes), (m, p)  # a body is refused only where one is read
        assert (507 in codes) == (m == "post"), (m, p)  # only what writes can find the disk full
        for c in codes:
            schema = ops[(m, p)]["responses"][str(c)]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (m, p, c)
    assert "HTTPValidationError" not in s["components"]["schemas"]


def test_recovery_plan_response_has_a_schema(client: httpx.Client) -> None:
    from replay.plan import FetchItem, ReplayUnit
    from replay.plan import RecoveryPlan as Planned
    from server.models import PlanFetch, PlanUnit, RecoveryPlanDetail

    s = client.get("/openapi.json").json()
    plan = s["components"]["schemas"]["RecoveryPlan"]["properties"]["plan"]
    assert {"$ref": "#/components/schemas/RecoveryPlanDetail"} in plan["anyOf"]
    detail = s["components"]["schemas"]["RecoveryPlanDetail"]["properties"]
    assert detail["units"]["items"] == {"$ref": "#/components/schemas/PlanUnit"}
    # the schema is the default planner's output, field for field
    for model, dc in ((RecoveryPlanDetail, Planned), (PlanUnit, ReplayUnit), (PlanFetch, FetchItem)):
        assert set(model.model_fields) == set(dc.__dataclass_fields__), model
    body = client.get("/v1/runs/run-a/recovery-plan", params={"failed": [1]}).json()
    RecoveryPlanDetail.model_validate(body["plan"])


def test_reads_do_not_block_a_writing_process(store_copy: StoreFixture) -> None:
    """A training process keeps writing (same run, same node) while clients hammer the API."""
    live_ch = Channel.activation(4)
    writer = start_writer(
        store_copy.root,
        store_copy.run,
        writer="stage4",
        channels=[live_ch],
        micro_batches=2,
        shape=(2, 64, 64),
        duration=60,
        sleep=0.02,
    )
    try:
        with (
            ServerProcess(store_copy.root, cold_url=store_copy.cold_url) as srv,
            httpx.Client(base_url=srv.url, timeout=30) as c,
        ):
            stop = threading.Event()
            errors: list[str] = []
            counts = [0]

            def hammer() -> None:
                while not stop.is_set():
                    for path in ("/v1/runs/run-a", "/v1/runs/run-a/records?channel=act_4_5&limit=50", "/metrics"):
                        r = c.get(path)
                        if r.status_code != 200:
                            errors.append(f"{path}: {r.status_code} {r.text[:200]}")
                        counts[0] += 1

            threads = [threading.Thread(target=hammer) for _ in range(3)]
            for t in threads:
                t.start()
            seen: list[int] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(set(seen)) < 3:
                page = c.get("/v1/runs/run-a/records", params={"channel": "act_4_5", "limit": 1000}).json()
                seen.append(len(page["records"]))
                time.sleep(0.3)
            stop.set()
            for t in threads:
                t.join()
            assert not errors, errors[:3]
            assert counts[0] > 10
            assert len(set(seen)) >= 3 and seen == sorted(seen), seen  # the writer kept making progress, visibly
            key = RecordKey(live_ch, 1, 1)
            raw = c.get(f"/v1/runs/run-a/records/{key}/raw")
            assert torch.equal(codec.decode_tensor(raw.content), sample_tensor(live_ch, 1, 1, (2, 64, 64)))
    finally:
        err = stop_writer(writer)
    assert writer.returncode == 0, err


def test_raw_download_streams_and_never_delivers_a_corrupt_record_whole(tmp_path) -> None:
    """A multi-chunk record is streamed (verified while read); after a flipped byte its download
    ends short (the client sees an incomplete body), and a one-chunk record answers 409."""
    import http.client

    from logstore import LogStore
    from tests._replay_helpers import corrupt_hot_record

    big_key, small_key = RecordKey(Channel.activation(0), 0, 0), RecordKey(Channel.activation(0), 0, 1)
    big, small = torch.randn(3, 1024, 1024), torch.randn(64)  # 12 MiB raw: 3 chunks of 4 MiB
    st = LogStore.open(tmp_path, "run-s", writer="stage0")
    st.put(big_key, big)
    st.put(small_key, small)
    st.close()

    with ServerProcess(tmp_path) as srv:

        def get(key: RecordKey) -> tuple[int, bytes, dict[str, str]]:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("GET", f"/v1/runs/run-s/records/{key}/raw")
            r = conn.getresponse()
            try:
                return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
            finally:
                conn.close()

        status, body, headers = get(big_key)
        assert status == 200 and len(body) == int(headers["content-length"]) > 8 << 20  # several chunks
        assert headers["x-swiftlog-checksum"] == f"{xxhash.xxh3_64_intdigest(body):016x}"
        assert torch.equal(codec.decode_tensor(body), big)
        corrupt_hot_record(str(tmp_path), "run-s", big_key)
        with pytest.raises(http.client.IncompleteRead):
            get(big_key)
        corrupt_hot_record(str(tmp_path), "run-s", small_key)
        status, body, _ = get(small_key)
        assert status == 409 and b"corrupt_record" in body


def test_raw_downloads_answer_alike_before_and_after_the_run_is_open(store_copy: StoreFixture) -> None:
    """The first download of a run goes through the route, which opens the run's store; later ones
    are answered before the routing (records.RawDownloads): the same status, headers and bytes, the
    same answers to what is wrong, and the same label in /metrics."""
    key = RecordKey(Channel.activation(0), 1, 0)
    url = f"/v1/runs/run-a/records/{key}/raw"
    with (
        ServerProcess(store_copy.root, cold_url=store_copy.cold_url) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        first, again = c.get(url), c.get(url)
        assert first.status_code == again.status_code == 200
        assert first.content == again.content
        assert torch.equal(codec.decode_tensor(again.content), sample_tensor(key.channel, 1, 0))
        assert dict(first.headers) | {"date": ""} == dict(again.headers) | {"date": ""}
        for path, status in (
            ("/v1/runs/run-a/records/act_0_1/it999/mb0/raw", 404),
            ("/v1/runs/run-a/records/act_0_1/bogus/raw", 422),
            ("/v1/runs/nope/records/act_0_1/it1/mb0/raw", 404),
            ("/v1/runs/run-a/records/grad_3_2/it1/mb0/raw", 200),  # evicted: the route reads the cold tier
        ):
            assert c.get(path).status_code == status, path
        r = c.get(url, headers={"Host": "attacker.example"})  # the Host check comes first on either path
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request"
        text = c.get("/metrics").text
        label = 'method="GET",route="/v1/runs/{run}/records/{key}/raw",status="200"'
        assert f"swiftlog_http_requests_total{{{label}}} 3.0" in text


def test_a_download_from_an_open_run_is_answered_before_the_route(store_copy: StoreFixture) -> None:
    """In process: once the route opened the run's store, a download of a record in a local segment
    file never reaches the route (Node.blob_stream); one only the cold tier holds does."""
    import asyncio

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings.build(root=store_copy.root, cold_url=store_copy.cold_url))
    node, calls = app.state.node, []
    routed = node.blob_stream
    node.blob_stream = lambda *a: calls.append(a[1]) or routed(*a)
    url = "/v1/runs/run-a/records/{}/raw"

    async def fetch() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as c:
            first = await c.get(url.format("act_0_1/it1/mb0"))
            again = await c.get(url.format("act_0_1/it1/mb0"))
            assert first.status_code == again.status_code == 200 and first.content == again.content
            assert (await c.get(url.format("grad_3_2/it1/mb0"))).status_code == 200  # evicted: cold only

    try:
        asyncio.run(fetch())
    finally:
        node.close()
    assert calls == ["act_0_1/it1/mb0", "grad_3_2/it1/mb0"]


def test_node_server_lists_gaps_for_a_remote_planner(tmp_path) -> None:
    """HttpRecordSource.gaps (what plan_recovery reads through a node server) sees recorded gaps."""
    from logstore import LogStore
    from replay.remote import HttpRecordSource

    st = LogStore.open(tmp_path, "run-g", writer="stage1")
    st.put(RecordKey(Channel.activation(1), 0, 0), torch.randn(8))
    st.record_gap(Channel.activation(1), 0, 1, "queue full (overflow=gap)")
    st.close()
    with ServerProcess(tmp_path) as srv:
        with HttpRecordSource(srv.url, "run-g") as src:
            gaps = src.gaps()
        assert [(g["channel"], g["iteration"], g["micro_batch"], g["reason"]) for g in gaps] == [
            ("act_1_2", 0, 1, "queue full (overflow=gap)")
        ]
        with HttpRecordSource(srv.url, "no-such-run") as src:
            assert src.gaps() == []


def test_record_pages_list_the_hot_tier_while_the_object_store_is_unreachable(written_store: StoreFixture) -> None:
    """A node's records stay listable with its object store down: 200, the hot tier's page, and
    ``cold_error`` naming the endpoint (the summary says the same in ``cold.error``)."""
    from logstore.testing import free_port

    env = {
        "SWIFTLOG_COLD_OPTIONS": json.dumps(
            {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{free_port()}"}
        )
    }
    with (
        ServerProcess(written_store.root, cold_url="s3://gone/x", env=env) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):
        r = c.get("/v1/runs/run-a/records", params={"channel": "act_0_1", "limit": 5})
        assert r.status_code == 200, r.text
        page = r.json()
        assert [e["key"] for e in page["records"]] == [
            str(k) for k in written_store.keys() if k.channel.name == "act_0_1"
        ][:5]
        assert "only the hot tier is listed" in page["cold_error"] and "127.0.0.1" in page["cold_error"]
        fine = c.get("/v1/runs/run-a/records", params={"channel": "act_0_1", "limit": 5, "cursor": page["next_cursor"]})
        assert fine.status_code == 200 and fine.json()["records"]


# ------------------------------------------------------------------------------------------ checkpoint registrations
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _swiftlog(*args: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "server.cli", *map(str, args)]
    env = {**subprocess_env(), "COLUMNS": "200"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _deep(levels: int) -> dict:
    meta: dict = {}
    cur = meta
    for _ in range(levels - 1):
        cur["a"] = {}
        cur = cur["a"]
    return meta


def _checkpoint_file(path: Path, stage: int, iteration: int, run: str = "run-a") -> str:
    """A real checkpoint of ``stage`` at ``iteration`` (a tiny model), as a client writes it."""
    from trainer_client.checkpoint import save_checkpoint

    return save_checkpoint(
        str(path), run_id=run, stage=stage, num_stages=4, iteration=iteration, seed=0, model=torch.nn.Linear(2, 2)
    )


def test_a_deep_checkpoint_meta_is_refused_and_one_stored_earlier_is_served(store_copy: StoreFixture) -> None:
    """M4: a meta nested 400 deep was accepted and stored; from then on the run's summary and its
    checkpoint list answered 500 and `swiftlog stat --json` printed a traceback. Depth and size are
    refused (422, naming the limit); a registration stored that way earlier is served, its meta
    replaced by a note."""
    from logstore.cold import ColdTier

    uri = _checkpoint_file(store_copy.root.parent / "ck" / "2-4.pt", 2, 4)
    with (
        ServerProcess(store_copy.root, token=TOKEN, cold_url=store_copy.cold_url) as srv,
        httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c,
    ):
        for meta, needle in ((_deep(400), "nested more than 16 levels deep"), ({"x": "y" * 20_000}, "more than 16384")):
            r = c.post("/v1/runs/run-a/checkpoints", json={"stage": 2, "iteration": 4, "uri": uri, "meta": meta})
            assert r.status_code == 422 and needle in r.json()["error"]["message"], r.text
        assert c.get("/v1/runs/run-a/checkpoints").json()["checkpoints"] == []
        with ColdTier(store_copy.cold_url) as cold:  # what an earlier version stored
            cold.put_doc(
                "run-a/checkpoints/stage00002/000000000004.json",
                {"stage": 2, "iteration": 4, "uri": uri, "registered_at": 1.0, "meta": _deep(400)},
            )
        cps = c.get("/v1/runs/run-a/checkpoints")
        assert cps.status_code == 200, cps.text
        assert "nested more than 16 levels deep" in cps.json()["checkpoints"][0]["meta"]["unreadable_meta"]
        s = c.get("/v1/runs/run-a", params={"fresh": "true"})
        assert s.status_code == 200 and s.json()["watermarks"] == [{"stage": 2, "iteration": 4}], s.text
    p = _swiftlog("stat", "--root", store_copy.root, "--run", "run-a", "--cold-url", store_copy.cold_url, "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert json.loads(p.stdout)["watermarks"] == [{"stage": 2, "iteration": 4}]


def test_unregister_previews_then_withdraws_a_wrong_registration(store_copy: StoreFixture) -> None:
    """M4/L4: a wrong registration could not be undone: the next GC deleted the logs below it in both
    tiers. The API and the CLI withdraw one; without `confirm` they preview the effect (the
    watermarks and a GC dry run with it and without it) and change nothing."""
    uri4 = _checkpoint_file(store_copy.root.parent / "ck" / "2-4.pt", 2, 4)
    base = ("--root", store_copy.root, "--run", "run-a", "--cold-url", store_copy.cold_url)
    with (
        ServerProcess(store_copy.root, token=TOKEN, cold_url=store_copy.cold_url) as srv,
        httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c,
    ):
        assert c.post("/v1/runs/run-a/checkpoints", json={"stage": 2, "iteration": 4, "uri": uri4}).status_code == 201
        wrong = {"stage": 2, "iteration": 7, "uri": "s3://elsewhere/ckpt/2/7.pt", "force": True}
        assert c.post("/v1/runs/run-a/checkpoints", json=wrong).status_code == 201
        assert c.get("/v1/runs/run-a/records/act_1_2/it5/mb0").status_code == 404  # garbage now
        r = c.post("/v1/runs/run-a/checkpoints/unregister", json={"stage": 2, "iteration": 7})
        assert r.status_code == 200, r.text
        p = r.json()
        assert p["dry_run"] is True and p["checkpoint"]["uri"] == "s3://elsewhere/ckpt/2/7.pt"
        assert p["watermarks_before"] == [{"stage": 2, "iteration": 7}]
        assert p["watermarks_after"] == [{"stage": 2, "iteration": 4}]
        assert p["gc_before"]["hot_records"] > p["gc_after"]["hot_records"] > 0
        assert "falls from 7 to 4" in p["notes"][0]
        unchanged = c.get("/v1/runs/run-a/checkpoints").json()["checkpoints"]
        assert [x["iteration"] for x in unchanged] == [4, 7]
        cli = _swiftlog("unregister", *base, "--stage", "2", "--iteration", "7", "--json")
        assert cli.returncode == 0 and json.loads(cli.stdout) == p, (cli.stdout, cli.stderr[-2000:])
        done = c.post("/v1/runs/run-a/checkpoints/unregister", json={"stage": 2, "iteration": 7, "confirm": True})
        assert done.status_code == 200 and done.json()["dry_run"] is False, done.text
        cps = c.get("/v1/runs/run-a/checkpoints").json()
        assert [x["iteration"] for x in cps["checkpoints"]] == [4]
        assert cps["watermarks"] == [{"stage": 2, "iteration": 4}]
        assert c.get("/v1/runs/run-a/records/act_1_2/it5/mb0").status_code == 200  # not garbage any more
        r = c.post("/v1/runs/run-a/checkpoints/unregister", json={"stage": 2, "iteration": 7})
        assert r.status_code == 404 and r.json()["error"]["code"] == "checkpoint_not_found", r.text
        for bad in ({"stage": 2, "iteration": 4, "confirm": "yes"}, {"stage": "2", "iteration": 4}, {"stage": 2}):
            assert c.post("/v1/runs/run-a/checkpoints/unregister", json=bad).status_code == 422, bad
        anonymous = httpx.post(srv.url + "/v1/runs/run-a/checkpoints/unregister", json={"stage": 2, "iteration": 4})
        assert anonymous.status_code == 401
    cli = _swiftlog("unregister", *base, "--stage", "2", "--iteration", "4", "--confirm")
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "withdrew the registration of stage 2 at iteration 4" in cli.stdout and "stage 2 @ 4 -> none" in cli.stdout
    cli = _swiftlog("unregister", *base, "--stage", "2", "--iteration", "4")
    assert cli.returncode == 3, cli.stderr
    assert "has no registration of stage 2's checkpoint at iteration 4" in cli.stderr


def test_registration_reads_the_checkpoint_it_names_and_reveals_no_file(store_copy: StoreFixture, moto_server) -> None:
    """L4: registration trusted the caller: a local uri was only checked for existence (the answer
    told whether any path on the node exists), s3:// and http:// were not checked at all, so a
    wrong registration made logs garbage. Now the server reads what the uri names (its pickle
    alone) and registers it only when it is a checkpoint of that run, stage and iteration; a
    missing file and a file of another kind get the same answer."""
    import uuid

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    s3 = moto_server.url(prefix)
    env = {"SWIFTLOG_COLD_OPTIONS": json.dumps(moto_server.storage_options)}
    ck = store_copy.root.parent / "ck"
    good = _checkpoint_file(ck / "2-4.pt", 2, 4)
    other_stage = _checkpoint_file(ck / "1-4.pt", 1, 4)
    other_run = _checkpoint_file(ck / "x-2-4.pt", 2, 4, run="run-b")
    remote = f"{s3}/ck/2-5.pt"
    from trainer_client.checkpoint import save_checkpoint

    kw = {"run_id": "run-a", "num_stages": 4, "seed": 0, "model": torch.nn.Linear(2, 2)}
    save_checkpoint(remote, stage=2, iteration=5, storage_options=moto_server.storage_options, **kw)
    (ck / "notes.txt").write_text("not a checkpoint")
    with (
        ServerProcess(store_copy.root, token=TOKEN, cold_url=s3, env=env) as srv,
        httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c,
    ):

        def post(body: dict) -> httpx.Response:
            return c.post("/v1/runs/run-a/checkpoints", json=body)

        refusals = {}
        for uri in (
            (ck / "missing.pt").as_uri(),
            (ck / "notes.txt").as_uri(),
            str(ck / "notes.txt"),
            other_stage,
            other_run,
            f"{s3}/ck/missing.pt",
        ):
            r = post({"stage": 2, "iteration": 4, "uri": uri})
            assert r.status_code == 400, (uri, r.text)
            refusals[uri] = r.json()["error"]["message"].replace(repr(uri), "URI")
        assert set(refusals.values()) == {
            "checkpoint uri URI is not a readable swiftlog checkpoint of run 'run-a', stage 2, iteration 4"
        }, refusals
        for body, needle in (
            ({"stage": 2, "iteration": 4}, "without a uri cannot be checked"),
            ({"stage": 2, "iteration": 4, "uri": "http://127.0.0.1:1/ck.pt"}, "never fetches http:// URLs"),
        ):
            r = post(body)
            assert (
                r.status_code == 400
                and needle in r.json()["error"]["message"]
                and '"force": true' in r.json()["error"]["hint"]
            ), r.text
        assert c.get("/v1/runs/run-a/checkpoints").json()["checkpoints"] == []
        assert post({"stage": 2, "iteration": 4, "uri": good}).status_code == 201
        assert post({"stage": 2, "iteration": 5, "uri": remote}).status_code == 201
        assert post({"stage": 1, "iteration": 4, "uri": "http://127.0.0.1:1/ck.pt", "force": True}).status_code == 201
        assert [(x["stage"], x["iteration"]) for x in c.get("/v1/runs/run-a/checkpoints").json()["checkpoints"]] == [
            (1, 4),
            (2, 4),
            (2, 5),
        ]
