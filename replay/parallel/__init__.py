"""Parallel replay (SWIFT's parallel recovery): K workers share every iteration's micro-batches.

Each worker loads the same checkpoint(s) and replays a contiguous share of each iteration's
micro-batches, in the live backward order, sized by the workers' measured speeds (``shares``).
The parameter gradients are then reduced over the workers (``reducer``): exactly, as an ordered
chain that reproduces the sequential sum bit for bit (its running sums in shared memory on one
host: ``chain``), or approximately, by one all-reduce within a stated bound (``bounds``). Module
buffers a forward changes stay exact through "shadow" forwards (``buffers``). Every worker steps
identically; they compare a digest of their parameters and buffers, and worker 0 writes the
recovered checkpoint(s) (``worker``). :func:`run_parallel` starts K worker processes on this host;
under torchrun every rank runs ``python -m replay.parallel`` (``launch``).

The design, and why each part is as it is: ``docs/parallel-replay.md``.

Never: lets workers step with different gradients (they all use the reduced sum), or writes an
output when a worker failed or the workers' parameters differ.
"""

from replay.parallel.bounds import adamw_update_bound
from replay.parallel.launch import main, result_of, run_parallel
from replay.parallel.shares import balanced_counts, slice_of
from replay.parallel.worker import worker_main, worker_prefetch

__all__ = [
    "run_parallel",
    "worker_main",
    "worker_prefetch",
    "result_of",
    "slice_of",
    "balanced_counts",
    "adamw_update_bound",
    "main",
]
