"""replay/launcher.py refuses arguments it cannot act on at once, naming them (no process is started)."""

from __future__ import annotations

import pytest

from replay.launcher import KillSpec, RecoveryRun, resumed_after_rollback, run_with_failures


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((2, 5, 1, "sideways"), "KillSpec.phase must be one of forward, backward"),
        ((-1, 5), "KillSpec.stage must be an int >= 0, got -1"),
        ((1, "5"), "KillSpec.iteration must be an int >= 0, got '5'"),
        ((1, 5, True), "KillSpec.micro_batch must be an int >= 0, got True"),
    ],
)
def test_a_kill_spec_names_what_is_wrong(args: tuple, needle: str) -> None:
    """A phase the script does not know was accepted, and the run trained to its end before anything
    noticed (the demo's --phase sideways died 79 s later with a TypeError)."""
    with pytest.raises(ValueError, match=needle):
        KillSpec(*args)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kills": [KillSpec(4, 3)]}, r"stage\(s\) \[4\] outside the pipeline of 4 stages"),
        ({"replay_workers": 0}, "replay_workers must be an int >= 1"),
        ({"num_stages": 1}, "num_stages must be an int >= 2"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
    ],
)
def test_run_with_failures_refuses_what_it_cannot_run_before_starting(tmp_path, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        run_with_failures([], run_id="r", base_dir=str(tmp_path), checkpoint_url=f"file://{tmp_path}/ckpt", **kwargs)
    assert not any(tmp_path.iterdir())  # nothing was laid out, no process started


def test_resumed_after_rollback_refuses_a_missing_failure_iteration() -> None:
    """A run in which no failure happened has no resume iteration (None): this was the demo's
    ``TypeError: unsupported operand type(s) for -: 'NoneType' and 'int'``."""
    run = RecoveryRun(True, "rollback", "/nonexistent", 1.0, {}, {})
    with pytest.raises(ValueError, match=r"fail_iteration must be an int >= 1, got None \(did a failure happen\?\)"):
        resumed_after_rollback(run, None)  # type: ignore[arg-type]
