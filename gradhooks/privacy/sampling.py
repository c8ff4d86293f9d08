"""Poisson sampling: the batches that DP-SGD's privacy analysis assumes.

The privacy accountant (:class:`gradhooks.PrivacyAccountant`) assumes that every batch holds
every example independently with probability ``q = expected_batch_size / num_examples``: batches
vary in size (binomial, mean ``expected_batch_size``) and may be empty. A shuffled epoch of
fixed-size batches is a different mechanism, with other guarantees. With such batches, divide
the noisy clipped sum by the *expected* batch size, not the batch's own:
``gradhooks.dp_sgd_step(..., expected_batch_size=...)``.

Two ways to draw them:

- :class:`PoissonSampler`, batches of indices, for plain tensors (``x[idx]``) or as a
  ``DataLoader``'s ``batch_sampler``;
- :func:`poisson_loader`, a ``DataLoader`` with that sampler whose empty batches are tensors
  with 0 rows (the default collate fails on an empty batch).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.dataloader import default_collate

from .._torch import tree_map
from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    GradhooksWarning,
    is_whole,
    require_number,
)

__all__ = ["PoissonSampler", "poisson_loader"]


class PoissonSampler(Sampler[list[int]]):
    """Batches of indices into ``range(num_examples)`` in which each example is, independently,
    with probability ``sample_rate = expected_batch_size / num_examples``.

    Each batch is a sorted ``list[int]``; its length is binomial with mean
    ``expected_batch_size``, and it may be empty. Iterating yields ``steps`` batches (by
    default ``round(num_examples / expected_batch_size)``, one epoch in expectation), each
    drawn afresh from ``generator``: the same seed gives the same batches, and iterating again
    continues the generator's stream (the next epoch differs).

    Args:
        num_examples: the number of examples ``n`` (``len(dataset)``).
        expected_batch_size: ``q·n``, in ``(0, n]`` (below 1, it warns: a sampling rate
            ``q`` given in its place, as Opacus' ``sample_rate``, is the usual cause).
        steps: the number of batches per iteration.
        generator: a CPU ``torch.Generator``; by default a fresh one seeded from torch's
            global generator at each iteration (as ``RandomSampler`` does).

    Example::

        >>> import torch, gradhooks
        >>> x = torch.randn(1000, 4)
        >>> sampler = gradhooks.PoissonSampler(len(x), 32, generator=torch.Generator().manual_seed(0))
        >>> len(sampler), sampler.sample_rate
        (31, 0.032)
        >>> [len(idx) for idx in sampler][:5]  # x[idx] is a batch
        [31, 40, 35, 26, 31]
    """

    def __init__(
        self,
        num_examples: int,
        expected_batch_size: float,
        *,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        require_number("num_examples", num_examples, "PoissonSampler")  # (True is no count)
        if not is_whole(num_examples) or num_examples < 1:
            raise ConfigurationError(
                f"num_examples must be a whole number >= 1, got {num_examples!r}"
            )
        require_number("expected_batch_size", expected_batch_size, "PoissonSampler")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ConfigurationTypeError(
                f"generator must be a CPU torch.Generator or None, got "
                f"{type(generator).__qualname__} (torch.Generator().manual_seed(seed))"
            )
        if not 0 < expected_batch_size <= num_examples:
            raise ConfigurationError(
                f"expected_batch_size must be in (0, num_examples={num_examples}], got "
                f"{expected_batch_size!r}"
            )
        if expected_batch_size < 1:
            warnings.warn(
                f"PoissonSampler(num_examples={num_examples}, expected_batch_size="
                f"{expected_batch_size!r}): an expected batch of less than one example, mostly "
                "empty batches. Its second argument is the expected batch size, not a sampling "
                "rate (Opacus' sample_rate): for a rate q, pass expected_batch_size=q * "
                "num_examples.",
                GradhooksWarning,
                stacklevel=2,
            )
        if steps is None:
            steps = max(1, round(num_examples / expected_batch_size))
        require_number("steps", steps, "PoissonSampler")
        if not is_whole(steps) or steps < 0:
            raise ConfigurationError(f"steps must be a whole number >= 0, got {steps!r}")
        if generator is not None and generator.device.type != "cpu":
            raise ConfigurationError(
                f"generator must be a CPU torch.Generator (indices are drawn on the CPU), got "
                f"one on {generator.device}"
            )
        self.num_examples = int(num_examples)
        self.expected_batch_size = expected_batch_size
        self.sample_rate = expected_batch_size / num_examples
        self.steps = int(steps)
        self.generator = generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        gen = self.generator
        if gen is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            gen = torch.Generator().manual_seed(seed)
        for _ in range(self.steps):
            # float64: P(u < q) is q to 2^-53 (float32's grid would bias q by up to 2^-24)
            u = torch.rand(self.num_examples, generator=gen, dtype=torch.float64)
            yield torch.nonzero(u < self.sample_rate).flatten().tolist()

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(num_examples={self.num_examples}, expected_batch_size="
            f"{self.expected_batch_size}, steps={self.steps})"
        )


class EmptyAware:
    """A collate function that turns an empty batch into the collate of one example with
    every tensor cut to 0 rows (picklable, for ``num_workers > 0``)."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, batch: list[Any]) -> Any:
        if len(batch) > 0:
            return self.collate_fn(batch)
        return tree_map(_cut, self.collate_fn([self.dataset[0]]))


_KEPT_AS_IS = (str, bytes, int, float, complex, bool, type(None))


def _cut(leaf: Any) -> Any:
    """One leaf of the collate of one example, cut to 0 rows: a tensor sliced, a mapping that
    is not a pytree node (Hugging Face's ``BatchEncoding``) copied with its values cut, a
    number or string kept; anything else, which would carry the example into the empty batch,
    refused."""
    if isinstance(leaf, torch.Tensor):
        return leaf[:0]
    if isinstance(leaf, MutableMapping):
        out = copy.copy(leaf)
        for key in leaf:
            out[key] = tree_map(_cut, leaf[key])
        return out
    if isinstance(leaf, _KEPT_AS_IS):
        return leaf
    raise ConfigurationError(
        "poisson_loader: a Poisson batch drew no example, and its batch is made as the collate "
        "of one example with every tensor cut to 0 rows; collate_fn returned a "
        f"{type(leaf).__qualname__}, which cannot be cut, so the empty batch would hold that "
        "example. Have collate_fn return its tensors in tuples, lists, dicts or other mappings "
        "(a BatchEncoding), or in a class registered as a node of torch's pytrees."
    )


def poisson_loader(
    dataset: Dataset,
    expected_batch_size: float,
    *,
    steps: int | None = None,
    generator: torch.Generator | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` (map-style) whose batches are drawn by
    :class:`PoissonSampler` (``loader.batch_sampler``; its ``sample_rate`` is what the
    accountant needs).

    An empty batch comes out as the collate of one example with every tensor cut to 0 rows
    (``[0, *feature shape]``), so the same model code runs on it: the tensors in tuples,
    lists, dicts and other mappings (a Hugging Face ``BatchEncoding``, kept as one); a
    ``collate_fn`` that returns a class of its own is refused at the empty draw
    (``ConfigurationError``), since the example could not be cut out of it. Other keyword arguments go
    to ``DataLoader`` (``num_workers``, ``pin_memory``, ...; not ``batch_size``, ``shuffle``,
    ``sampler`` or ``drop_last``, which the sampler replaces).

    Example::

        >>> import torch, gradhooks
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.randn(100, 3), torch.arange(100))
        >>> loader = gradhooks.poisson_loader(data, 2, generator=torch.Generator().manual_seed(0))
        >>> [tuple(x.shape) for x, y in loader][:3]  # an empty batch: [0, 3]
        [(2, 3), (0, 3), (2, 3)]
    """
    replaced = sorted(
        {"batch_size", "shuffle", "sampler", "drop_last", "batch_sampler"} & set(loader_kwargs)
    )
    if replaced:  # (else DataLoader's "batch_sampler option is mutually exclusive ...")
        raise ConfigurationError(
            f"poisson_loader: {', '.join(replaced)} would replace the Poisson batches (each "
            "example drawn independently, with probability expected_batch_size / len(dataset)), "
            "which the privacy accounting assumes: give expected_batch_size instead, and leave "
            "the batches to the sampler"
        )
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ConfigurationTypeError(
            f"poisson_loader: the dataset ({type(dataset).__qualname__}) must be map-style, with "
            "len() and dataset[i]: Poisson sampling draws each example by its index, which an "
            "IterableDataset (or an object without a length) has none of"
        )
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigurationTypeError(
            f"poisson_loader: collate_fn must be a function of a list of examples, got "
            f"{type(collate_fn).__qualname__}"
        )
    sampler = PoissonSampler(len(dataset), expected_batch_size, steps=steps, generator=generator)
    collate = EmptyAware(dataset, collate_fn if collate_fn is not None else default_collate)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
