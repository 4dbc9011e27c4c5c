"""Each package's public names, pinned: a name added to or dropped from an ``__all__`` is a decision,
made here on purpose, never a side effect of a refactor.

Each package has its own test function. What a user calls is in its package's ``__all__``; the
rest is internal (underscore modules or names, or not re-exported).
"""

from __future__ import annotations

import importlib


def _exports(package: str) -> set[str]:
    mod = importlib.import_module(package)
    names = set(mod.__all__)
    for name in names:
        assert getattr(mod, name) is not None, (package, name)
    return names


def test_server_exports() -> None:
    """The admin API (app, settings, serve), the node it serves, the version; the CLI's entry point."""
    assert _exports("server") == {"Settings", "create_app", "Node", "serve", "__version__"}
    assert _exports("server.cli") == {"app", "main"}
    assert _exports("server.errors") == {
        "RunNotFoundError",
        "CheckpointNotFoundError",
        "BadRequestError",
        "NoColdTierError",
        "NotAvailableError",
        "AuthError",
        "DemoRunError",
        "Problem",
        "classify",
        "plain_message",
        "EXIT_OK",
        "EXIT_PROBLEMS",
        "EXIT_USAGE",
        "EXIT_NOT_FOUND",
        "EXIT_UNAVAILABLE",
        "EXIT_INTERRUPTED",
    }
