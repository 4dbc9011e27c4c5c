"""The error bounds of approximate parallel replay.

Approximate parallel replay sums the workers' gradients in another order than the sequential
replay. Any order of a floating-point sum of ``n`` terms is within ``gamma_{n-1} * sum |g_i|`` of
the exact sum, elementwise (:func:`gamma`), so the reduced gradient is within
``2 * gamma_{n-1} * sum |g_i|`` of the sequential one. :func:`adamw_update_bound` bounds the size
of one AdamW update, which turns that into a bound on the parameters. ``docs/parallel-replay.md``
("approximate") derives both.
"""

from __future__ import annotations

import math

import torch

__all__ = ["adamw_update_bound", "gamma"]


def gamma(k: int, dtype: torch.dtype) -> float:
    """``gamma_k = k u / (1 - k u)`` for ``dtype``'s unit roundoff ``u``: the relative error bound of
    a floating-point sum of ``k + 1`` terms in any order."""
    u = torch.finfo(dtype).eps / 2
    return k * u / (1 - k * u)


def adamw_update_bound(beta1: float = 0.9, beta2: float = 0.999) -> float:
    """``C``: the largest size of one AdamW update direction ``m_hat / sqrt(v_hat)`` (``docs/parallel-replay.md``).

    Valid when ``beta1**2 < beta2`` and the bias-correction factor ``sqrt(1 - b2**t) / (1 - b1**t)``
    stays <= 1 (true for the default betas); raises ValueError otherwise.
    """
    if not beta1**2 < beta2:
        raise ValueError(f"the bound needs beta1**2 < beta2, got {beta1}, {beta2}")
    worst = max(math.sqrt(1 - beta2**t) / (1 - beta1**t) for t in range(1, 100_000, 7))
    if worst > 1.0 + 1e-12:
        raise ValueError(f"bias correction exceeds 1 ({worst:.3f}) for betas ({beta1}, {beta2})")
    return (1 - beta1) / math.sqrt(1 - beta2) / math.sqrt(1 - beta1**2 / beta2)
