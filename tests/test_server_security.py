"""Auth, bind rules, path traversal, request limits and the mutating endpoints (on private store copies)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from logstore.errors import ConfigError
from logstore.keys import Channel, RecordKey
from logstore.testing import free_port
from replay.remote import HttpRecordSource, RemoteLogReader
from server.settings import Settings
from server.testing import TOKEN, ServerProcess, StoreFixture, sample_tensor, start_writer, stop_writer, subprocess_env
from tests._replay_helpers import corrupt_hot_record
from trainer_client.checkpoint import save_checkpoint

pytest_plugins = ["server.pytest_fixtures"]

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _raw_get(port: int, target: str) -> tuple[int, bytes]:
    """Send a request line exactly as given (clients would normalise ../ and percent-encodings)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode("latin-1"))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


# ------------------------------------------------------------------------------------------ settings
def test_settings_refuse_non_loopback_without_token(tmp_path) -> None:
    with pytest.raises(ConfigError, match="non-loopback"):
        Settings.build(root=tmp_path, host="0.0.0.0")
    with pytest.raises(ConfigError, match="only allowed with a loopback host"):
        Settings.build(root=tmp_path, host="10.1.2.3", token=TOKEN, allow_insecure_loopback_writes=True)
    with pytest.raises(ConfigError, match="at least 16"):
        Settings.build(root=tmp_path, token="short")
    s = Settings.build(root=tmp_path, host="10.1.2.3", token=TOKEN)
    assert s.reads_need_token and s.auth_mode == "token"  # not bound here: only loopback is ever used
    local = Settings.build(root=tmp_path)
    assert not local.reads_need_token and local.auth_mode == "read-only" and local.host == "127.0.0.1"
    assert TOKEN not in repr(Settings.build(root=tmp_path, token=TOKEN))


def test_settings_sources_explicit_over_env_over_defaults(tmp_path) -> None:
    env = {
        "SWIFTLOG_ROOT": str(tmp_path),
        "SWIFTLOG_TOKEN": TOKEN,
        "SWIFTLOG_PORT": "9000",
        "SWIFTLOG_COLD_OPTIONS": '{"key": "k"}',
        "SWIFTLOG_ALLOW_INSECURE_LOOPBACK_WRITES": "yes",
    }
    s = Settings.from_env(env, port=9100)
    assert (
        s.root == tmp_path and s.port == 9100 and s.token.get_secret_value() == TOKEN and s.cold_options == {"key": "k"}
    )
    assert s.allow_insecure_loopback_writes and s.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="no store root"):
        Settings.from_env({})
    with pytest.raises(ConfigError, match="SWIFTLOG_COLD_OPTIONS is not JSON"):
        Settings.from_env({"SWIFTLOG_ROOT": "/x", "SWIFTLOG_COLD_OPTIONS": "{nope"})


def test_serve_refuses_non_loopback_bind_without_token(tmp_path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--root", str(tmp_path), "--host", "0.0.0.0"],
        env={**subprocess_env(), "SWIFTLOG_TOKEN": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "refusing to serve on non-loopback address '0.0.0.0' without a token" in p.stderr
    assert "Traceback" not in p.stderr


# ------------------------------------------------------------------------------------------ auth
def test_mutations_need_the_token(api_server: ServerProcess) -> None:
    with httpx.Client(base_url=api_server.url, timeout=30) as c:
        for method, path, body in (
            ("POST", "/v1/runs/run-a/gc", {"confirm": True}),
            ("POST", "/v1/runs/run-a/flush", None),
            ("POST", "/v1/runs/run-a/checkpoints", {"stage": 1, "iteration": 5}),
        ):
            r = c.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
            assert r.headers["www-authenticate"] == "Bearer"
            r = c.request(method, path, json=body, headers={"Authorization": "Bearer " + "x" * len(TOKEN)})
            assert r.status_code == 401 and r.json()["error"]["message"] == "invalid bearer token"
            r = c.request(method, path, json=body, headers={"Authorization": f"Basic {TOKEN}"})
            assert r.status_code == 401
        # nothing was registered or deleted
        assert c.get("/v1/runs/run-a/checkpoints").json()["checkpoints"] == []
        # reads need no token on loopback
        assert c.get("/v1/runs/run-a").status_code == 200


def test_no_token_means_read_only_unless_insecure_loopback_dev_mode(store_copy: StoreFixture) -> None:
    with ServerProcess(
        store_copy.root, cold_url=store_copy.cold_url, args=["--planner", "swiftlog_no_such_planner:plan_recovery"]
    ) as srv:
        r = httpx.post(srv.url + "/v1/runs/run-a/gc", json={})
        assert r.status_code == 403 and "no token" in r.json()["error"]["message"]
        assert "--token" in r.json()["error"]["hint"]
        assert httpx.get(srv.url + "/v1/health").json()["auth"] == "read-only"
        # the planner is pluggable; while its module is missing the answer is a clear 501
        r = httpx.get(srv.url + "/v1/runs/run-a/recovery-plan", params={"failed": 2})
        assert r.status_code == 501 and r.json()["error"]["code"] == "not_available"
        assert "the recovery planner cannot be loaded" in r.json()["error"]["message"]
    with ServerProcess(store_copy.root, args=["--allow-insecure-loopback-writes"]) as srv:
        assert httpx.get(srv.url + "/v1/health").json()["auth"] == "insecure-loopback"
        r = httpx.post(srv.url + "/v1/runs/run-a/gc", json={})
        assert r.status_code == 200 and r.json()["dry_run"] is True


def test_reads_can_require_the_token(store_copy: StoreFixture) -> None:
    """With reads protected, every endpoint is: the health check shows the store root, the metrics
    the runs, and the schema and its page are reads too."""
    with ServerProcess(store_copy.root, token=TOKEN, args=["--require-token-for-reads"]) as srv:
        for path in ("/v1/runs/run-a", "/v1/runs", "/v1/health", "/metrics", "/docs", "/openapi.json"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)
            assert str(store_copy.root) not in r.text
            assert httpx.get(srv.url + path, headers=AUTH).status_code == 200, path
        spec = httpx.get(srv.url + "/openapi.json", headers=AUTH).json()
        for path in ("/v1/runs/{run}", "/v1/health", "/metrics"):
            assert spec["paths"][path]["get"]["security"] == [{"bearerToken": []}], path
        # record downloads, also once the run's store is open (answered before the routing then)
        raw = srv.url + "/v1/runs/run-a/records/act_0_1/it1/mb0/raw"
        body = httpx.get(raw, headers=AUTH).content
        for headers in (
            {},
            {"Authorization": "Bearer " + "x" * len(TOKEN)},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": f"Bearer {TOKEN[:-1]}"},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": "Bearer"},
        ):
            r = httpx.get(raw, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", headers
        assert httpx.get(raw, headers=AUTH).content == body and len(body) > 0
        assert httpx.get(raw, headers={"Authorization": f"bearer {TOKEN}"}).content == body  # the scheme's case


def test_error_bodies_name_no_server_paths(store_copy: StoreFixture) -> None:
    """An error says what went wrong in the client's terms; where the store lives on the node is
    not the client's business (the messages name the root, an index, a segment file)."""
    key = RecordKey(Channel.gradient(1), 2, 1)
    corrupt_hot_record(str(store_copy.root), "run-a", key)
    with (
        ServerProcess(store_copy.root, token=TOKEN, cold_url=store_copy.cold_url) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):
        for path, status in (
            ("/v1/runs/no-such-run", 404),
            ("/v1/runs/no-such-run/records", 404),
            (f"/v1/runs/run-a/records/{key}", 409),
            (f"/v1/runs/run-a/records/{key}/raw", 409),
        ):
            r = c.get(path)
            assert r.status_code == status, (path, r.text)
            for where in (store_copy.root, store_copy.root.resolve(), store_copy.cold_dir, store_copy.root.parent):
                assert str(where) not in r.text, (path, r.text)
            assert "<root>" in r.text or "no-such-run" in r.text


# ------------------------------------------------------------------------------------------ host, origin
def test_host_header_must_name_this_server(api_server: ServerProcess) -> None:
    """DNS rebinding: a page of attacker.example whose name now resolves to 127.0.0.1 sends
    ``Host: attacker.example``; the server answers only to its own names."""
    url = api_server.url + "/v1/runs"
    for host in (
        "attacker.example",
        f"attacker.example:{api_server.port}",
        "127.0.0.1.attacker.example",
        "localhost.:1@x",
    ):
        r = httpx.get(url, headers={"Host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request", (host, r.text)
        assert "--allowed-host" in r.json()["error"]["hint"]
    for host in (
        f"127.0.0.1:{api_server.port}",
        "127.0.0.1",
        f"localhost:{api_server.port}",
        "LocalHost.",
        f"[::1]:{api_server.port}",
    ):
        assert httpx.get(url, headers={"Host": host}).status_code == 200, host
    # HTTP/1.0 without a Host header: no name, no answer
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=10) as s:
        s.sendall(b"GET /v1/runs HTTP/1.0\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 421 ")


def test_allowed_hosts_are_configurable(store_copy: StoreFixture) -> None:
    """Other nodes reach a node's server by its name or address: --allowed-host adds them."""
    with ServerProcess(
        store_copy.root, args=["--allowed-host", "node7.cluster", "--allowed-host", "*.example.org"]
    ) as srv:
        for host, status in (
            ("node7.cluster", 200),
            (f"NODE7.cluster:{srv.port}", 200),
            ("a.b.example.org", 200),
            ("example.org", 421),
            ("node7.cluster.evil", 421),
            ("127.0.0.1", 200),
        ):
            assert httpx.get(srv.url + "/v1/runs", headers={"Host": host}).status_code == status, host
    with ServerProcess(store_copy.root, env={"SWIFTLOG_ALLOWED_HOSTS": "node8,10.0.0.8"}) as srv:
        assert httpx.get(srv.url + "/v1/runs", headers={"Host": "10.0.0.8:80"}).status_code == 200
        assert httpx.get(srv.url + "/v1/runs", headers={"Host": "node9"}).status_code == 421
    with pytest.raises(ConfigError, match="allowed host"):
        Settings.build(root=store_copy.root, allowed_hosts=("bad host/name",))


def test_cross_origin_writes_are_refused(store_copy: StoreFixture) -> None:
    """CSRF: a page elsewhere (another site, or another port of this machine) makes the browser
    POST to a loopback server that lets loopback clients write without a token."""
    with ServerProcess(store_copy.root, cold_url=store_copy.cold_url, args=["--allow-insecure-loopback-writes"]) as srv:
        sealed = httpx.get(srv.url + "/v1/runs/run-a", params={"fresh": "true"}).json()["hot"]["segments"]["sealed"]
        assert sealed > 0
        for headers in (
            {"Origin": "http://attacker.example"},
            {"Origin": "http://localhost:3000"},
            {"Origin": f"https://127.0.0.1:{srv.port}"},
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site"},
            {"Sec-Fetch-Site": "same-site"},
        ):
            r = httpx.post(srv.url + "/v1/runs/run-a/flush", headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_request", (headers, r.text)
        after = httpx.get(srv.url + "/v1/runs/run-a", params={"fresh": "true"}).json()["hot"]["segments"]["sealed"]
        assert after == sealed  # nothing was flushed
        # reads stay open to any origin (the browser does not show the page the answer);
        # the server's own origin may write
        assert httpx.get(srv.url + "/v1/runs", headers={"Origin": "http://attacker.example"}).status_code == 200
        r = httpx.post(
            srv.url + "/v1/runs/run-a/flush",
            headers={"Origin": f"http://127.0.0.1:{srv.port}", "Sec-Fetch-Site": "same-origin"},
        )
        assert r.status_code == 200 and r.json()["uploaded_segments"] == sealed


# ------------------------------------------------------------------------------------------ TLS
def _self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swiftlog test")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = where / "cert.pem", where / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.mark.slow
def test_serve_over_tls(store_copy: StoreFixture, tmp_path: Path) -> None:
    """--tls-cert/--tls-key serve https: reads, the replay's record source, and nothing in clear."""
    cert, key = _self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    with ServerProcess(store_copy.root, token=TOKEN, args=["--tls-cert", str(cert), "--tls-key", str(key)]) as srv:
        assert srv.url.startswith("https://")
        r = httpx.get(srv.url + "/v1/runs/run-a/checkpoints", headers=AUTH, verify=trust)
        assert r.status_code == 200 and r.json()["checkpoints"] == []
        with pytest.raises(httpx.HTTPError):  # the same port does not answer plain http
            httpx.get(f"http://127.0.0.1:{srv.port}/v1/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # nor a client that does not trust the certificate
            httpx.get(srv.url + "/v1/health", timeout=10)
        k = RecordKey(Channel.activation(0), 3, 1)
        with HttpRecordSource(srv.url, "run-a", token=TOKEN, verify=trust) as src:
            assert src.get(k).equal(sample_tensor(k.channel, 3, 1))
    for args, needle in (
        (["--tls-cert", str(tmp_path / "missing.pem")], "missing.pem"),
        (["--tls-cert", str(key), "--tls-key", str(key)], "cert"),
        (["--tls-key", str(key)], "tls_keyfile needs tls_certfile"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "server.cli", "serve", "--root", str(store_copy.root), "--port", "0", *args],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr[-2000:])


def test_the_token_never_goes_in_clear_to_another_host() -> None:
    """A token sent over plain http to another machine can be read on the way: clients refuse."""
    for url in ("http://10.1.2.3:8765", "http://node7:8765", "HTTP://[2001:db8::1]:80"):
        with pytest.raises(ConfigError, match="plain http") as e:
            HttpRecordSource(url, "run-a", token=TOKEN)
        assert "https://" in e.value.hint
        with pytest.raises(ConfigError, match="plain http"):
            RemoteLogReader([f"http://127.0.0.1:{free_port()}", url], "run-a", token=TOKEN)
    for url, token in (
        ("http://127.0.0.1:8765", TOKEN),
        ("http://localhost:8765", TOKEN),
        ("http://[::1]:8765", TOKEN),
        ("https://10.1.2.3:8765", TOKEN),
        ("http://10.1.2.3:8765", None),
    ):
        HttpRecordSource(url, "run-a", token=token).close()  # nothing is sent at construction


# ------------------------------------------------------------------------------------------ traversal
@pytest.mark.parametrize(
    "target",
    [
        "/v1/runs/..",
        "/v1/runs/%2e%2e",
        "/v1/runs/..%2F..%2Fetc",
        "/v1/runs/..%2f..%2f..%2fetc%2fpasswd/records",
        "/v1/runs/%2Fetc%2Fpasswd",
        "/v1/runs//etc/passwd",
        "/v1/runs/../../../../etc/passwd",
        "/v1/runs/run-a/../../../etc/passwd",
        "/v1/runs/..%5C..%5Cwindows",
        "/v1/runs/run%00a",
        "/v1/runs/.hidden",
        "/v1/runs/" + "a" * 300,
        "/v1/runs/run-a/records/..%2F..%2F..%2Fetc%2Fpasswd",
        "/v1/runs/run-a/records/%2Fetc%2Fpasswd/raw",
        "/v1/runs/run-a/records/act_0_1%2F..%2F..%2Fstage0/raw",
        "/v1/runs/run-a/records/act_0_1/it0/../../../../etc/passwd",
        "/v1/runs/run-a/records?channel=..%2F..%2Fetc",
        "/v1/runs/run-a/records?cursor=..%2F..",
        "/v1/runs/stage0/records",
        "/v1/runs/run-a%2Fstage0/records",
    ],
)
def test_traversal_attempts_are_refused(api_server: ServerProcess, target: str) -> None:
    status, body = _raw_get(api_server.port, target)
    assert 400 <= status < 500, (target, status, body[:300])
    assert b'"error"' in body and b"root:" not in body


# ------------------------------------------------------------------------------------------ limits
def test_request_bodies_are_bounded(api_server: ServerProcess) -> None:
    big = {"stage": 1, "iteration": 1, "meta": {"x": "y" * 100_000}}
    r = httpx.post(api_server.url + "/v1/runs/run-a/checkpoints", json=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks():
        for _ in range(40):
            yield b"x" * 4096

    r = httpx.post(
        api_server.url + "/v1/runs/run-a/checkpoints",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert r.status_code == 413, r.text
    json_ct = {**AUTH, "content-type": "application/json"}
    r = httpx.post(api_server.url + "/v1/runs/run-a/checkpoints", content=b"{not json", headers=json_ct)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(api_server.url + "/v1/runs/run-a/checkpoints", json={"stage": -1, "iteration": 2**70}, headers=AUTH)
    assert r.status_code == 422 and "stage" in r.json()["error"]["message"]
    # a body that is not JSON (curl -d without a content type sends a form) is a 415 that says what to send
    r = httpx.post(
        api_server.url + "/v1/runs/run-a/gc",
        content=b'{"confirm": true}',
        headers={**AUTH, "content-type": "application/x-www-form-urlencoded"},
    )
    assert (
        r.status_code == 415
        and r.json()["error"]["code"] == "unsupported_media_type"
        and "application/json" in r.json()["error"]["message"]
    )
    # a destructive flag must be a JSON true, not something that looks like one
    for body in ({"confirm": "yes"}, {"confirm": 1}, {"confirm": "true"}):
        r = httpx.post(api_server.url + "/v1/runs/run-a/gc", json=body, headers=AUTH)
        assert r.status_code == 422 and "confirm" in r.json()["error"]["message"], (body, r.text)


# ------------------------------------------------------------------------------------------ mutations
def _flush_checks(c: httpx.Client, store_copy: StoreFixture) -> None:
    """Flush uploads the sealed segments; a live writer's open segment is listed, not touched."""
    before = c.get("/v1/runs/run-a", params={"fresh": "true"}).json()
    assert before["hot"]["segments"]["sealed"] > 0
    r = c.post("/v1/runs/run-a/flush")
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["uploaded_segments"] == before["hot"]["segments"]["sealed"] and rep["open_segments"] == []
    after = c.get("/v1/runs/run-a").json()
    assert after["hot"]["segments"]["sealed"] == 0
    assert after["cold"]["records"] > before["cold"]["records"]
    assert c.post("/v1/runs/run-a/flush").json()["uploaded_segments"] == 0  # idempotent
    # a live writer's open segment is its own: listed, not touched, and the writer carries on
    ch = Channel.activation(4)
    w = start_writer(
        store_copy.root,
        store_copy.run,
        writer="stage4",
        channels=[ch],
        micro_batches=1,
        shape=(2, 8, 8),
        sleep=0.05,
        segment_iters=1000,
        duration=60,
    )
    try:
        for _ in range(300):
            rep = c.post("/v1/runs/run-a/flush").json()
            if rep["open_segments"]:
                break
            time.sleep(0.1)
        assert [o["writer"] for o in rep["open_segments"]] == ["stage4"]
        assert c.get(f"/v1/runs/run-a/records/{RecordKey(ch, 0, 0)}/raw").status_code == 200
    finally:
        err = stop_writer(w)
    assert w.returncode == 0, err
    rep = c.post("/v1/runs/run-a/flush").json()  # the writer sealed on close: now it goes up
    assert rep["open_segments"] == [] and rep["uploaded_segments"] >= 1


def test_flush_then_checkpoint_and_gc(store_copy: StoreFixture) -> None:
    """Mutations on one server over a private copy: flush (sealed segments go up, open ones are
    listed), then register a checkpoint and GC (dry run, then confirmed)."""
    # stage 2's checkpoint at 4 makes garbage of what stage 2 owns below 4: what it received
    # (act_1_2, grad_3_2) and its own streams (digests it sent, its meta); nothing else
    garbage = {str(k) for k in store_copy.keys() if k.channel.owner == 2 and k.iteration < 4}
    keep = {str(k) for k in store_copy.keys()} - garbage
    with (
        ServerProcess(store_copy.root, token=TOKEN, cold_url=store_copy.cold_url) as srv,
        httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c,
    ):
        _flush_checks(c, store_copy)
        # what would make logs garbage for nothing is refused, naming it
        # (a stage or iteration beyond the logs, a missing file)
        for bad, needle in (
            (
                {"stage": 9, "iteration": 4},
                "stage 9 is beyond the stages of run 'run-a' (its channels name stages 0..5)",
            ),
            ({"stage": 1, "iteration": 2**53 - 1}, "beyond the logs of run 'run-a' (last logged iteration"),
            (
                {"stage": 2, "iteration": 4, "uri": "file:///nonexistent/2/4"},
                "'file:///nonexistent/2/4' is not a readable swiftlog checkpoint",
            ),
        ):
            r = c.post("/v1/runs/run-a/checkpoints", json=bad)  # (also a directory, an upper-case scheme: below)
            assert (
                r.status_code == 400
                and needle in r.json()["error"]["message"]
                and '"force": true' in r.json()["error"]["hint"]
            ), r.text
        for bad in (
            {"stage": 2, "iteration": 4, "uri": store_copy.root.parent.as_uri()},
            {"stage": 2, "iteration": 4, "uri": "FILE:///x.pt"},
            {"stage": 2, "iteration": 4, "uri": "../../etc/passwd"},
        ):
            r = c.post("/v1/runs/run-a/checkpoints", json=bad)
            needles = ("is not a readable swiftlog checkpoint", "must be lower case", "is a relative path")
            assert r.status_code == 400 and any(n in r.text for n in needles), r.text
        # QA checks: a lone surrogate in meta was stored, then broke every list of the run's checkpoints (500);
        # a string, a bool or a fractional stage / iteration, an empty uri and a NaN were taken as they came
        for body in (
            '{"stage": 2, "iteration": 4, "meta": {"a": "\\ud800"}}',
            '{"stage": "2", "iteration": 4}',
            '{"stage": true, "iteration": 4}',
            '{"stage": 2, "iteration": 4.5}',
            '{"stage": 2, "iteration": 4, "uri": ""}',
            '{"stage": 2, "iteration": 4, "uri": "s3://b/x\\u0000y", "force": true}',
            '{"stage": 2, "iteration": 4, "meta": {"x": NaN}}',
        ):
            r = c.post(
                "/v1/runs/run-a/checkpoints", content=body.encode(), headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 422, (body, r.text)
        assert c.get("/v1/runs/run-a/checkpoints").json()["checkpoints"] == []
        ckpt = store_copy.root.parent / "ckpt-2-4.pt"
        model = torch.nn.Linear(2, 2)
        save_checkpoint(str(ckpt), run_id="run-a", stage=2, num_stages=6, iteration=4, seed=0, model=model)
        r = c.post(
            "/v1/runs/run-a/checkpoints", json={"stage": 2, "iteration": 4, "uri": ckpt.as_uri(), "meta": {"step": 4}}
        )
        assert r.status_code == 201 and r.json()["iteration"] == 4
        cps = c.get("/v1/runs/run-a/checkpoints").json()
        assert cps["watermarks"] == [{"stage": 2, "iteration": 4}] and cps["checkpoints"][0]["meta"] == {"step": 4}
        assert c.get("/v1/runs/run-a").json()["watermarks"] == [{"stage": 2, "iteration": 4}]  # cache invalidated
        # garbage is hidden from reads at once, before any GC
        assert c.get("/v1/runs/run-a/records/act_1_2/it2/mb0").status_code == 404
        listed = {r["key"] for r in c.get("/v1/runs/run-a/records", params={"limit": 1000}).json()["records"]}
        assert {k for k in listed if not k.startswith("act_4_5")} == keep  # act_4_5: the live writer's
        dry = c.post("/v1/runs/run-a/gc").json()
        assert dry["dry_run"] is True and set(dry["keys"]) == garbage and dry["cold_segments"] > 0
        dry2 = c.post("/v1/runs/run-a/gc", json={"confirm": False}).json()
        assert dry2 == {**dry, "aborted_uploads": dry2["aborted_uploads"]}  # the dry run deleted nothing
        done = c.post("/v1/runs/run-a/gc", json={"confirm": True}).json()
        assert (
            done["dry_run"] is False and set(done["keys"]) == garbage and set(done["segments"]) == set(dry["segments"])
        )
        again = c.post("/v1/runs/run-a/gc", json={"confirm": True}).json()
        assert again["hot_records"] == 0 and again["cold_segments"] == 0
        listed = {r["key"] for r in c.get("/v1/runs/run-a/records", params={"limit": 1000}).json()["records"]}
        assert {k for k in listed if not k.startswith("act_4_5")} == keep  # act_4_5: the live writer's
        for key in ("act_1_2/it5/mb1", "grad_3_2/it4/mb0", "act_0_1/it0/mb0"):
            assert c.get(f"/v1/runs/run-a/records/{key}/raw").status_code == 200, key


# ------------------------------------------------------------------------------------------ faults
def test_faults_are_reported_not_500(store_copy: StoreFixture) -> None:
    """A flipped byte is a 409 naming the key; an unreachable object store is a retryable 503 while
    everything the hot tier holds is still served."""
    key = RecordKey(Channel.gradient(1), 2, 1)
    corrupt_hot_record(str(store_copy.root), "run-a", key)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    opts = [
        "--cold-option",
        "key=k",
        "--cold-option",
        "secret=s",
        "--cold-option",
        "client_kwargs=" + json.dumps({"endpoint_url": dead}),
    ]
    with (
        ServerProcess(store_copy.root, token=TOKEN, cold_url="s3://swiftlog-test/cold", args=opts) as srv,
        httpx.Client(base_url=srv.url, timeout=120, headers=AUTH) as c,
    ):
        for path in (f"/v1/runs/run-a/records/{key}", f"/v1/runs/run-a/records/{key}/raw"):
            r = c.get(path)
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "corrupt_record" and r.json()["error"]["key"] == str(key)
        s = c.get("/v1/runs/run-a").json()
        assert s["cold"]["error"] and "unreachable" in s["cold"]["error"] and s["hot"]["records"] > 0
        assert c.get("/v1/runs/run-a/records/act_0_1/it1/mb0/raw").status_code == 200  # hot: no object store needed
        r = c.get("/v1/runs/run-a/records/grad_3_2/it1/mb0/raw")  # evicted: only the object store has it
        assert r.status_code == 503 and r.json()["error"]["retryable"] is True and r.headers["retry-after"]
        r = c.post("/v1/runs/run-a/flush")
        assert r.status_code == 503 and r.json()["error"]["code"] == "cold_tier_unavailable"
