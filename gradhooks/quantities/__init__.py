"""What the hooks compute from the pieces, for every layer: norms, squared sums, K-FAC factors.

``grad1`` itself is each piece's own (:meth:`gradhooks.pieces.Piece.grad1`); the rest is
computed here, once, from any piece: :mod:`.collector` holds the :class:`Collector` a handle hands
its pieces to, :mod:`.kfac` the Kronecker factors. This package reads pieces only: it imports
:mod:`gradhooks.pieces` (and the internals shim), never the engine.
"""

from .collector import _INTERNAL, QUANTITIES, Collector, total_norms
from .kfac import KfacAccumulator, KFactors, KFactorsInverse

__all__ = [
    "QUANTITIES",
    "Collector",
    "total_norms",
    "KFactors",
    "KFactorsInverse",
    "KfacAccumulator",
    "_INTERNAL",
]
