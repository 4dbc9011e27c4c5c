"""pytest fixtures shared by the server and CLI tests (load with ``pytest_plugins = ["server.pytest_fixtures"]``).

Loaded as a plugin so that the session-scoped store (written once by four real writer processes)
and the read-only server over it are shared by every test module that asks for them. Tests
that mutate a store take :func:`store_copy` (a private copy of both tiers) instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server.testing import TOKEN, ServerProcess, StoreFixture, write_run

__all__ = ["written_store", "api_server", "store_copy"]


@pytest.fixture(scope="session")
def written_store(tmp_path_factory: pytest.TempPathFactory) -> StoreFixture:
    """4 stages x 8 iterations x 2 micro-batches, one writer process per stage. Stages 2 and 3
    flushed everything, stage 3 evicted its hot copies (its records are cold-only), stages 0
    and 1 left sealed-not-uploaded segments, and stage 1 recorded a gap at iteration 3.
    Read-only: mutate a :func:`store_copy`."""
    base = tmp_path_factory.mktemp("written")
    fx = StoreFixture(root=base / "node", cold_dir=base / "cold")
    write_run(
        fx.root,
        fx.run,
        stages=fx.stages,
        iterations=fx.iterations,
        micro_batches=fx.micro_batches,
        cold_url=fx.cold_url,
        flush_stages=(2, 3),
        evict_stages=(3,),
        gap_at=fx.gap_at,
    )
    return fx


@pytest.fixture(scope="session")
def api_server(written_store: StoreFixture) -> Iterator[ServerProcess]:
    """``swiftlog serve`` with a token over the shared store. Do not call mutating endpoints on it."""
    with ServerProcess(written_store.root, token=TOKEN, cold_url=written_store.cold_url) as srv:
        yield srv


@pytest.fixture
def store_copy(written_store: StoreFixture, tmp_path: Path) -> StoreFixture:
    """A private copy of the shared store, free to mutate."""
    return written_store.copy(tmp_path)
