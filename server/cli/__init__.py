"""The ``swiftlog`` command line: thin subcommands over :class:`server.node.Node`.

One module per subcommand group (litestream's layout)::

    inspect.py     ls, stat, show, export
    maintain.py    verify, gc, flush, unregister
    recover.py     plan
    replay.py      replay
    serve.py       serve
    demo.py        demo

Common options: ``--root`` (env SWIFTLOG_ROOT), ``--run/-r``, ``--cold-url`` (env SWIFTLOG_COLD_URL;
a malformed URL is refused before anything runs), ``--json`` on every inspection command. One
spelling per concept across commands: ``--stage/-s`` a failed (or, in the demo, killed) stage,
``--target-iteration/-t``, ``--workers/-w`` replay processes, ``--output/-o``. An old spelling
stays as a hidden option that still works and prints a deprecation note (``plan --failed/-f``,
``demo --replay-workers``).

Exit codes: 0 ok, 1 problems found, 2 usage or bad input, 3 not found, 4 unavailable. Under
``--json`` an error is one JSON object on stdout (``{"error": {"type", "message", "hint",
"exit_code", ...}}``, see ``_common.py``), with the same exit code.
"""

from __future__ import annotations

import logging

import typer

from server.cli import demo, inspect, maintain, recover, replay, serve

__all__ = ["app", "main"]


app = typer.Typer(
    name="swiftlog",
    help="Inspect and maintain swiftlog log stores; serve the admin API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _mod in (inspect, maintain, recover, serve, demo, replay):
    _mod.register(app)


def main() -> None:
    """Console-script entry point (``swiftlog = "server.cli:main"``)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
