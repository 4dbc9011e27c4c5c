"""The package boundaries the layering promises, checked on the source.

import-linter (``make lint``, contracts in pyproject.toml) holds the layers and forbids import
cycles. What it cannot see is a *private name* reached across packages: ``from trainer_client.x
import _helper`` in replay, or ``mod._helper`` through a module alias. This test walks every
module of the four packages and refuses both.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("logstore", "trainer_client", "replay", "server")


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def private_names_across_packages(path: Path) -> list[str]:
    """``file:line: what`` for each private name this module takes from another package."""
    here = _top(path.relative_to(ROOT).as_posix().replace("/", "."))
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> module of another package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _top(node.module) != here:
            if _top(node.module) not in PACKAGES:
                continue
            for a in node.names:
                if _private(a.name) or any(_private(part) for part in node.module.split(".")[1:]):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}")
                else:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _top(a.name) in PACKAGES and _top(a.name) != here:
                    if any(_private(part) for part in a.name.split(".")[1:]):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}")
                    aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {base.id}.{node.attr} ({aliases[base.id]})")
    return found


def test_the_walk_finds_what_it_must(tmp_path: Path) -> None:
    """The checker itself, on planted code: each form is reported, a public name is not."""
    pkg = ROOT / "replay"
    probe = pkg / "_layers_probe_tmp.py"
    probe.write_text(
        "from trainer_client.checkpoint import _local_path, load_checkpoint\n"
        "from trainer_client.examples import launch as _launch\n"
        "import trainer_client._private_mod\n"
        "x = _launch._forkserver\n"
        "from replay.core import _internal  # same package: allowed\n"
    )
    try:
        found = private_names_across_packages(probe)
    finally:
        probe.unlink()
    text = "\n".join(found)
    assert "import _local_path" in text and "load_checkpoint" not in text
    assert "_launch._forkserver" in text and "import trainer_client._private_mod" in text
    assert "_internal" not in text


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_is_taken_from_another_package(path: Path) -> None:
    found = private_names_across_packages(path)
    assert not found, "private names reached across packages (make them public, or move the code):\n" + "\n".join(found)
