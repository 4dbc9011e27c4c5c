"""The README's quickstart, run exactly as printed: its Python block saved as quickstart.py, then
each command of the shell block after it, in a fresh directory, with this venv's ``python`` and
``swiftlog`` first on PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _quickstart_blocks() -> tuple[str, str]:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    python = [body for lang, body in blocks if lang == "python"]
    shell = [body for lang, body in blocks if lang == "bash"]
    assert len(python) == 1 and len(shell) == 1, "the quickstart has one python and one bash block"
    return python[0], shell[0]


def test_quickstart_names_everything_it_uses() -> None:
    code, _ = _quickstart_blocks()
    compile(code, "quickstart.py", "exec")  # a syntax error in the README fails here, fast
    assert "quickstart.py" in _quickstart_blocks()[1]


@pytest.mark.slow
def test_quickstart_runs_as_printed(tmp_path: Path) -> None:
    code, shell = _quickstart_blocks()
    (tmp_path / "quickstart.py").write_text(code)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # the installed packages, as a user has them
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "verified (16/16 sends checked)" in out, out
    recovered = sorted((tmp_path / "swiftlog-quickstart" / "recovered").rglob("*.pt"))
    assert [p.name for p in recovered] == ["it000000000008.pt"], recovered
    from trainer_client import load_checkpoint

    ck = load_checkpoint(str(recovered[0]))
    assert ck.iteration == 8 and ck.extra["recovered"]["verified"]
