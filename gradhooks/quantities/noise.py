"""The gradient noise scale of a batch, from its per-example gradients' squared sums and mean.

McCandlish et al., *An Empirical Model of Large-Batch Training* (2018): with per-example
gradients ``g_i`` of a batch of ``B`` examples drawn from the data, ``G`` the true gradient and
``Σ`` the per-example gradients' covariance, the *simple noise scale* ``B_simple = tr(Σ) / |G|²``
is the batch size around which a larger batch stops paying for itself. From one batch, with
``ḡ = mean_i g_i``, unbiased estimates of both parts are

    tr(Σ) ≈ S = B / (B - 1) · (mean_i |g_i|² - |ḡ|²)
    |G|²  ≈ |ḡ|² - S / B

(``E|ḡ|² = |G|² + tr(Σ) / B``). Each is noisy on one small batch, and ``|G|²``'s estimate can be
negative: the paper averages each part over many steps (an exponential moving average) before
dividing, and so should a caller of :func:`noise_scale`.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..errors import StateError

__all__ = ["NoiseScale", "noise_scale"]


class NoiseScale(NamedTuple):
    """One batch's estimates (0-dimensional float64 tensors on the parameters' device): ``trace`` of the per-example
    gradients' covariance ``tr(Σ)``, ``grad_sq`` the true gradient's squared norm ``|G|²``,
    and ``simple`` their ratio ``B_simple`` (average ``trace`` and ``grad_sq`` over steps before
    dividing: one batch's ratio is noisy, and ``grad_sq`` may be negative)."""

    trace: Tensor
    grad_sq: Tensor
    simple: Tensor


def noise_scale(sum_sq: dict[str, Tensor], means: dict[str, Tensor], batch: int) -> NoiseScale:
    """The estimates over every parameter of ``sum_sq`` (``Σ_i g_i²``, per element) and
    ``means`` (``mean_i g_i``, per element), of a batch of ``batch`` examples."""
    if batch < 2:
        raise StateError(
            f"the noise scale needs the spread of the examples' gradients: the last backward had "
            f"{batch} example(s), and at least 2 are needed (tr(Σ) has B - 1 in its denominator)"
        )
    # (on the parameters' device, in float64: nothing is read back to the host)
    mean_sq = sum(s.double().sum() for s in sum_sq.values()) / batch
    bar_sq = sum(m.double().square().sum() for m in means.values())
    trace = batch / (batch - 1) * (mean_sq - bar_sq)
    grad_sq = bar_sq - trace / batch
    return NoiseScale(trace, grad_sq, trace / grad_sq)
