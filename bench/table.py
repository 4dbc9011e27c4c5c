"""Print the benchmark table (markdown) from bench/results/*.json.

``python bench/table.py`` prints every row; ``--readme`` also rewrites the tables between the
``<!-- bench:start -->`` / ``<!-- bench:end -->`` markers: README.md gets the headline rows (those
with a target; the true/false checks summed up in one row naming any that is not true),
bench/README.md every row. Reads only results; a missing result file shows as
"not run".
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# (file, key, target text, "le"/"ge"/"eq" or None, bound)
ROWS: list[tuple[str, str, str, str | None, object]] = [
    ("store", "codec_ratio_bf16", ">= 1.45", "ge", 1.45),
    ("store", "zstd1_ratio_bf16", "(zstd-1 baseline)", None, None),
    ("store", "codec_ratio_fp32", ">= 1.18", "ge", 1.18),
    ("store", "zstd1_ratio_fp32", "(zstd-1 baseline)", None, None),
    ("store", "codec_compress_mbps_bf16", ">= 500 MB/s/core", "ge", 500),
    ("store", "codec_compress_vs_memcpy_bf16", "(memcpy = 1)", None, None),
    ("store", "hot_ingest_vs_raw_file", ">= 0.8", "ge", 0.8),
    ("store", "hot_ingest_vs_raw_file_fsync", "(fsync mode)", None, None),
    ("store", "cold_upload_vs_raw_put", ">= 0.8", "ge", 0.8),
    ("store", "lmdb_size_over_live", "<= 1.5", "le", 1.5),
    ("client", "overhead_ratio", "<= 1.05", "le", 1.05),
    ("client", "enqueue_us_per_mb", "", None, None),
    ("client", "copy_us_per_mb", "(plain copy of the same bytes)", None, None),
    ("client", "enqueue_over_copy", "<= 2", "le", 2.0),
    ("client", "bytes_per_iteration_raw", "", None, None),
    ("client", "bytes_per_iteration_stored", "", None, None),
    ("cuda", "overhead_ratio", "<= 1.05 (H200 stage, default: 4 encode threads)", "le", 1.05),
    ("cuda", "overhead_ratio_one_encode_thread", "(encode_threads=1)", None, None),
    ("cuda", "sync_copy_ratio", "(a logger copying with .cpu())", None, None),
    ("cuda", "d2h_pinned_gbps", "(side-stream copies, GB/s)", None, None),
    ("replay", "replay_vs_live", "<= 0.5", "le", 0.5),
    ("replay", "parallel_speedup_k2", ">= 1.6", "ge", 1.6),
    ("replay", "parallel_speedup_k2_fixed_share", "(same rounds, shares fixed up front)", None, None),
    (
        "replay",
        "parallel_speedup_k2_gloo_chain",
        "(same rounds, running sums over gloo, not shared memory)",
        None,
        None,
    ),
    ("replay", "parallel_speedup_k2_best_of", "(fastest over fastest)", None, None),
    ("replay", "parallel_speedup_k2_median", "(median over median)", None, None),
    ("replay", "parallel_speedup_k2_cpu", "(CPU time: a core per worker)", None, None),
    ("replay", "parallel_speedup_k2_ceiling", "(2 / slowdown of two busy cores)", None, None),
    ("replay", "parallel_speedup_k2_of_ceiling", "(speedup / ceiling)", None, None),
    ("replay", "parallel_max_abs_diff", "(approximate mode)", None, None),
    ("replay", "parallel_speedup_k4", "(K = 4 exact; needs 4 cores)", None, None),
    ("replay", "parallel_speedup_k8", "(K = 8 exact; needs 8 cores)", None, None),
    ("replay", "bit_exact", "true", "eq", True),
    ("replay", "interleaved.rank_replay_vs_live", "<= 0.5 (a rank of 2 Interleaved 1F1B stages)", "le", 0.5),
    ("replay", "interleaved.parallel_speedup_k2", "(the same rank, 2 workers per stage)", None, None),
    ("replay", "interleaved.bit_exact", "true", "eq", True),
    # the same replay bench on a lent GPU host's 16 idle cores (torch 2.11; bench/gpu_check.sh)
    ("replay_h200", "parallel_speedup_k2", ">= 1.6 (16 idle cores)", "ge", 1.6),
    ("replay_h200", "parallel_speedup_k2_ceiling", "(2 / slowdown of two busy cores)", None, None),
    ("replay_h200", "replay_vs_live", "(a core per live stage; by slots 8/11 = 0.73)", None, None),
    ("replay_h200", "bit_exact", "true", "eq", True),
    ("replay_h200", "verified", "true", "eq", True),
    ("recovery", "recovery_vs_global_rollback", "<= 0.3", "le", 0.3),
    ("recovery", "detect_s", "<= 1 s", "le", 1.0),
    ("recovery", "fetch_s", "", None, None),
    ("recovery", "replay_s", "", None, None),
    ("recovery", "rejoin_s", "", None, None),
    ("recovery", "replay_workers", "(replacement + helpers)", None, None),
    ("recovery", "bit_exact", "true", "eq", True),
    ("recovery", "interleaved.recovery_vs_global_rollback", "<= 0.3 (a rank of 2 interleaved stages lost)", "le", 0.3),
    ("recovery", "interleaved.replay_s", "(s; both stages, one after the other)", None, None),
    ("recovery", "interleaved.concurrent_recovery_vs_global_rollback", "(both stages at the same time)", None, None),
    ("recovery", "interleaved.bit_exact", "true", "eq", True),
    ("hybrid", "replica_recovery_vs_global_rollback", "<= 0.1 (dp2 x pp4, a replica copied)", "le", 0.1),
    ("hybrid", "replica_replacement_start_s", "(the replacement's process start, fork server)", None, None),
    ("hybrid", "transfer_gb_per_s", "(2.1 GB state, digest-checked, gloo on loopback)", None, None),
    ("hybrid", "all_replicas_lost_recovery_vs_global_rollback", "<= 0.35 (both replicas replayed)", "le", 0.35),
    ("hybrid", "overhead_ratio", "<= 1.05 (logging on every stage / off, hot tier)", "le", 1.05),
    ("hybrid", "overhead_ratio_file_cold_tier", "(and a file:// cold tier on the same disk)", None, None),
    ("fsdp", "fsdp_recovery_vs_global_rollback", "<= 0.5 (dp_shard2 x pp2, the shard group replays)", "le", 0.5),
    ("fsdp", "hsdp_recovery_vs_global_rollback", "<= 0.1 (dp2 x shard2 x pp2, a shard copied)", "le", 0.1),
    ("fsdp", "overhead_ratio", "<= 1.05 (the sharded job, logging on / off, hot tier)", "le", 1.05),
    ("fsdp", "bit_exact", "true", "eq", True),
    ("multihost", "node_loss_recovery_vs_global_rollback", "<= 0.4 (a node + its hot tier lost, spare)", "le", 0.4),
    (
        "multihost",
        "torchrun_restart_with_snapshots_vs_global_rollback",
        "<= 0.5 (torchrun, 60 its lost)",
        "le",
        0.5,
    ),
    ("multihost", "torchrun_restart_with_snapshots_vs_global_rollback_short", "(10 iterations lost)", None, None),
    ("multihost", "torchrun_breakeven_lost_s", "(s of lost work where the ratio is 0.5)", None, None),
    ("multihost", "torchrun_restart_overhead_s", "(s; torchrun's restart, paid with or without snapshots)", None, None),
    ("multihost", "torchrun_lost_rank_recovery_s", "(s; the lost rank's replay, 1 survivor helping)", None, None),
    ("multihost", "torchrun_lost_rank_recovery_alone_s", "(s; the same replay alone)", None, None),
    ("multihost", "node_loss_k2_vs_k1", "(a replay helper on a survivor node, over a 1 Gbit/s link)", None, None),
    ("multihost", "warm_spare_saving_s", "(s; fork server vs fresh interpreters)", None, None),
    ("multihost", "node_loss_recovery_s", "", None, None),
    ("multihost", "global_rollback_s", "", None, None),
    ("groups", "group_in_place_vs_kill_replay", "<= 0.6 (the planner's groups, stage 1 lost)", "le", 0.6),
    ("groups", "group_in_place_vs_kill_replay_2_2", "(groups [2,2]; pipeline bound 0.625 at m=4)", None, None),
    ("groups", "group_in_place_vs_kill_replay_4", "(one group of 4)", None, None),
    ("groups", "planner_within_budget", "true (half of all logged)", "eq", True),
    ("groups", "planner_prediction_error", "<= 0.25 (predicted vs measured recovery)", "le", 0.25),
    ("groups", "bit_exact", "true", "eq", True),
    ("sim", "prediction_error", "<= 0.25 (config B's training time, calibrated on A)", "le", 0.25),
    ("sim", "waste_prediction_error", "(the time B's failure added, same runs)", None, None),
    ("sim", "best_16k_no_replica", "(TP8 x PP16 x FSDP128, simulated)", None, None),
    ("sim", "wasted_16k_no_replica_best", "(its wasted fraction)", None, None),
    ("sim", "wasted_16k_no_replica_global_rollback", "(global rollback at its best interval)", None, None),
    ("sim", "paper_max_speedup", "(SWIFT over in-memory checkpoints; abstract: up to 1.16)", None, None),
    ("sim", "store_requests_per_s", "(the commit store, one TCPStore on loopback)", None, None),
    ("api", "summary_p99_ms", "<= 50 ms", "le", 50),
    ("api", "list_p99_ms", "<= 50 ms", "le", 50),
    ("api", "download_vs_bare_asgi", ">= 0.8 (verified download / bare app, same uvicorn)", "ge", 0.8),
    ("api", "download_bare_round_mb_s", "(MB/s, verified download)", None, None),
    ("api", "bare_asgi_mb_s", "(MB/s, bare app sending bytes in memory)", None, None),
    ("api", "download_vs_direct", "(verified download / LogStore.get_blob)", None, None),
    ("api", "download_ceiling_bare_asgi_vs_direct", "(bare uvicorn app, bytes in memory)", None, None),
]


def _fmt(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(*, headline: bool = False) -> str:
    """The table's markdown; ``headline``: only the rows with a target."""
    cache: dict[str, dict | None] = {}
    lines = ["| bench | metric | measured | target | met |", "|---|---|---|---|---|"]
    checks: list[tuple[str, object]] = []  # headline: the true/false checks, summed up in one row
    for f, key, target, op, bound in ROWS:
        if headline and op is None:
            continue
        if f not in cache:
            p = RESULTS / f"{f}.json"
            cache[f] = json.loads(p.read_text()) if p.exists() else None
        data = cache[f]
        v: object = data
        for part in key.split("."):  # "case.key": a key of a case's own results
            v = v.get(part) if isinstance(v, dict) else None
        if key == "enqueue_over_copy" and data and data.get("copy_us_per_mb"):
            v = data["enqueue_us_per_mb"] / data["copy_us_per_mb"]
        if headline and op == "eq" and bound is True:
            checks.append((f"{f}.{key}", v if data is not None else "not run"))
            continue
        met = ""
        if op is not None and v is not None:
            met = {"ge": operator.ge, "le": operator.le, "eq": operator.eq}[op](v, bound)
            met = "yes" if met else "**no**"
        lines.append(f"| {f} | `{key}` | {_fmt(v) if data is not None else 'not run'} | {target} | {met} |")
    if checks:
        bad = [name for name, v in checks if v is not True]
        lines.append(
            f"| all | bit-exact, verified, within budget | {len(checks) - len(bad)} of {len(checks)} true"
            f"{' (not: ' + ', '.join(bad) + ')' if bad else ''} | true | {'**no**' if bad else 'yes'} |"
        )
    return "\n".join(lines)


def _rewrite(path: Path, t: str) -> bool:
    """Replace the text between the bench markers of ``path``; False when it has none."""
    text = path.read_text()
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    if start not in text or end not in text:
        print(f"{path.relative_to(ROOT)} has no bench markers", file=sys.stderr)
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{t}\n{end}{tail}")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--readme", action="store_true", help="rewrite the tables in README.md (headline) and bench/README.md (all)"
    )
    args = ap.parse_args(argv)
    t = table()
    print(t)
    if args.readme:
        ok = _rewrite(ROOT / "README.md", table(headline=True))
        ok = _rewrite(ROOT / "bench" / "README.md", t) and ok
        return 0 if ok else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
