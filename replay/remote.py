"""Reading a run's records from node servers over HTTP (the admin API of ``server/``).

A replacement machine usually cannot open a surviving node's disk; it asks that node's server:

- ``GET /v1/runs/{run}/records/{key}/raw`` returns exactly the encoded record (a
  ``logstore.codec`` blob) with ``X-Swiftlog-Checksum`` (xxh3-64 of the body, hex);
- ``GET /v1/runs/{run}/records?channel=&it_lo=&it_hi=&limit=&cursor=`` lists keys, one page at a time.

:class:`HttpRecordSource` is a :class:`replay.reader.RecordSource` over one server;
:class:`RemoteLogReader` is a :class:`replay.reader.LogReader` over several servers (and, optionally,
local sources such as the cold tier as a fallback).

Every blob is checked twice before use: its xxh3 against the header the server sent (a transfer
error or a lying proxy), then the codec's checksum of the decoded raw bytes. A mismatch raises
``CorruptRecordError`` naming the key; wrong bytes are never returned. Errors are translated: 404 ->
``RecordNotFoundError``, 409 (corrupt on the server) -> ``CorruptRecordError``, 401/403 ->
``StoreError`` (not retryable; check the token), 5xx and transport errors -> retried with backoff,
then :class:`~replay.errors.NodeUnavailableError` (retryable: the reader tries its other sources). A kept-alive
connection the server closed as it was reused is reopened at once, without spending an attempt.

A token never travels in clear to another machine: with a token, a plain ``http://`` URL must name
a loopback address (``https://`` otherwise; ``verify`` or ``SSL_CERT_FILE`` names a private CA).

Gaps (records the client dropped, e.g. on a full queue) come from the run summary
(``GET /v1/runs/{run}?fresh=true``), so a plan made through node servers sees them too.

Never: sends the token anywhere but the configured server, or caches blobs on disk.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
import time
from collections.abc import Sequence
from typing import Any, Self
from urllib.parse import quote, urlsplit

import httpx
import torch

from logstore import Channel, CheckpointInfo, RecordInfo, RecordKey, codec, validate_run
from logstore.errors import ConfigError, CorruptRecordError, RecordNotFoundError, StoreError
from logstore.segment import blob_checksum
from replay.errors import NodeUnavailableError
from replay.reader import LogReader, RecordSource

__all__ = ["HttpRecordSource", "RemoteLogReader"]

logger = logging.getLogger(__name__)

_PAGE = 1000  # the server's default max_page_size


class HttpRecordSource:
    """One node server's records of one run, as a :class:`replay.reader.RecordSource`.

    Args:
        base_url: e.g. ``http://10.0.0.5:8080`` (the server's root, without ``/v1``).
        run: the run id.
        token: bearer token, if the server wants one for reads. Sent only over https or to a
            loopback address (ConfigError otherwise).
        timeout: seconds per request. retries: attempts on transport errors and 5xx (>= 1).
        client: an ``httpx.Client`` to reuse (then ``base_url`` is still used to build URLs).
        verify: TLS verification, as httpx takes it (an ``ssl.SSLContext`` that trusts a private CA;
            by default the system's CAs, or ``SSL_CERT_FILE``).
    """

    def __init__(
        self,
        base_url: str,
        run: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        client: httpx.Client | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.run = validate_run(run)
        self.token = token
        self.retries = max(1, int(retries))
        if token:
            _refuse_token_in_clear(self.base_url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = client is None
        self._client = client or httpx.Client(timeout=timeout, headers=headers, verify=verify)
        if client is not None and headers:
            self._client.headers.update(headers)

    def __repr__(self) -> str:
        return f"HttpRecordSource({self.base_url!r}, run={self.run!r})"

    def close(self) -> None:
        if self._own:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ RecordSource
    def get_blob(self, key: RecordKey) -> bytes:
        """The encoded record, checked against the server's checksum header."""
        url = f"{self.base_url}/v1/runs/{self.run}/records/{quote(str(key), safe='/')}/raw"
        r = self._request("GET", url, key=key)
        blob = r.content
        want = r.headers.get("X-Swiftlog-Checksum")
        if want is None:
            raise StoreError(
                f"{self.base_url} sent record {key} without X-Swiftlog-Checksum",
                key=key,
                hint="is this a swiftlog server (GET /v1/runs/{run}/records/{key}/raw)?",
            )
        if f"{blob_checksum(blob):016x}" != want.lower():
            raise CorruptRecordError(
                f"record {key} from {self.base_url} does not match its checksum {want} (corrupted in transit)", key=key
            )
        return blob

    def get(self, key: RecordKey) -> torch.Tensor:
        """The decoded tensor (both checksums verified)."""
        return codec.decode_tensor(self.get_blob(key), key=key)

    def keys(self, channel: Channel | None = None, it_lo: int = 0, it_hi: int | None = None) -> list[RecordKey]:
        """Every key of ``channel`` (all channels when None) in ``[it_lo, it_hi)``, in key order."""
        out: list[RecordKey] = []
        cursor: str | None = None
        while True:
            page = self._records_page(channel, it_lo, it_hi, cursor, _PAGE)
            if page is None:
                return out
            out.extend(RecordKey.parse(e["key"]) for e in page["records"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def _records_page(
        self, channel: Channel | None, it_lo: int, it_hi: int | None, cursor: str | None, limit: int
    ) -> dict[str, Any] | None:
        """One GET of the records endpoint (None for an empty range; a 404 raises)."""
        params: dict[str, Any] = {"it_lo": it_lo, "limit": min(limit, _PAGE)}
        if channel is not None:
            params["channel"] = channel.name
        if it_hi is not None:
            if it_hi <= it_lo:
                return None
            params["it_hi"] = it_hi
        if cursor is not None:
            params["cursor"] = cursor
        return self._request("GET", f"{self.base_url}/v1/runs/{self.run}/records", params=params).json()

    def gaps(self) -> list[dict[str, Any]]:
        """The gaps this node recorded for the run (channel, iteration, micro_batch, reason, at),
        from a fresh run summary; ``[]`` when the node has no such run."""
        try:
            summary = self._request("GET", f"{self.base_url}/v1/runs/{self.run}", params={"fresh": "true"}).json()
        except RecordNotFoundError:  # the run is unknown there: nothing was dropped there either
            return []
        return [dict(g) for g in summary.get("gaps", [])]

    # ------------------------------------------------------------------ what the planner reads
    #: a node server's cold tier is not read through it (give the run's cold tier as a source of its own)
    cold = None

    def describe(self) -> str:
        return f"node server {self.base_url}"

    def _or_empty(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        try:
            return self._request("GET", f"{self.base_url}/v1/runs/{self.run}{path}", params=params).json()
        except RecordNotFoundError:  # the run is not on that node
            return None

    def checkpoints(self) -> list[CheckpointInfo]:
        """The checkpoints the node knows (its hot tiers' and its cold tier's registrations)."""
        doc = self._or_empty("/checkpoints")
        return [] if doc is None else [CheckpointInfo(**c) for c in doc["checkpoints"]]

    def channels(self) -> list[Channel]:
        """Channels with records on the node (either tier), from a fresh run summary."""
        doc = self._or_empty("", {"fresh": "true"})
        return [] if doc is None else sorted(Channel.parse(c["name"]) for c in doc["channels"])

    def writers(self) -> list[str]:
        doc = self._or_empty("")
        return [] if doc is None else list(doc["hot"]["writers"])

    def list_records(
        self,
        channel: Channel | None = None,
        it_lo: int = 0,
        it_hi: int | None = None,
        *,
        after: RecordKey | None = None,
        limit: int = _PAGE,
    ) -> list[RecordInfo]:
        """One page of the node's records in key order, strictly after ``after`` (as
        ``LogStore.list_records``; ``segment`` is empty: the server does not say)."""
        try:  # the server's cursor is the last key, hex-encoded
            doc = self._records_page(channel, it_lo, it_hi, None if after is None else after.encode().hex(), limit)
        except RecordNotFoundError:  # the run is not on that node
            return []
        if doc is None:
            return []
        return [
            RecordInfo(
                RecordKey.parse(e["key"]),
                e["tier"],
                e["writer"],
                int(e["stored_bytes"]),
                e.get("raw_bytes"),
                int(e["checksum"], 16),
                "",
            )
            for e in doc["records"]
        ]

    # ------------------------------------------------------------------ HTTP
    def _request(
        self, method: str, url: str, *, key: RecordKey | None = None, params: dict[str, Any] | None = None
    ) -> httpx.Response:
        delay = 0.1
        last: str = ""
        for attempt in range(self.retries):
            try:
                r = self._reopening(method, url, params)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code < 400:
                    return r
                err = _error_body(r)
                if r.status_code == 404:
                    raise RecordNotFoundError(f"{err or 'not found'} (server {self.base_url})", key=key)
                if r.status_code == 409 and err and "corrupt" in err.lower():
                    raise CorruptRecordError(f"{err} (server {self.base_url})", key=key)
                if r.status_code in (401, 403):
                    raise StoreError(
                        f"{self.base_url} refused the request ({r.status_code}): {err}",
                        key=key,
                        hint="pass the server's token (--token / SWIFTLOG_TOKEN)",
                    )
                if r.status_code < 500:
                    raise StoreError(f"{self.base_url} answered {r.status_code} to {url}: {err}", key=key)
                last = f"HTTP {r.status_code}: {err}"
            if attempt + 1 < self.retries:
                time.sleep(delay)
                delay *= 2
        raise NodeUnavailableError(
            f"node server {self.base_url} unavailable after {self.retries} attempt(s): {last}",
            key=key,
            hint="check that `swiftlog serve` runs there, or read the records from the cold tier",
        )

    def _reopening(self, method: str, url: str, params: dict[str, Any] | None) -> httpx.Response:
        """One request; sent again at once, on a new connection, when the server closed the kept-alive one
        as it was reused (its keep-alive timer fired as the request left). Every request here is a GET."""
        try:
            return self._client.request(method, url, params=params)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            logger.debug("%s: connection closed under %s %s (%s); reopening", self.base_url, method, url, e)
            return self._client.request(method, url, params=params)


def _refuse_token_in_clear(url: str) -> None:
    """ConfigError for a plain-http URL of a host that is not a loopback address: a token sent there
    crosses the network in clear."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        return
    host = (parts.hostname or "").lower()
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"refusing to send the token over plain http to {url}: anyone on the way could read it",
            hint="serve with TLS (swiftlog serve --tls-cert/--tls-key) and use https://, "
            "or reach the server over loopback (an SSH tunnel)",
        )


def _error_body(r: httpx.Response) -> str:
    try:
        body = r.json()
        e = body.get("error", body) if isinstance(body, dict) else body
        return str(e.get("message", e)) if isinstance(e, dict) else str(e)
    except ValueError:
        return r.text[:300]


class RemoteLogReader(LogReader):
    """A LogReader over node servers (first server holding a key wins), then ``fallback`` sources.

    ``urls``: one base URL or several (e.g. the servers of the nodes of the failed stage's
    neighbours). ``fallback``: further sources tried after the servers (e.g. a cold-tier-only
    LogStore). The reader owns the HTTP sources it creates; :meth:`close` closes them.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        run: str,
        *,
        token: str | None = None,
        fallback: Sequence[RecordSource] = (),
        timeout: float = 30.0,
        retries: int = 3,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if token:
            for u in urls:  # before any client is made: none is left open
                _refuse_token_in_clear(u)
        self._http = [
            HttpRecordSource(u, run, token=token, timeout=timeout, retries=retries, verify=verify) for u in urls
        ]
        super().__init__([*self._http, *fallback])

    def close(self) -> None:
        for s in self._http:
            s.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
