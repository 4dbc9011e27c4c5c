"""Packaging: what pyproject.toml declares, what an install without extras can do, and a wheel that works.

1. Every third-party module the shipped packages import is declared, in the base dependencies or
   in the extra of the layer that imports it: a training rank's install (logstore, trainer_client,
   replay) pulls neither the web server stack nor matplotlib.
2. On an install without the ``server`` extra, the library imports and ``swiftlog`` says in one
   line which extra to install.
3. The version is written once (pyproject.toml) and ``swiftlog --version`` reports it.
4. A wheel built from the checkout holds the four packages and the license, no tests or bench, and
   installed into a fresh virtual environment it runs ``swiftlog demo`` from another directory
   (slow).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("logstore", "trainer_client", "replay", "server")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# the server extra's modules and matplotlib: none of them is needed on a training node
NOT_ON_A_TRAINING_NODE = (
    "typer",
    "click",
    "rich",
    "pydantic",
    "pydantic_settings",
    "fastapi",
    "starlette",
    "uvicorn",
    "httptools",
    "uvloop",
    "matplotlib",
)


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def _declared(*extras: str) -> set[str]:
    names = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for extra in extras:
        names |= {_name(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]}
    return names


def _imports(path: Path) -> set[str]:
    """The top-level modules ``path`` imports (absolute imports, anywhere in the file)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.partition(".")[0])
    return out


def _extras_allowed(rel: str) -> tuple[str, ...]:
    """The extras whose packages the shipped module ``rel`` may import."""
    if "/testing" in rel or rel == "server/pytest_fixtures.py":
        return ("server", "demo", "dev")  # test tooling shipped with the packages: used by the test suite only
    if rel in ("server/cli/demo.py", "server/cli/simulate.py"):  # their plots: the demo extra, imported on use
        return ("server", "demo")
    if rel.startswith("server/"):
        return ("server",)
    return ()


def test_every_imported_package_is_declared_in_its_layer() -> None:
    """Each third-party import of the shipped packages maps to a declared distribution: the base
    dependencies for logstore, trainer_client and replay, the server extra for server/, the demo
    extra for the plots of ``swiftlog demo`` and ``swiftlog simulate --plot``."""
    first_party = set(PACKAGES)
    dists = importlib.metadata.packages_distributions()
    missing: list[str] = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            allowed = _declared(*_extras_allowed(rel))
            for mod in sorted(_imports(path) - first_party - set(sys.stdlib_module_names) - {"__future__"}):
                names = {_name(d) for d in dists.get(mod, [])}
                if not names & allowed:
                    missing.append(f"{rel}: {mod} ({', '.join(sorted(names)) or 'not installed'})")
    assert not missing, "imports not declared for their layer in pyproject.toml:\n" + "\n".join(missing)


def test_base_dependencies_leave_out_the_server_stack_and_matplotlib() -> None:
    base = _declared()
    for mod in NOT_ON_A_TRAINING_NODE:
        assert _name(mod) not in base, mod
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"server", "demo", "dev"} <= set(extras)
    assert "matplotlib" in {_name(r) for r in extras["demo"]}


_BLOCKER = textwrap.dedent(
    """
    import sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker:  # an install without the server and demo extras: these modules are absent
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    """
)


def _without_extras(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = _BLOCKER + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, ",".join(NOT_ON_A_TRAINING_NODE), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_training_node_install_imports_the_library_and_the_cli_names_the_extra() -> None:
    """Without the server and demo extras every module of logstore, trainer_client and replay imports
    (a package's ``__main__`` excepted: importing it runs it), and ``swiftlog`` says in one line
    which extra to install, exit 4."""
    p = _without_extras(
        """
        import importlib, pkgutil
        failed = []
        for pkg in ("logstore", "trainer_client", "replay"):
            for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
                if info.name.endswith(".__main__"):
                    continue
                try:
                    importlib.import_module(info.name)
                except Exception as e:
                    failed.append(f"{info.name}: {e!r}")
        assert not failed, failed
        print("imported")
        """
    )
    assert p.returncode == 0 and "imported" in p.stdout, p.stderr[-3000:]
    p = _without_extras(
        """
        sys.argv = ["swiftlog", "ls", "--root", "."]
        from server.cli import main
        main()
        """
    )
    assert p.returncode == 4, (p.returncode, p.stderr[-3000:])
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "pip install 'swiftlog[server]'" in p.stderr, p.stderr


def test_the_version_is_written_once_and_reported() -> None:
    version = PYPROJECT["project"]["version"]
    assert importlib.metadata.version("swiftlog") == version  # the installed metadata is pyproject's
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            assert "__version__ =" not in path.read_text(), path
    p = subprocess.run(
        [sys.executable, "-m", "server.cli", "--version"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stdout == f"swiftlog {version}\n", (p.stdout, p.stderr[-2000:])


def _source_copy(dest: Path) -> Path:
    """The checkout's files a build reads, and tests/ and bench/ beside them (they must stay out of
    the wheel), without build leftovers: an in-tree build never reuses a stale build/."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "out", "results")
    for name in (*PACKAGES, "tests", "bench"):
        shutil.copytree(REPO / name, dest / name, ignore=skip)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def _run(cmd: list[str | Path], **kw: object) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    assert p.returncode == 0, (cmd, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_wheel_installs_and_runs_the_demo_from_another_directory(tmp_path: Path) -> None:
    """Build the wheel (this venv's setuptools, no build isolation: nothing downloaded), check what it
    holds, install it without dependencies into a fresh venv that sees this venv's packages (torch
    comes from there, never from an index), and run ``swiftlog --version`` and a short
    ``swiftlog demo`` in an empty directory: the recovery is reported bit-exact."""
    version = PYPROJECT["project"]["version"]
    src = _source_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", wheels, src], timeout=600)
    (wheel,) = wheels.glob("swiftlog-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {*PACKAGES, f"swiftlog-{version}.dist-info"}, tops
    assert f"swiftlog-{version}.dist-info/licenses/LICENSE" in names, names
    assert "server/cli/demo.py" in names and "trainer_client/examples/train_resilient.py" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=300)
    py = venv / "bin" / "python"
    _run([*pip, "--python", py, "install", "--no-deps", "--no-index", "-q", wheel], timeout=600)
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # then this venv's site-packages, after the new one's: the dependencies, never a second swiftlog
    # (a path line adds a directory; its own .pth files, an editable install's among them, are not run)
    here = [p for p in sys.path if p.endswith("site-packages")]
    (Path(purelib) / "swiftlog_test_dependencies.pth").write_text("\n".join(here) + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    where = _run(
        [py, "-c", "import logstore, replay, server, trainer_client as t; print(t.__file__, server.__file__)"],
        cwd=work,
        env=env,
        timeout=300,
    ).stdout
    assert all(Path(f).is_relative_to(purelib) for f in where.split()), (where, purelib)
    swiftlog = venv / "bin" / "swiftlog"
    assert _run([swiftlog, "--version"], cwd=work, env=env, timeout=300).stdout == f"swiftlog {version}\n"
    args = ["demo", "--dir", "demo", "--iterations", "4", "--checkpoint-every", "2"]
    p = _run([swiftlog, *args], cwd=work, env=env, timeout=900)
    assert "recovery verified and bit-exact" in p.stdout, p.stdout[-3000:]
    report = json.loads((work / "demo" / "report.json").read_text())
    assert report["ok"] is True and report["final_state"]["bit_exact"] is True, report
