"""What every router shares: the node dependency, validated path parameters, documented errors."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path, Request

from logstore.keys import Kind
from server.models import ErrorResponse
from server.node import Node

__all__ = [
    "API_PREFIX",
    "get_node",
    "RunId",
    "RecordKeyPath",
    "RUN_PATTERN",
    "KEY_PATTERN",
    "CHANNEL_PATTERN",
    "errors",
    "DESCRIPTIONS",
]

API_PREFIX = "/v1"  # set on each router (not at include time) so every route knows its full path

# logstore.keys.validate_name as a regular expression without look-arounds: starts with a letter
# or digit, then [A-Za-z0-9._-] with no two dots in a row; at most 128 characters (maxLength).
RUN_PATTERN = r"^[A-Za-z0-9](?:\.?[A-Za-z0-9_-])*\.?$"
_SHORTS = "|".join(k.short for k in Kind)  # act|grad|input|target|meta|digest|reduced
CHANNEL_PATTERN = rf"^({_SHORTS})_[0-9]{{1,5}}(_[0-9]{{1,5}})?$"
KEY_PATTERN = rf"^({_SHORTS})_[0-9]{{1,5}}(_[0-9]{{1,5}})?/it[0-9]{{1,19}}(/mb[0-9]{{1,10}})?(/p[0-9]{{1,5}})?$"

RunId = Annotated[
    str,
    Path(
        description="run id: 1-128 of [A-Za-z0-9._-], starting with a letter or digit, no '..'",
        pattern=RUN_PATTERN,
        min_length=1,
        max_length=128,
        examples=["run-1"],
    ),
]
RecordKeyPath = Annotated[
    str,
    Path(
        description="record key, e.g. act_0_1/it5/mb2/p0 (mb and p default to 0)",
        pattern=KEY_PATTERN,
        max_length=128,
        examples=["act_0_1/it0/mb0/p0"],
    ),
]

DESCRIPTIONS = {
    400: "bad input (invalid name, key, cursor or filter)",
    401: "missing or invalid bearer token",
    403: "mutating endpoints are disabled on this server, or the request came from a web page of another origin",
    404: "no such run or record (or garbage-collected)",
    409: "corrupt record (checksum mismatch), no cold tier configured, or a writer fenced by a later incarnation",
    413: "request body too large",
    415: "the request body is not JSON",
    421: "the Host header names no name of this server (see --allowed-host)",
    422: "request does not match the schema",
    501: "the recovery planner cannot be loaded (see --planner)",
    502: "the object store refused the operation",
    503: "the object store is unreachable (retryable)",
    507: "the hot tier is full",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the error statuses a route's handler can give. What the HTTP
    layer adds on its own (a foreign Host, a missing token, a refused body, a schema mismatch) the
    app writes into the schema itself (``server.app``)."""
    return {c: {"model": ErrorResponse, "description": DESCRIPTIONS[c]} for c in sorted(statuses)}


async def get_node(request: Request) -> Node:
    """The app's Node (async: a dependency without I/O must not cost a thread-pool hop)."""
    return request.app.state.node
