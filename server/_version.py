"""The installed swiftlog version, read from the distribution's metadata.

``version`` in pyproject.toml is the one place the version is written; ``swiftlog --version``,
``server.__version__`` and the admin API's health answer all read it here.

Never: writes the version down a second time.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

__all__ = ["DISTRIBUTION", "version"]

DISTRIBUTION = "swiftlog"


def version() -> str:
    """The installed distribution's version; ``0+unknown`` for a source tree that was never installed."""
    try:
        return _distribution_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"
