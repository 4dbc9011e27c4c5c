"""A user's own training script, run by path (``python train.py``, or its spawned ranks), replayed
with ``swiftlog replay`` as a new user would: the factory named by file path or by a module of the
current directory, the loss function found through META."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from logstore import Channel, LogStore, RecordKey
from replay.compare import states_equal
from replay.user_code import absolute_spec, is_script_spec, load_object
from trainer_client import load_checkpoint
from trainer_client.commit import loopback_store
from trainer_client.meta import decode_meta, script_defines_only

NET = """
import torch


def stage_module(stage):
    if stage == 0:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2))
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
"""

TRAIN = '''
"""A two-stage pipeline of its own (the sibling module's layers), 4 iterations, checkpoint at 1.

python train.py ROOT OUT PORT RANK   one rank, as torchrun would start it (a __main__ each)
python train.py ROOT OUT PORT spawn  both ranks, torch.multiprocessing.spawn (__mp_main__)
The TCPStore is hosted outside the ranks (by the caller)."""
import sys

import torch
import torch.distributed as dist

from mynet import stage_module
from trainer_client import ClientConfig, SwiftlogClient
{top_level}

def my_loss(out, target):
    return torch.nn.functional.mse_loss(out, target)


def make_stage(stage, num_stages, checkpoint, lr=0.05):
    torch.manual_seed(stage)
    module = stage_module(stage)
    return module, torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9), None


def train(rank, root, out, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2)
    config = ClientConfig(run_id="mine", stage=rank, num_stages=2, store_root=root, seed=3)
    client = SwiftlogClient(config, commit_store=store)
    module, opt, _ = make_stage(rank, 2, None)
    stage = client.pipeline_stage(module, "cpu", {io})
    client.schedule(stage, "1f1b", n_microbatches=2, loss_fn=my_loss)
    for it in range(4):
        if it == 1:
            client.checkpoint(1, module, opt)
        g = torch.Generator().manual_seed(it)
        client.step(it, torch.randn(4, 8, generator=g), target=torch.randn(4, 5, generator=g))
        client.commit(it)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert client.close().ok
    torch.save(module.state_dict(), f"{{out}}.{{rank}}")
    dist.destroy_process_group()


if __name__ == "__main__":
    root, out, port, how = sys.argv[1:5]
    if how == "spawn":
        torch.multiprocessing.spawn(train, args=(root, out, int(port)), nprocs=2)
    else:
        train(int(how), root, out, int(port))
'''


IO = (
    "input_args=torch.zeros(2, 16 if rank else 8, requires_grad=rank > 0), "
    "output_args=torch.zeros(2, 5 if rank else 16, requires_grad=True)"
)

# stage 0 also sends a float tensor computed without gradient, and stage 1 declares it so
NET_NOGRAD = """
import torch


class First(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, h.detach().square()


class Second(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 5)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, h, c):
        return self.lin(self.drop(h * (1 + c)))


def stage_module(stage):
    return Second() if stage else First()
"""

IO_NOGRAD = (
    "input_args=(torch.zeros(2, 16, requires_grad=True), torch.zeros(2, 16)) if rank else torch.zeros(2, 8), "
    "output_args=torch.zeros(2, 5, requires_grad=True) if rank "
    "else (torch.zeros(2, 16, requires_grad=True), torch.zeros(2, 16))"
)


def _project(tmp_path: Path, name: str, top_level: str = "", net: str = NET, io: str = IO) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "mynet.py").write_text(net)
    (proj / name).write_text(TRAIN.format(top_level=top_level, io=io))
    return proj


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}  # the user's directory is not on any path


def _train(proj: Path, script: str, how: str) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """Run the script's two ranks (two processes run by path, or one that spawns both) beside a
    TCPStore hosted here; the final state of each stage."""
    root, out = proj / f"store-{how}", proj / f"final-{how}"
    host = loopback_store(datetime.timedelta(seconds=120))
    cmd = [sys.executable, script, str(root), str(out), str(host.port)]
    procs = [
        subprocess.Popen([*cmd, rank], cwd=proj, env=_env(), stderr=subprocess.PIPE, text=True)
        for rank in (["spawn"] if how == "spawn" else ["0", "1"])
    ]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    return root, [torch.load(f"{out}.{k}") for k in (0, 1)]


def _swiftlog(proj: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # the console script (not python -m: that would put the directory on sys.path)
    exe = Path(sys.executable).with_name("swiftlog")
    assert exe.exists(), f"{exe}: the project is installed with its console script (make test installs it)"
    return subprocess.run([str(exe), *args], cwd=proj, env=_env(), capture_output=True, text=True, timeout=300)


def _meta(root: Path, stage: int = 1) -> dict:
    return decode_meta(LogStore.open(root, "mine").get(RecordKey(Channel.meta(stage), 2, 0)))


def _replayed(out: str, stage: int) -> dict[str, torch.Tensor]:
    (uri,) = [
        line.split(f"stage {stage}: ")[1].split()[0]
        for line in out.splitlines()
        if line.strip().startswith(f"stage {stage}: ")
    ]
    return load_checkpoint(uri).model


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return states_equal({"model": a}, {"model": b}) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ranks", "spawn"])
def test_a_script_run_by_path_is_replayed_by_its_file_and_meta_names_its_loss(tmp_path, how):
    """Ranks run as ``python train_mine.py ...`` (as torchrun starts them) or spawned by it: META
    names the loss by the script's path (its top level only defines things). From the script's
    directory, ``swiftlog replay --model train_mine.py:make_stage`` rebuilds either stage (the
    script's own ``import mynet`` works, its main block does not run; the last stage's loss comes
    from META) and equals the live run bit for bit, verified. ``--model train_mine:make_stage``
    finds the module in the current directory, as ``python -m`` would, in two parallel workers too."""
    proj = _project(tmp_path, "train_mine.py")
    root, live = _train(proj, "train_mine.py", how)
    assert _meta(root)["loss"] == f"{proj / 'train_mine.py'}:my_loss" and _meta(root)["loss_script"] is None
    cases = [(1, "train_mine.py:make_stage", "1")]
    if how == "ranks":  # (the spawned variant differs only in how META names the loss)
        cases += [(0, "train_mine.py:make_stage", "1"), (1, "train_mine:make_stage", "2")]
    for stage, model, workers in cases:
        r = _swiftlog(
            proj,
            "replay",
            "--run",
            "mine",
            "--root",
            str(root),
            "-s",
            str(stage),
            "--model",
            model,
            "-w",
            workers,
            "-o",
            str(tmp_path / f"out-{stage}-{workers}"),
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert " verified " in r.stdout and _same(_replayed(r.stdout, stage), live[stage]), (stage, model, workers)


@pytest.mark.slow
def test_an_input_declared_without_gradient_is_replayed_without_one(tmp_path):
    """A QA check: a float tensor sent without gradient (declared ``requires_grad=False`` in
    ``input_args``) got one in the replay, whose stage then sent back a gradient the live one never
    did ("missing digests", or "2 outputs need gradients but 1 were received" one stage up). META
    records what the receive buffers required (``recv_requires_grad``); both stages replay
    verified and bit-identical."""
    proj = _project(tmp_path, "train_nograd.py", net=NET_NOGRAD, io=IO_NOGRAD)
    root, live = _train(proj, "train_nograd.py", "ranks")
    assert _meta(root)["recv_requires_grad"] == [True, False]
    for stage in (0, 1):
        r = _swiftlog(
            proj,
            "replay",
            "--run",
            "mine",
            "--root",
            str(root),
            "-s",
            str(stage),
            "--model",
            "train_nograd.py:make_stage",
            "-o",
            str(tmp_path / f"out-{stage}"),
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert " verified " in r.stdout and _same(_replayed(r.stdout, stage), live[stage]), stage


SHORT = """
import torch

from mynet import First


class OneOut(First):
    def forward(self, x):
        return super().forward(x)[0]


def make_short(stage, num_stages, checkpoint, lr=0.05):
    module = OneOut()
    return module, torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9), None
"""


@pytest.mark.slow
def test_a_replay_that_sends_fewer_parts_than_the_live_stage_is_not_verified(tmp_path):
    """A QA check: "verified" meant that every send the replay made matched a digest, so a replay
    that made fewer sends than the live stage (here a factory whose module returns one of the
    two parts; in the check, a whole direction skipped) was "verified". A part the receiver kept a
    digest of that the replay did not send is a divergence, named."""
    proj = _project(tmp_path, "train_nograd.py", net=NET_NOGRAD, io=IO_NOGRAD)
    (proj / "short.py").write_text(SHORT)
    root, _ = _train(proj, "train_nograd.py", "ranks")
    r = _swiftlog(
        proj,
        "replay",
        "--run",
        "mine",
        "--root",
        str(root),
        "-s",
        "0",
        "--model",
        "short.py:make_short",
        "-o",
        str(tmp_path / "out"),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "act_0_1/it1/mb0/p1" in r.stdout + r.stderr and " verified " not in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_a_receiver_declaring_other_parts_than_its_sender_is_refused_before_the_first_step(tmp_path):
    """A QA check: a stage whose ``input_args`` declared a larger buffer than the previous stage's
    ``output_args`` received garbage silently (gloo aborts only when more arrives than declared).
    Each stage puts its declaration into the commit store; the receiver compares before its first
    step and raises, naming both."""
    wide = IO.replace(
        "torch.zeros(2, 16 if rank else 8, requires_grad=rank > 0)",
        "torch.zeros(2, 17 if rank else 8, requires_grad=rank > 0)",
    )
    proj = _project(tmp_path, "train_wide.py", io=wide)
    host = loopback_store(datetime.timedelta(seconds=120))
    cmd = [sys.executable, "train_wide.py", str(proj / "store"), str(proj / "final"), str(host.port)]
    procs = {
        rank: subprocess.Popen([*cmd, rank], cwd=proj, env=_env(), stderr=subprocess.PIPE, text=True)
        for rank in ("0", "1")
    }
    try:
        _, err = procs["1"].communicate(timeout=120)
    finally:
        procs["0"].kill()
        procs["0"].communicate()
    assert procs["1"].returncode != 0
    assert (
        "stage 1 declares that it receives float32 [2, 17] (input_args), "
        "but stage 0 declares that it sends float32 [2, 16] (output_args)"
    ) in err, err[-3000:]


@pytest.mark.slow
def test_a_script_that_runs_code_at_import_is_not_loaded_unasked(tmp_path):
    """A top level that does more than define things (here a print) could start training again if
    loaded: META leaves ``loss`` empty, the replay's error names the function by path, and passing
    it as ``--loss`` replays the last stage exactly."""
    proj = _project(tmp_path, "train_loud.py", top_level='print("top level ran", file=sys.stderr)')
    root, live = _train(proj, "train_loud.py", "ranks")
    meta = _meta(root)
    script = f"{proj / 'train_loud.py'}:my_loss"
    assert meta["loss"] is None and meta["loss_script"] == script
    args = [
        "replay",
        "--run",
        "mine",
        "--root",
        str(root),
        "-s",
        "1",
        "--model",
        "train_loud.py:make_stage",
        "-o",
        str(tmp_path / "out"),
    ]
    r = _swiftlog(proj, *args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"the live schedule's loss_fn is {script}" in r.stderr and f"--loss {script}" in r.stderr
    r = _swiftlog(proj, *args, "--loss", "train_loud.py:my_loss")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " verified " in r.stdout and _same(_replayed(r.stdout, 1), live[1])


def test_script_defines_only_reads_the_top_level(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text(
        textwrap.dedent('''
        """doc"""
        import os
        try:
            import numpy as np
        except ImportError:
            np = None
        X: int = 3
        def f(): return os.getpid()
        class C: pass
        if __name__ == "__main__":
            f()
        ''')
    )
    assert script_defines_only(str(ok))
    for body in (
        "f()\n",
        "for i in range(3): pass\n",
        'if __name__ == "__main__":\n    pass\nelse:\n    print(1)\n',
        "def broken(:\n",
        "with open('x') as f: pass\n",
    ):
        bad = tmp_path / "bad.py"
        bad.write_text("import os\n" + body)
        assert not script_defines_only(str(bad)), body
    assert not script_defines_only(str(tmp_path / "missing.py"))


def test_load_object_by_path_and_its_errors(tmp_path, monkeypatch):
    """A file is loaded once, under a name that is not ``__main__``; what is wrong is named."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "helper_mod_for_load.py").write_text("VALUE = 41\n")
    (tmp_path / "prog.py").write_text(
        "import helper_mod_for_load\nRAN = []\nclass K:\n    def m(self): return helper_mod_for_load.VALUE + 1\n"
        "if __name__ == '__main__':\n    raise SystemExit('main ran')\n"
    )
    (tmp_path / "boom.py").write_text("raise RuntimeError('no config file')\n")
    monkeypatch.chdir(tmp_path)
    try:
        k = load_object("prog.py:K")
        assert k().m() == 42 and load_object(f"{tmp_path / 'prog.py'}:K") is k  # once per process
        assert is_script_spec("a/b:c") and is_script_spec("b.py:c") and not is_script_spec("pkg.mod:c")
        assert (
            absolute_spec("prog.py:K") == f"{tmp_path / 'prog.py'}:K"
            and absolute_spec("pkg.mod:f") == "pkg.mod:f"
            and absolute_spec(None) is None
        )
        with pytest.raises(ValueError, match=r"no such file .*nope\.py.* \(from 'nope\.py:f'\)"):
            load_object("nope.py:f")
        with pytest.raises(ValueError, match=r"loading .*boom\.py.* raised RuntimeError: no config file"):
            load_object("boom.py:f")
        with pytest.raises(ValueError, match=r"has no attribute 'L'"):
            load_object("prog.py:L")
        with pytest.raises(ValueError, match=r"is not 'module:attribute' or 'path/to/file.py:attribute'"):
            load_object("prog.py")
    finally:
        for name in [
            n for n, m in sys.modules.items() if n.startswith("swiftlog_script_") or n == "helper_mod_for_load"
        ]:
            del sys.modules[name]
