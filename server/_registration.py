"""The checks a checkpoint registration passes unless it is forced.

A registration makes the logs below it garbage, so the admin API refuses what is surely a
mistake: a stage beyond the run's stages, an iteration beyond its logs, no ``uri``, or a ``uri``
this node cannot read as a checkpoint of that run, stage and iteration. It reads local paths,
``file://``, and ``s3://`` with the cold tier's options, by the checkpoint's pickle alone.

Never: fetches a URL of another scheme, or tells a missing file from a file of another kind.
"""

from __future__ import annotations

import os
from typing import Any

from logstore.errors import SwiftlogError
from server.errors import BadRequestError
from server.models import CheckpointRequest, RunSummary

__all__ = ["check_checkpoint_file", "check_registration"]


def check_registration(
    s: RunSummary, req: CheckpointRequest, *, cold_url: str | None, cold_options: dict[str, Any]
) -> None:
    """BadRequestError for what is surely a mistake, since it would make logs garbage (see
    :meth:`server.node.Node.register_checkpoint`). ``s`` is the run's summary, fresh."""
    run = s.run
    named = {st for c in s.channels for st in (c.src, c.dst)}
    if named and req.stage > max(named):
        raise BadRequestError(
            f"stage {req.stage} is beyond the stages of run {run!r} "
            f"(its channels name stages {min(named)}..{max(named)})",
            hint='check the stage; pass "force": true to register it anyway',
        )
    last = max(
        (
            t.last_iteration
            for c in s.channels
            for t in (c.hot, c.cold)
            if t is not None and t.last_iteration is not None
        ),
        default=None,
    )
    if last is not None and req.iteration > last + 1:
        raise BadRequestError(
            f"iteration {req.iteration} is beyond the logs of run {run!r} (last logged iteration {last}): "
            f"it would make every record stage {req.stage} received garbage",
            hint='check the iteration; pass "force": true to register it anyway',
        )
    if req.uri is None:
        raise BadRequestError(
            f"a registration of stage {req.stage} at iteration {req.iteration} without a uri cannot be checked",
            hint='give the uri the checkpoint was saved to; pass "force": true to register it anyway',
        )
    check_checkpoint_file(run, req.stage, req.iteration, req.uri, cold_url=cold_url, cold_options=cold_options)


def check_checkpoint_file(
    run: str, stage: int, iteration: int, uri: str, *, cold_url: str | None, cold_options: dict[str, Any]
) -> None:
    """BadRequestError unless ``uri`` is a swiftlog checkpoint of ``run``'s ``stage`` at ``iteration``:
    read here (a local path or file://, or s3:// with the cold tier's options), by its pickle alone.
    A missing file and a file of another kind get the same answer: the check reveals no file."""
    scheme = uri.split("://", 1)[0] if "://" in uri else None
    unchecked = 'pass "force": true to register it unchecked'
    if scheme is not None and scheme != scheme.lower():
        raise BadRequestError(
            f"checkpoint uri {uri!r}: the scheme must be lower case (fsspec does not know {scheme!r})",
            hint="e.g. file:///ckpt/stage00001/it000000000005.pt or s3://bucket/...",
        )
    local = uri[len("file://") :] if scheme == "file" else (uri if scheme is None else None)
    if local is not None and not os.path.isabs(local):
        raise BadRequestError(
            f"checkpoint uri {uri!r} is a relative path: it would be read relative to whichever process reads it",
            hint="give an absolute path (file:///abs/path/it000000000005.pt) or a URL",
        )
    options: dict[str, Any] = {}
    if scheme in ("s3", "s3a"):
        if not (cold_url or "").startswith(("s3://", "s3a://")):
            raise BadRequestError(
                f"checkpoint uri {uri!r} cannot be checked: no S3 cold tier here whose credentials read it",
                hint=unchecked,
            )
        options = cold_options
    elif local is None:
        raise BadRequestError(
            f"checkpoint uri {uri!r} cannot be checked: the server reads checkpoints from local paths, file:// "
            f"and s3:// only (it never fetches {scheme}:// URLs)",
            hint=unchecked,
        )
    from trainer_client.checkpoint import read_identity  # (only for registrations)

    try:
        ident = read_identity(uri, storage_options=options)
    except SwiftlogError:
        ident = None
    if ident is None or (ident.run_id, ident.stage, ident.iteration) != (run, stage, iteration):
        raise BadRequestError(
            f"checkpoint uri {uri!r} is not a readable swiftlog checkpoint of run {run!r}, stage {stage}, "
            f"iteration {iteration}",
            hint="register a checkpoint once it is durable, with the uri save_checkpoint returned; "
            'pass "force": true if it is readable elsewhere',
        )
