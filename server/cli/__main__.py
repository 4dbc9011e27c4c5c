"""``python -m server.cli``: the same as the ``swiftlog`` console script."""

from server.cli import main

main()
