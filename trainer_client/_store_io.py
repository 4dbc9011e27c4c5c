"""A client's log store at the end: everything uploaded, then closed (shared by both clients).

Never raises a logging fault: a failure is returned as text (and noted as a "flush" fault).
"""

from __future__ import annotations

from logstore import LogStore
from logstore.errors import SwiftlogError
from trainer_client.writer import AsyncLogWriter

__all__ = ["close_store", "upload_all"]


def upload_all(store: LogStore, writer: AsyncLogWriter, timeout: float | None = None) -> tuple[int, str | None]:
    """Upload every segment to the cold tier: (segments uploaded, None), or (0, why) after noting
    a "flush" fault. Never raises a logging fault."""
    try:
        return store.flush(timeout), None
    except SwiftlogError as e:
        error = f"{type(e).__name__}: {e}"
        writer.note_fault("flush", error)
        return 0, error


def close_store(store: LogStore, timeout: float | None) -> str | None:
    """Close ``store`` within ``timeout`` (at least 1 s; None: 30 s); why it failed, or None."""
    try:
        store.close(timeout=30.0 if timeout is None else max(timeout, 1.0))
    except SwiftlogError as e:
        return f"{type(e).__name__}: {e}"
    return None
