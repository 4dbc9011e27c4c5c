"""Compare two checkouts' benchmarks by alternating runs: A, B, A, B, ... then the medians.

For a change meant to leave behaviour alone (a refactor): both checkouts run the same bench scripts
with this interpreter, one after the other, ``--runs`` times each, so drift of a shared machine
falls on both. Each checkout is imported from its own directory (``PYTHONPATH``), so both need the
same dependencies, which this interpreter's environment must hold.

    git worktree add --detach /tmp/before <ref>
    git worktree add --detach /tmp/after HEAD
    python bench/ab.py /tmp/before /tmp/after --runs 5 --out bench/results/ab.json

Prints one row per metric: the medians, their ratio (after / before) and whether it is within
``--tolerance``. The metrics are the benches' headline ratios, each over a baseline measured in the
same run (a raw file write, a plain copy, the live run, a global rollback): on a shared machine an
absolute rate moves by more than the tolerance between two runs of the same code. Runs already in
the work folder (``--out`` with ``.runs``) count too, so a second call adds runs to the first's.

Never: runs the checkouts at the same time (they would slow each other down).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# bench -> (script arguments, [(metric, "higher" or "lower" is better)]); a script without ``--out``
# writes the file OWN_RESULTS names, inside its checkout
BENCHES: dict[str, tuple[list[str], list[tuple[str, str]]]] = {
    "store": (
        ["bench/store_bench.py"],
        [
            ("codec_compress_vs_memcpy_bf16", "higher"),
            ("hot_ingest_vs_raw_file", "higher"),
            ("cold_upload_vs_raw_put", "higher"),
        ],
    ),
    "client": (
        ["bench/client_overhead.py"],
        [("overhead_ratio", "lower"), ("enqueue_over_copy", "lower")],
    ),
    "replay": (
        ["bench/replay_bench.py", "--rounds", "3", "--live-runs", "1", "--pair-rounds", "1", "--quiet-cores", "2"],
        [("replay_vs_live", "lower"), ("parallel_speedup_k2", "higher")],
    ),
    "recovery": (
        ["bench/recovery_bench.py", "--reps", "1"],
        [("recovery_vs_global_rollback", "lower"), ("recovery_s", "lower")],
    ),
}


OWN_RESULTS = {"recovery": "bench/results/recovery.json"}


def run_once(checkout: Path, bench: str, out: Path) -> dict:
    """One run of ``bench`` in ``checkout``; its results file as a dict."""
    args, _ = BENCHES[bench]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    own = OWN_RESULTS.get(bench)
    cmd = [sys.executable, *args, *([] if own else ["--out", str(out)])]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stdout[-2000:] + proc.stderr[-2000:]
        raise RuntimeError(f"{bench} in {checkout} failed ({proc.returncode}):\n{tail}")
    if own:
        out.write_bytes((checkout / own).read_bytes())
    return json.loads(out.read_text())


def compare(runs: dict[str, dict[str, list[dict]]], tolerance: float) -> list[dict]:
    """One row per metric: both medians, after / before, and whether it is within ``tolerance``."""
    rows = []
    for bench, sides in runs.items():
        for metric, better in BENCHES[bench][1]:
            med = {s: statistics.median(r[metric] for r in sides[s]) for s in ("before", "after")}
            ratio = med["after"] / med["before"] if med["before"] else float("nan")
            worse = ratio - 1 if better == "lower" else 1 - ratio  # > 0: the after side is slower
            rows.append(
                {
                    "bench": bench,
                    "metric": metric,
                    "before": med["before"],
                    "after": med["after"],
                    "after_over_before": ratio,
                    "within": worse <= tolerance,
                    "runs": len(sides["after"]),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bench", action="append", choices=sorted(BENCHES), help="default: every bench")
    ap.add_argument("--tolerance", type=float, default=0.05, help="slowdown allowed on a median (default 0.05)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/ab.json"))
    args = ap.parse_args(argv)
    benches = args.bench or list(BENCHES)
    work = args.out.with_suffix(".runs")
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[dict]]] = {b: {"before": [], "after": []} for b in benches}
    for bench in benches:  # earlier calls' runs
        for side in ("before", "after"):
            runs[bench][side] = [json.loads(f.read_text()) for f in sorted(work.glob(f"{bench}-{side}-*.json"))]
    first = min(len(runs[b][side]) for b in benches for side in ("before", "after"))
    for i in range(first, first + args.runs):
        for bench in benches:
            # alternate which side goes first, so neither always runs on a warmer machine
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                t = time.monotonic()
                res = run_once(getattr(args, side).resolve(), bench, work / f"{bench}-{side}-{i}.json")
                runs[bench][side].append(res)
                print(f"run {i} {bench:8s} {side:6s} {time.monotonic() - t:6.1f} s", flush=True)
    rows = compare(runs, args.tolerance)
    print(f"| bench | metric | before | after | after/before | within {args.tolerance:.0%} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['bench']} | `{r['metric']}` | {r['before']:.4g} | {r['after']:.4g} "
            f"| {r['after_over_before']:.3f} | {'yes' if r['within'] else '**no**'} |"
        )
    doc = {"before": str(args.before), "after": str(args.after), "runs": args.runs, "rows": rows}
    args.out.write_text(json.dumps(doc, indent=2))
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
