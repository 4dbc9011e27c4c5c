"""The ``swiftlog`` command line: thin subcommands over :class:`server.node.Node`.

One module per subcommand group (litestream's layout)::

    inspect.py     ls, stat, show, export
    maintain.py    verify, gc, flush, unregister
    recover.py     plan
    groups.py      profile, plan-groups
    simulate.py    simulate
    serve.py       serve
    demo.py        demo
    replay.py      replay (loaded on first use, see _app._Group)
    _app.py        the typer app that registers them, and ``--version``

Common options: ``--root`` (env SWIFTLOG_ROOT), ``--run/-r``, ``--cold-url`` (env SWIFTLOG_COLD_URL;
a malformed URL is refused before anything runs), ``--json`` on every inspection command. One
spelling per concept across commands: ``--stage/-s`` a failed (or, in the demo, killed) stage,
``--target-iteration/-t``, ``--workers/-w`` replay processes, ``--output/-o``. An old spelling
stays as a hidden option that still works and prints a deprecation note (``plan --failed/-f``,
``demo --replay-workers``).

Exit codes (:mod:`server.errors`): 0 ok, 1 problems found, 2 usage or bad input, 3 not found,
4 unavailable. Under ``--json`` an error is one JSON object on stdout (``{"error": {"type",
"message", "hint", "exit_code", ...}}``, see ``_common.py``), with the same exit code.

The command line needs the ``server`` extra (typer, rich, pydantic...). Without it, :func:`main`
says in one line which extra to install and exits 4. This module imports none of them.

Never: imports typer, click, rich or pydantic at import time (an install without the extra must
reach :func:`main`).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from server.errors import EXIT_UNAVAILABLE

__all__ = ["app", "main"]

# the top-level modules of the server extra that the command line imports
_SERVER_EXTRA = frozenset(
    {"typer", "click", "rich", "pydantic", "pydantic_settings", "fastapi", "starlette", "uvicorn", "httptools"}
)

if TYPE_CHECKING:
    from server.cli._app import app


def main() -> None:
    """Console-script entry point (``swiftlog = "server.cli:main"``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from server.cli._app import app
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in _SERVER_EXTRA:
            raise
        print(
            f"swiftlog: the command line needs the server extra ({missing} is not installed): "
            "pip install 'swiftlog[server]'",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_UNAVAILABLE) from None
    app()


def __getattr__(name: str) -> Any:
    if name == "app":  # the typer app, built on first use (it needs the server extra)
        from server.cli._app import app

        return app
    raise AttributeError(f"module 'server.cli' has no attribute {name!r}")
