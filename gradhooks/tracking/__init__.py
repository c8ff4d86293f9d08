"""Where the batch is: the layouts that follow the batch dimension through eager torch code.

- :mod:`.layout`: :class:`Layout` (which dimension of a tensor holds the examples, and how),
  :data:`MIXED`, :data:`UNKNOWN`, :data:`PACKED`, :class:`Owners`;
- :mod:`.tracker`: :class:`Tracker`, the ``TorchFunctionMode`` that follows the batch through
  a forward, one torch function at a time, and what it knows of the forward so far;
- :mod:`.quick`: the short way through it, a call like one before given the layouts kept
  (:mod:`.memo`);
- :mod:`.propagate`: the long way, one torch function's effect on the layouts;
- :mod:`.rows`: rows of the examples picked, ranked or taken alone by what the forward computed;
- :mod:`.alone`: operations the tracker cannot see into, checked on one example alone;
- :mod:`.meeting`: where tensors derived from sources meet the batch;
- :mod:`.read`: numbers and rows read into Python from tensors computed across the examples;
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
from .propagate import SharedInput
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
    "SharedInput",
    "Aliases",
    "aliased",
    "note",
    "batch_rows",
    "example_mask",
]
