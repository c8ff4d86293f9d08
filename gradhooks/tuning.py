"""The thresholds that choose between equivalent ways of computing the same numbers.

Every choice here gives the same result (the tests run each path against the oracles); a
threshold only decides which way is faster or holds less memory. The values were measured on a
2-core CPU; each field says what was measured. Read them from :data:`TUNING`; change them for a
block with :func:`tuned` (or set a field of :data:`TUNING` for the process)::

    with gradhooks.tuned(sum_grad1_positions=1):   # every CPU Linear takes .grad from grad1
        loss.backward()
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import ConfigurationTypeError, require_number

__all__ = ["Tuning", "TUNING", "tuned"]


@dataclass
class Tuning:
    """The thresholds, by what they choose."""

    # -- quantities formed from a materialized grad1 (norms, squared sums) ---------------------
    chunk_elements: int = 1 << 21
    """The largest slice of examples whose per-example gradient (or the columns it is formed
    from) is materialized at once, in elements (2 Mi floats, 8 MiB): norms-only memory stays
    close to a plain backward's."""
    cache_elements: int = 1 << 18
    """A smaller slice where it still holds :attr:`cache_min_rows` examples: one that stays in
    a core's cache (256 Ki floats) while its squared norms and batch sum are read back
    (EmbedBlock's norms about 4% faster)."""
    cache_min_rows: int = 8
    """Fewer examples per cache-sized slice would cost more in per-slice overhead than the
    cache saves."""
    pass_macs: int = 16
    """What one pass over a float of a materialized per-example gradient (its squared norm,
    its batch sum) costs, in multiply-adds of the small batched matmuls of the Gram form:
    about 20 (EmbedBlock's Linear layers, 64 positions, 64 x 256), rounded down, which leaves
    the Gram form to the layers where it wins by a margin."""
    rows_counted_min_lookups: int = 1024
    """An Embedding's squared norms count the rows its lookups share (rather than compacting
    every lookup) from this many lookups on; below, the compaction's fewer operations cost
    less (EmbedBlock, 64 x 64 lookups of 1,000 rows: about 2x faster counted). On CPU only:
    deciding by the count would read it back from another device."""
    rows_counted_max_shared: float = 0.25
    """... and while at most this share of the lookups hit a row another lookup of the same
    example hits (else compacting all of them is cheaper)."""

    # -- the batch gradient taken from grad1 -----------------------------------------------------
    sum_grad1_positions: int = 32
    """From this many positions per example on, a CPU Linear (and a convolution, by output
    positions; a self-attention's projections, by tokens) takes its batch gradient as the sum
    of its ``grad1`` rather than by autograd: the sum reads batch x parameters floats,
    autograd's product costs 2 x batch x positions x parameters flops."""

    unused_grad_macs: int = 1 << 21
    """Where the backward to come wants no parameter gradient (after a book-keeping DP step), a
    CPU Linear or convolution whose batch gradient costs at least this many multiply-adds
    (rows x weight entries) runs detached, so that autograd does not form it to be thrown
    away: about what running a call detached costs the host (80-100 µs at one thread). The
    MLP 784-512-512-10 at batch 64: its DP step 0.96x the time."""
    unused_grad_macs_device: int = 1 << 30
    """The same off the CPU, where a step's host time is the price and a product of 2^30
    multiply-adds takes the device about what the detached call costs the host (not measured:
    a GPU's rate, about 10^13 multiply-adds a second, against 100 µs)."""

    # -- Linear ------------------------------------------------------------------------------------
    narrow_in_features: int = 8
    """A CPU Linear over positions with at most this many input features and more outputs (a
    LoRA adapter's B, whose inputs are the adapter's rank) forms ``grad1`` as the transposed
    product ``[batch, in, out]``, copied into place: the batched matmul runs a right operand
    this narrow 3-7x slower (768 to 1024 outputs, 128 positions; at 16 features the two
    tie)."""

    # -- convolutions ------------------------------------------------------------------------------
    conv_grouped_min_columns: int = 64
    """The fewest columns (``in_channels / groups * prod(kernel)``) for which a convolution
    weight's ``grad1`` is one convolution backward with the batch folded into the groups,
    rather than im2col columns and a batched matmul."""
    conv_grouped_call_elements: int = 1 << 20
    """The grouped form runs on slices of the batch that read and write about this many
    elements (input, output-gradient and gradient). At batch 64 on CifarCNN's and SimpleCNN's
    larger layers, slices of 13-15 examples took 5.1-5.8 ms whatever the state of the C
    allocator, where the whole batch in one call took 4.4-5.5 ms when freed memory was reused
    and 7.1-8.8 ms when its large buffers were fresh pages (common: glibc returns large blocks
    to the system)."""

    # -- K-FAC ---------------------------------------------------------------------------------------
    kfac_products_at_once: int = 1 << 22
    """The most elements the per-example products of a Kronecker factor form at once (16 MiB
    of float32) before being summed."""
    kfac_vmap_elements: int = 1 << 20
    """The most output-gradient elements of the hooked calls that one batched backward of
    :func:`gradhooks.kfac` forms (several of its backwards under ``vmap``)."""


TUNING = Tuning()
"""The thresholds in use."""


@contextlib.contextmanager
def tuned(**changes: float) -> Iterator[Tuning]:
    """Within the block, :data:`TUNING` with ``changes`` (field names of :class:`Tuning`)."""
    names = {f.name for f in dataclasses.fields(Tuning)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ConfigurationTypeError(f"gradhooks.tuned(): no threshold named {', '.join(unknown)}; "
                        f"the thresholds are {', '.join(sorted(names))}")  # fmt: skip
    for n, v in changes.items():  # (a string compared with a size fails deep in a rule)
        require_number(n, v, "gradhooks.tuned()")
    before = {n: getattr(TUNING, n) for n in changes}
    for n, v in changes.items():
        setattr(TUNING, n, v)
    try:
        yield TUNING
    finally:
        for n, v in before.items():
            setattr(TUNING, n, v)
