"""Parallel replay (K workers, gloo) on logs of real 4-stage pipeline runs.

Exact mode (ordered reduction) must equal sequential replay byte for byte (and so the live run);
approximate mode must stay within the stated bound (replay/parallel.py): per iteration, from equal
states, |g_parallel - g_sequential| <= 2 gamma_{n-1} sum_i |g_i| elementwise; over the run the
parameters within 2 C sum_t lr_t (C: AdamW's update bound). Workers are spawned with
torch.multiprocessing and, once, launched with torchrun.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from logstore import Channel, RecordKey
from logstore.testing import free_port
from replay import (
    ReplayHooks,
    ReplayJob,
    SourceSpec,
    jobs_from_plan,
    plan_recovery,
    replay,
    replay_stages,
)
from replay.errors import ReplayError, ReplayInputMissingError, ReplayOrderError
from replay.parallel import adamw_update_bound, balanced_counts, slice_of
from replay.parallel.chain import SHM_DIR, SharedChain, remove_stale_chains
from replay.parallel.reducer import GradReducer
from replay.parallel.shares import Claims, Share, share_layout
from replay.reader import LogReader
from replay.stage import StageState
from replay.states import build_states, checkpoint_of
from server.testing import subprocess_env
from tests._replay_helpers import (
    CKPT,
    ITERS,
    NUM_STAGES,
    checkpoint_vs_live,
    copy_run_files,
    state_bytes_differ,
)
from trainer_client import load_checkpoint
from trainer_client.examples.gpt import loss_fn
from trainer_client.meta import decode_meta

pytest_plugins = ["tests._replay_fixtures"]


def _job(run, stages, out: Path, **kw) -> ReplayJob:
    kw.setdefault("sources", [run.spec()])
    return ReplayJob(
        run=run.run_id,
        num_stages=NUM_STAGES,
        stages=list(stages),
        stop_iteration=ITERS,
        output=str(out),
        checkpoints={k: run.results[k]["checkpoints"][CKPT] for k in stages},
        **{**run.job_fields(), **kw},
    )


def test_slices_are_contiguous_balanced_and_cover_everything():
    for n in range(9):
        for k in range(1, 5):
            parts = [slice_of(list(range(n)), r, k) for r in range(k)]
            assert [x for part in parts for x in part] == list(range(n)) and max(map(len, parts)) - min(
                map(len, parts)
            ) <= 1
    assert slice_of([3, 1, 2, 0], 1, 2) == [2, 0]  # the live backward order, not sorted


def test_balanced_counts_give_the_slower_worker_fewer_micro_batches_and_are_optimal():
    for n in range(9):
        for k in range(1, 5):  # speeds unknown: the equal split of slice_of
            assert balanced_counts(n, None, k) == [len(slice_of(list(range(n)), r, k)) for r in range(k)]
            assert balanced_counts(n, [1.0] * (k - 1) + [0.0], k) == balanced_counts(n, None, k)
    assert balanced_counts(8, [1.0, 1.0], 2) == [4, 4]
    assert balanced_counts(8, [1.0, 1.1], 2) == [4, 4]  # a one-micro-batch move would not pay
    assert balanced_counts(8, [1.0, 1.4], 2) == [5, 3]
    assert balanced_counts(8, [1.0, 100.0], 2) == [7, 1]  # everyone keeps at least one (its speed stays measured)
    assert balanced_counts(1, [1.0, 1.0], 2) == [1, 0]
    for n in range(1, 10):
        for times in ([1.0, 2.0], [3.0, 1.0, 2.0], [1.0, 1.0, 5.0], [2.0, 1.5, 1.5]):
            k = len(times)
            got = balanced_counts(n, times, k)
            assert sum(got) == n and (n < k or min(got) >= 1)
            best = min(
                max(c * t for c, t in zip(cs, times, strict=True)) for cs in _splits(n, k) if n < k or min(cs) >= 1
            )
            assert max(c * t for c, t in zip(got, times, strict=True)) == best


def test_gradient_buckets_are_contiguous_runs_of_one_dtype():
    """The exact chain sends each bucket as one slice of its dtype's flat buffer: a bucket never mixes
    dtypes or exceeds the limit (a bigger parameter goes alone), and the slices tile the buffers."""
    m = torch.nn.Module()
    shapes = [
        ((300, 300), torch.float32),
        ((10,), torch.float32),
        ((64, 64), torch.bfloat16),
        ((8,), torch.bfloat16),
        ((600, 600), torch.float32),
        ((5,), torch.float32),
    ]
    for i, (shape, dt) in enumerate(shapes):
        m.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape, dtype=dt)))
    red = GradReducer([StageState(0, m, torch.optim.SGD(m.parameters(), lr=0.1))], 0, 1, exact=True, start=0)
    assert red.buckets == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]  # 600x600 fp32 > 1 MiB: alone
    covered = {dt: 0 for dt in red.dtypes}
    for b, r in enumerate(red.buckets):
        flat = red._flat(red.acc, b)
        assert flat.dtype == m.get_parameter(f"p{r.start}").dtype and flat.numel() == sum(
            m.get_parameter(f"p{i}").numel() for i in r
        )
        assert flat.data_ptr() == red.acc[flat.dtype].data_ptr() + covered[flat.dtype] * flat.element_size()
        covered[flat.dtype] += flat.numel()
    assert covered == red.sizes


def _splits(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for c in range(n + 1):
        for rest in _splits(n - c, k - 1):
            yield (c, *rest)


def test_a_slow_worker_gets_fewer_micro_batches_and_the_replay_stays_bit_identical(f1b_run, tmp_path):
    stage = 2
    seq = replay(_job(f1b_run, [stage], tmp_path / "seq"))
    # prefetch 1: iteration i's split follows the times measured up to i - 2 (fixed shares: no claims)
    job = _job(
        f1b_run,
        [stage],
        tmp_path / "par",
        workers=2,
        prefetch=1,
        model="tests._replay_helpers:slow_second_worker_gpt_stage",
        dynamic_share_min_s=None,
    )
    par = replay(job)
    a, b = checkpoint_of(seq, stage), checkpoint_of(par, stage)
    assert state_bytes_differ(a.model, a.optimizer, b.model, b.optimizer) == []
    assert par.verified and par.report.micro_batches == seq.report.micro_batches
    assert par.split[CKPT] == par.split[CKPT + 1] == [2, 2], par.split  # nothing measured yet: the equal split
    assert all(sum(par.split[it]) == 4 and par.split[it][1] < par.split[it][0] for it in (CKPT + 2, CKPT + 3)), (
        par.split
    )


def test_share_layouts_partition_the_micro_batches_and_claims_split_the_contested_ones_once():
    """Sure and contested positions tile range(n); whatever order a pair's claims come in, the front
    worker ends with a prefix and the back worker with the rest of the pair's positions."""
    store = dist.HashStore()
    for n in range(0, 10):
        for k in range(1, 5):
            for counts in {tuple(balanced_counts(n, None, k)), tuple(balanced_counts(n, [1.0] + [2.5] * (k - 1), k))}:
                lay = [share_layout(n, counts, r, k) for r in range(k)]
                tiles = sorted(p for sure, cont, front in lay for p in [*sure, *(cont if front else ())])
                assert tiles == list(range(n)), (n, k, counts, lay)
                for r in range(0, k - 1, 2):  # a pair: claims interleaved at random
                    (sa, ca, _), (sb, cb, _) = lay[r], lay[r + 1]
                    assert ca == cb and sa.stop == ca.start and cb.stop == sb.start
                    claims = Claims(dist.PrefixStore(f"{n}-{k}-{counts}-{r}", store))
                    shares = [Share(range(n), sa, ca, True, "x"), Share(range(n), sb, cb, False, "x")]
                    got: list[list[int]] = [list(sa), list(sb)]
                    rng = random.Random(n * 31 + k)
                    while not all(sh.done for sh in shares):
                        w = rng.randrange(2)
                        pos = claims.take(shares[w])
                        if pos is not None:
                            got[w].append(pos)
                    assert sorted(got[0]) == list(range(sa.start, sa.start + len(got[0])))  # a prefix, claimed in order
                    assert sorted(got[0] + got[1]) == list(range(sa.start, sb.stop))
                    claims.forget(shares[0])


def test_dynamic_shares_only_where_a_micro_batch_is_worth_a_claim():
    """Claims cost a store round trip: iterations share dynamically only when the slowest worker's
    micro-batch took at least claim_min_s, measured lag iterations before (the same numbers on
    every worker), or before anything was measured (freshly started workers differ most)."""
    m = torch.nn.Linear(2, 2)
    red = GradReducer(
        [StageState(0, m, torch.optim.SGD(m.parameters(), lr=0.1))],
        0,
        2,
        exact=True,
        start=5,
        lag=2,
        claims=Claims(dist.HashStore()),
        claim_min_s=0.02,
    )
    try:
        assert red.schedule.dynamic(5) and red.schedule.dynamic(6)
        red.schedule.per_mb[5] = [0.01, 0.01]
        assert not red.schedule.dynamic(7)
        red.schedule.per_mb[6] = [0.03, 0.03]
        assert red.schedule.dynamic(8)
        assert red.schedule.select(8, list(range(8))) == [0, 1] and red.schedule.likely(8, list(range(8))) == [
            2,
            3,
        ]  # sure, then its side of the boundary
        assert red.schedule.select(7, list(range(8))) == [0, 1, 2, 3]  # fixed
        red.schedule.claim_min_s = 0.0
        assert red.schedule.dynamic(7)
    finally:
        red.close()


def test_dynamic_shares_move_micro_batches_off_a_slow_worker_at_once_and_stay_bit_identical(f1b_run, tmp_path):
    """With claims, worker 0 takes over contested micro-batches in the very first iterations, before
    any speed was measured (fixed shares start at [2, 2], see above); the result is still every byte
    of the sequential replay's (the chain adds in backward order whoever replayed what)."""
    stage = 2
    seq = replay(_job(f1b_run, [stage], tmp_path / "seq"))
    par = replay(
        _job(
            f1b_run,
            [stage],
            tmp_path / "par",
            workers=2,
            prefetch=1,
            model="tests._replay_helpers:slow_second_worker_gpt_stage",
            dynamic_share_min_s=0,
        )
    )
    a, b = checkpoint_of(seq, stage), checkpoint_of(par, stage)
    assert state_bytes_differ(a.model, a.optimizer, b.model, b.optimizer) == []
    assert par.verified and par.report.micro_batches == seq.report.micro_batches
    assert all(sum(c) == 4 for c in par.split.values())
    assert par.split[CKPT][0] + par.split[CKPT + 1][0] > 4, par.split  # worker 1's forwards take seven times as long


def _shm_usable() -> bool:
    """Whether this host's /dev/shm can hold a shared chain (worker 0's own test of it)."""
    path = SharedChain.create(SHM_DIR, 1 << 16, b"probe")
    if path is not None:
        os.unlink(path)
    return path is not None


@pytest.mark.parametrize(
    ("workers", "run_name", "stage", "shm"),
    [
        pytest.param(2, "gpipe_s3_run", 1, True, marks=pytest.mark.slow),
        (3, "f1b_run", 3, True),
        (2, "f1b_run", 2, False),
    ],
)
def test_exact_parallel_replay_is_bit_identical_to_sequential(workers, run_name, stage, shm, request, tmp_path):
    run = request.getfixturevalue(run_name)
    seq = replay(_job(run, [stage], tmp_path / "seq"))
    seen = []
    # the gloo case also fetches ahead in a thread whatever the host's cores (the default may not here)
    par = replay(
        _job(run, [stage], tmp_path / "par", workers=workers, shared_memory=shm, prefetch=None if shm else 2),
        on_progress=seen.append,
    )
    # the running sums travel through /dev/shm when asked for and possible, else over gloo
    assert par.chain == ("shared memory" if shm and _shm_usable() else "gloo")
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith("swiftlog-chain-")] if os.path.isdir(SHM_DIR) else True
    a, b = checkpoint_of(seq, stage), checkpoint_of(par, stage)
    assert state_bytes_differ(a.model, a.optimizer, b.model, b.optimizer) == []  # every byte, -0.0 included
    assert checkpoint_vs_live(b, run.results[stage]) == []
    assert (
        par.states is None
        and par.verified
        and b.extra["recovered"]["workers"] == workers
        and b.extra["recovered"]["exact"]
    )
    r, s = par.report, seq.report
    assert (r.micro_batches, r.sends_generated, r.digests_checked) == (
        s.micro_batches,
        s.sends_generated,
        s.digests_checked,
    )
    assert (
        r.steps_checked == s.steps_checked == ITERS - CKPT and r.grad_mismatches == []
    )  # the chain's sums are the live step's gradients
    assert r.losses == s.losses and r.loss_micro_batches == s.loss_micro_batches
    assert [p.done for p in seen] == list(range(1, ITERS - CKPT + 1)) and seen[-1].workers == workers
    assert par.replay_seconds > 0 and par.setup_seconds > 0 and par.seconds >= par.replay_seconds


def test_exact_parallel_replay_of_a_logging_group(groups_run, tmp_path):
    with groups_run.store() as st:
        (job,) = jobs_from_plan(
            plan_recovery(st, [2]),
            sources=[groups_run.spec()],
            workers=2,
            output=str(tmp_path),
            **groups_run.job_fields(),
        )
    assert job.stages == [2, 3]
    res = replay(job)
    for k in (2, 3):
        assert checkpoint_vs_live(checkpoint_of(res, k), groups_run.results[k]) == [], f"stage {k}"
    assert res.verified


def _sequential_first_gradients(run, job: ReplayJob) -> tuple[list[torch.Tensor | None], list[float], dict]:
    """Sequential replay capturing the summed, not yet scaled, gradients of the first iteration."""
    states = build_states(job.replace(workers=1))
    grads: list[torch.Tensor | None] = []
    lrs: list[float] = []

    def before_step(it: int, scale: int) -> None:
        lrs.append(max(g["lr"] for st in states for g in st.optimizer.param_groups))
        if it == CKPT:
            grads.extend(None if p.grad is None else p.grad.clone() for st in states for p in st.module.parameters())

    replay_stages(
        states,
        LogReader(run.store()),
        num_stages=NUM_STAGES,
        stop_iteration=ITERS,
        loss_fn=loss_fn,
        hooks=ReplayHooks(before_step=before_step),
    )
    return grads, lrs, states[0].module.state_dict()


@pytest.mark.parametrize("workers", [2, 3])
def test_approximate_parallel_replay_stays_within_the_stated_bound(workers, f1b_run, tmp_path):
    job = _job(f1b_run, [2], tmp_path / "out", workers=workers, exact=False, dump_gradients=str(tmp_path / "grads"))
    par = replay(job)
    seq_grads, lrs, seq_model = _sequential_first_gradients(f1b_run, job)
    dump = torch.load(tmp_path / "grads" / f"grads-it{CKPT:012d}.pt")
    assert dump["exact"] is False and len(dump["grads"]) == len(seq_grads)
    worst = 0.0
    for g_par, g_seq, bound in zip(dump["grads"], seq_grads, dump["bound"], strict=True):
        assert (g_par is None) == (g_seq is None)
        if g_par is not None:
            err = (g_par - g_seq).abs()
            assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
            worst = max(worst, float(err.max()))
    # the dumped bounds are float32 products (rounded to nearest), the reported one the float64 product: equal
    # within an ulp
    assert 0 < par.grad_error_bound and par.grad_error_bound >= max(
        float(b.max()) for b in dump["bound"] if b is not None
    ) * (1 - 2**-23)
    # the whole replay: within 2 C sum(lr) of the sequential one (loose), and in fact tiny
    ck = checkpoint_of(par, 2)
    diff = max(float((ck.model[n] - t).abs().max()) for n, t in seq_model.items())
    assert diff <= 2 * adamw_update_bound(0.9, 0.999) * sum(lrs)
    assert diff < 1e-4
    # only the first iteration is verifiable (states are equal there); the result never claims more
    n_mb = f1b_run.gpt.n_microbatches
    r = par.report
    assert (
        r.digests_checked == 2 * n_mb and r.digest_mismatches == [] and r.sends_generated == 2 * n_mb * (ITERS - CKPT)
    )
    assert r.steps_checked == 0 and r.grad_mismatches == []  # its sums have other bits than the live step's by design
    assert not par.verified and any("approximate" in w for w in r.warnings)


@pytest.mark.parametrize(("workers", "stage", "exact"), [(2, 1, True), (3, 0, True), (2, 3, False)])
def test_parallel_replay_reproduces_buffers_updated_in_forward(workers, stage, exact, batchnorm_run, tmp_path):
    """BatchNorm's running statistics follow every micro-batch's forward in the live order: each worker
    also runs the other workers' forwards (found necessary in the first iteration), so the recovered
    buffers equal the live ones byte for byte, whichever worker's slice a micro-batch was in."""
    live = batchnorm_run.results[stage]
    assert any("running_mean" in name for name in live["model"]), "the run has no BatchNorm"
    par = replay(_job(batchnorm_run, [stage], tmp_path / "par", workers=workers, exact=exact))
    ck = checkpoint_of(par, stage)
    if exact:
        assert checkpoint_vs_live(ck, live) == [] and par.verified
    else:  # the approximate gradients move the parameters, and with them the statistics, a little
        for name, t in live["model"].items():
            if "running" in name:
                assert torch.allclose(ck.model[name], t, rtol=1e-4, atol=1e-6), name
            elif "num_batches_tracked" in name:
                assert torch.equal(ck.model[name], t), name
    assert (
        par.report.micro_batches == (ITERS - CKPT) * batchnorm_run.gpt.n_microbatches
    )  # shadow forwards are not counted


def test_buffers_changed_in_the_backward_follow_the_live_order_alone_and_are_refused_in_parallel(
    recompute_bn_run, tmp_path
):
    """BatchNorm inside torch.utils.checkpoint: the backward re-runs the block's forward and updates
    the running statistics again, so they depend on the live interleaving of forwards and backwards
    (1F1B: F0 F1 F2 B0 F3 B1 ... on stage 1). No send depends on them (training mode normalises
    with the micro-batch's own statistics), so no digest would catch a wrong order: a replay that
    ran F0 B0 F1 B1 said "verified" with other statistics. Alone, a stage now replays in the live
    order, bit for bit; a parallel or group replay, which cannot, says so instead of verifying."""
    run = recompute_bn_run
    for stage in range(NUM_STAGES):
        res = replay(_job(run, [stage], tmp_path / f"seq{stage}"))
        assert res.verified and checkpoint_vs_live(checkpoint_of(res, stage), run.results[stage]) == [], stage
    with run.store(cold=False) as st:
        order = decode_meta(st.get(RecordKey(Channel.meta(1), CKPT, 0)))["order"]
    assert [k for k, _ in order[:3]] == ["F", "F", "F"], order  # live, stage 1 did not run F0 B0 F1 B1
    with pytest.raises(
        ReplayOrderError,
        match=r"backward changed module buffers \(stage 1 blocks\.0\.ln2\.num_batches_tracked.*one worker",
    ) as ei:
        replay(_job(run, [1], tmp_path / "par", workers=2))
    assert str(ei.value).count("(hint:") == 1, str(ei.value)  # a worker's error is passed on with its hint once
    with pytest.raises(ReplayOrderError, match="group replay runs one order for stages whose live orders differ"):
        replay(_job(run, [1, 2], tmp_path / "group"))


def test_a_group_whose_stages_ran_one_order_replays_buffers_changed_in_the_backward(recompute_bn_gpipe_run, tmp_path):
    """Under GPipe every stage ran all forwards, then all backwards: a group replay of two stages
    follows that order, and their statistics end bit for bit as live."""
    run = recompute_bn_gpipe_run
    res = replay(_job(run, [1, 2], tmp_path / "group"))
    assert res.verified
    for stage in (1, 2):
        assert checkpoint_vs_live(checkpoint_of(res, stage), run.results[stage]) == [], stage


def test_frozen_parameters_replay_in_parallel_as_sequentially(f1b_run, tmp_path):
    # differs from the live run: compared with the sequential replay only
    model = "tests._replay_helpers:frozen_ln_gpt_stage"
    seq = replay(_job(f1b_run, [1], tmp_path / "seq", model=model, verify=False))
    par = replay(_job(f1b_run, [1], tmp_path / "par", model=model, verify=False, workers=2))
    a, b = checkpoint_of(seq, 1), checkpoint_of(par, 1)
    assert state_bytes_differ(a.model, a.optimizer, b.model, b.optimizer) == []
    start = load_checkpoint(f1b_run.results[1]["checkpoints"][CKPT])
    assert torch.equal(b.model["blocks.0.ln1.weight"], start.model["blocks.0.ln1.weight"])  # frozen: untouched
    assert not torch.equal(b.model["blocks.0.ln2.weight"], start.model["blocks.0.ln2.weight"])


def test_a_buffer_change_after_a_quiet_first_iteration_is_an_error(f1b_run, tmp_path):
    job = _job(f1b_run, [2], tmp_path / "out", workers=2, model="tests._replay_helpers:late_buffer_gpt_stage")
    with pytest.raises(
        ReplayError,
        match=rf"module buffers changed in iteration {CKPT + 1} \(stage 2 late_count\) but not in iteration {CKPT}",
    ):
        replay(job, timeout_s=300)
    assert not (tmp_path / "out").exists()


def test_a_worker_error_names_the_missing_record(f1b_run, tmp_path):
    _, cold = copy_run_files(f1b_run, tmp_path)
    for p in (Path(cold[len("file://") :]) / f1b_run.run_id / "segments" / "grad_2_1").glob("000000000004-*"):
        p.unlink()
    job = _job(f1b_run, [1], tmp_path / "out", workers=2, sources=[SourceSpec(kind="cold", location=cold)])
    with pytest.raises(ReplayInputMissingError) as ei:
        replay(job, timeout_s=300)
    assert str(ei.value.key) == "grad_2_1/it4/mb0/p0" and "worker 0" in str(ei.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_torchrun_launches_the_same_workers(f1b_run, tmp_path):
    job = _job(f1b_run, [2], tmp_path / "out", workers=2)
    (tmp_path / "job.json").write_text(json.dumps(job.to_dict()))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "replay.parallel",
        "--job",
        str(tmp_path / "job.json"),
        "--result",
        str(tmp_path / "res.json"),
    ]
    p = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert '"verified": true' in p.stdout
    res = json.loads((tmp_path / "res.json").read_text())
    assert (
        res["workers"] == 2
        and res["report"]["verified"]
        and res["report"]["micro_batches"] == (ITERS - CKPT) * f1b_run.gpt.n_microbatches
    )
    assert checkpoint_vs_live(load_checkpoint(res["outputs"]["2"]), f1b_run.results[2]) == []


def _open_shared_chain(rank: int, port: int, hide_file_on_rank1: bool, out: str, directory: str) -> None:
    """Spawned worker: open the shared chain with a partner; rank 1 may be made not to see the file
    (as a worker on another host or in another IPC namespace would not)."""
    import os as _os

    from replay.parallel.chain import SharedChain as _Chain

    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=__import__("datetime").timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        if hide_file_on_rank1 and rank == 1:
            real = _os.path.exists
            _os.path.exists = lambda p: (
                False if str(p).startswith(_os.path.join(directory, "swiftlog-chain-")) else real(p)
            )  # type: ignore[assignment]
        sizes = {torch.float32: 1000, torch.bfloat16: 17}
        sc = _Chain.open(sizes, rank, directory=directory)
        got = {"mapped": sc is not None}
        if sc is not None:  # one worker's writes are the other's reads, in both parity buffers
            if rank == 0:
                sc.bufs[0][torch.float32].fill_(3.5)
                sc.bufs[1][torch.bfloat16].fill_(-2.0)
            dist.barrier()
            got["seen"] = [float(sc.bufs[0][torch.float32].sum()), float(sc.bufs[1][torch.bfloat16].sum())]
            got["shapes"] = [sc.bufs[p][dt].numel() for p in (0, 1) for dt in sizes]
        dist.barrier()
        Path(out, f"{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("hide", [False, True])
def test_the_shared_chain_is_mapped_by_every_worker_or_by_none(hide, tmp_path):
    """Both workers see the same memory through the file; when one cannot map it, neither uses it
    (the sums then go over gloo), and the file is gone either way. The file lives in a directory
    of the test's own (the mechanism is the same as in /dev/shm, which a host may lack)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    torch.multiprocessing.start_processes(
        _open_shared_chain, args=(free_port(), hide, str(tmp_path), str(shm)), nprocs=2, start_method="spawn"
    )
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    if hide:
        assert got == [{"mapped": False}, {"mapped": False}]
    else:
        assert all(g["mapped"] and g["seen"] == [3500.0, -34.0] and g["shapes"] == [1000, 17, 1000, 17] for g in got), (
            got
        )
    assert list(shm.iterdir()) == []


def test_a_chain_file_a_killed_worker_left_is_removed_once_older_than_the_rendezvous_timeout(tmp_path):
    """Worker 0 unlinks its file once every worker mapped it; SIGKILLed in between, it leaves the
    file (tmpfs memory) behind. The next creation in that directory removes chain files older than
    the rendezvous timeout, and nothing else."""
    stale, young, other = tmp_path / "swiftlog-chain-abc", tmp_path / "swiftlog-chain-def", tmp_path / "unrelated"
    for p in (stale, young, other):
        p.write_bytes(b"x")
    hour_ago = time.time() - 3600
    for p in (stale, other):
        os.utime(p, (hour_ago, hour_ago))
    path = SharedChain.create(str(tmp_path), 1 << 12, b"token")
    assert path is not None and sorted(os.listdir(tmp_path)) == sorted([young.name, other.name, os.path.basename(path)])
    os.unlink(path)
    assert remove_stale_chains(str(tmp_path), older_than_s=0.0) == [young.name] and sorted(os.listdir(tmp_path)) == [
        other.name
    ]
    assert remove_stale_chains(str(tmp_path / "missing")) == []


def test_workers_fetch_ahead_only_with_a_spare_core_or_a_remote_source(f1b_run, tmp_path):
    """No prefetch thread when the workers fill every core and read only this host's files (it would
    only compete for the GIL); with a core to spare, or a source behind a network, it stays."""
    from replay.job import SourceSpec
    from replay.parallel import worker_prefetch

    local = _job(
        f1b_run,
        [1],
        tmp_path,
        sources=[
            SourceSpec(kind="store", location="/n0", cold_url="file:///c"),
            SourceSpec(kind="cold", location="file:///c"),
        ],
    )
    assert local.prefetch is None and local.fetch_ahead == 2  # the default decides per host
    assert worker_prefetch(local, 2, cores=2) == 0 and worker_prefetch(local, 3, cores=2) == 0
    assert worker_prefetch(local, 2, cores=16) == 2
    assert (
        worker_prefetch(local.replace(prefetch=3), 2, cores=2) == 3
        and worker_prefetch(local.replace(prefetch=0), 2, cores=16) == 0
    )  # as asked
    for remote in (
        SourceSpec(kind="http", location="http://127.0.0.1:1"),
        SourceSpec(kind="cold", location="s3://b/p"),
        SourceSpec(kind="store", location="/n1", cold_url="s3://b/p"),
    ):
        assert worker_prefetch(local.replace(sources=[*local.sources, remote]), 2, cores=2) == 2
