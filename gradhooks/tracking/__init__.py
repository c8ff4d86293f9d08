"""Where the batch is: the layouts that follow the batch dimension through eager torch code.

- :mod:`.layout`: :class:`Layout` (which dimension of a tensor holds the examples, and how),
  :data:`MIXED`, :data:`UNKNOWN`, :data:`PACKED`, :class:`Owners`;
- :mod:`.tracker`: :class:`Tracker`, the ``TorchFunctionMode`` that follows the batch through
  a forward, one torch function at a time;
- :mod:`.ops`: how each torch function moves the batch, one module per family of operations
  (views, elementwise, reductions, linear algebra, indexing, joins, nn, fft);
- :mod:`.sources`: batch-free tensors whose per-example gradients are wanted, and where they
  meet the batch;
- :mod:`.aliases`: the mode that hands every torch function a parameter's alias;
- :mod:`.tensormap`: :class:`~.tensormap.TensorMap`, what the tracker knows of each tensor, by
  identity, holding none alive.

This package imports nothing from :mod:`gradhooks.engine`."""

from .aliases import Aliases, aliased
from .layout import MIXED, PACKED, UNKNOWN, Layout, Owners, batch_rows, example_mask
from .sources import Source
from .tracker import Tracker, note

__all__ = [
    "Layout",
    "Owners",
    "UNKNOWN",
    "PACKED",
    "MIXED",
    "Tracker",
    "Source",
    "Aliases",
    "aliased",
    "note",
    "batch_rows",
    "example_mask",
]
