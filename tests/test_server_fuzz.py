"""The admin API fuzzed from its own OpenAPI schema (schemathesis) against a real server.

Every operation gets a bounded number of generated requests, valid and invalid (negative mode),
with the server's token; schemathesis checks that no response is a 5xx (501, a planner that
cannot be loaded, is documented), that every status, content
type and body matches the schema, and that auth is enforced. Path parameters are steered to the
real run and real record keys most of the time, so requests reach the store instead of stopping
at 404. The server runs over a private copy of the store: the fuzzer registers checkpoints and
confirms GCs.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from server.app import create_app
from server.routers._common import KEY_PATTERN, RUN_PATTERN
from server.settings import Settings
from server.testing import TOKEN, ServerProcess, StoreFixture

pytest_plugins = ["server.pytest_fixtures"]
pytestmark = pytest.mark.slow  # fuzzing: the full tier only

MAX_EXAMPLES = 60


# The schema is generated in-process from the same code and settings as the server under test
# (test_served_schema_is_the_one_fuzzed pins that), so the test cases exist at collection time.
_SETTINGS = Settings(root="/nonexistent-swiftlog-root", token=TOKEN)
SPEC = create_app(_SETTINGS).openapi()
_STORE = StoreFixture(root=Path("/unused"), cold_dir=Path("/unused"))  # shape of the written store
_KEYS = [str(k) for k in _STORE.keys()[::7]]
AUTH = {"Authorization": f"Bearer {TOKEN}"}

schema = schemathesis.openapi.from_dict(
    SPEC,
    config=schemathesis.Config.from_dict(
        {
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True},
            "checks": {
                "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "501"]},
                # schema-valid but semantically invalid input (an activation channel that skips a
                # stage, a cursor that decodes to no key) is a 400, and the planner is a 501
                "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "401", "403", "404", "409", "501"]},
            },
        }
    ),
)


def _pick(value: Any, pattern: str, choices: list[str], real_share: int = 3) -> Any:
    """Deterministic steering: 3 in 4 schema-valid values are replaced by one of ``choices``;
    invalid ones (negative mode) are left alone so that the case stays invalid."""
    if not isinstance(value, str) or not re.match(pattern, value) or len(value) > 128:
        return value
    h = zlib.crc32(value.encode())
    return choices[(h // 4) % len(choices)] if h % 4 < real_share else value


@schema.hook
def map_path_parameters(context: Any, path_parameters: dict[str, Any] | None) -> dict[str, Any] | None:
    if not path_parameters:
        return path_parameters
    out = dict(path_parameters)
    if "run" in out:
        out["run"] = _pick(out["run"], RUN_PATTERN, [_STORE.run])
    if "key" in out:
        out["key"] = _pick(out["key"], KEY_PATTERN, _KEYS)
    return out


@pytest.fixture(scope="module")
def fuzz_server(written_store: StoreFixture, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    assert (written_store.run, written_store.keys()) == (_STORE.run, _STORE.keys())
    copy = written_store.copy(tmp_path_factory.mktemp("fuzz"))
    with ServerProcess(copy.root, token=TOKEN, cold_url=copy.cold_url) as srv:
        yield srv


def test_served_schema_is_the_one_fuzzed(fuzz_server: ServerProcess) -> None:
    assert httpx.get(fuzz_server.url + "/openapi.json").json() == SPEC


@schema.exclude(tag="recovery").parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=MAX_EXAMPLES)
def test_api_conforms_to_its_schema(case: schemathesis.Case, fuzz_server: ServerProcess) -> None:
    case.call_and_validate(base_url=fuzz_server.url, headers=AUTH, timeout=30)


# The planner runs against the shared server, whose store nobody mutates: on the fuzz server the
# fuzzer registers checkpoints for stages up to 65535, and a plan's cost grows with the largest
# registered stage (the pipeline size it infers).
@schema.include(tag="recovery").parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=MAX_EXAMPLES)
def test_recovery_plan_conforms_to_its_schema(case: schemathesis.Case, api_server: ServerProcess) -> None:
    case.call_and_validate(base_url=api_server.url, timeout=30)


#: the read routes the steering must reach with real answers
STEERED_ROUTES = [
    "/v1/runs/{run}",
    "/v1/runs/{run}/records",
    "/v1/runs/{run}/records/{key}",
    "/v1/runs/{run}/records/{key}/raw",
]


def test_fuzzing_reached_the_store(fuzz_server: ServerProcess) -> None:
    """The steering works: requests generated for the read routes get real answers, not only 404s
    and 422s. The test sends its own generated requests, so it holds when run alone too."""
    for route in STEERED_ROUTES:

        @settings(
            max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
        )
        @given(case=schema[route]["GET"].as_strategy())
        def send(case: schemathesis.Case) -> None:
            case.call(base_url=fuzz_server.url, headers=AUTH, timeout=30)

        send()
    text = httpx.get(fuzz_server.url + "/metrics").text
    ok_routes = {
        line.split('route="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("swiftlog_http_requests_total{") and 'status="200"' in line
    }
    assert set(STEERED_ROUTES) <= ok_routes, ok_routes
    assert 'status="500"' not in text
