"""Groups of torch function names that the tracker treats alike beyond their handlers: where
a conversion may return its input, where a part or an index of rows is kept, products by a
mask, picks of rows by an index, fused operations without a rule (see :class:`gradhooks.tracking.tracker.Tracker`)."""

from __future__ import annotations

# conversions that return their tensor itself where it already is what they make (and
# ``requires_grad_``, which sets a flag and returns its tensor: a hook that unfreezes a
# parameter before its module's call does not use it)
MAYBE_SAME = frozenset(
    """to type type_as contiguous float double half bfloat16 cpu cuda requires_grad_""".split()
)
# operations that take a part of a tensor by position, and those that keep every entry of an
# index of rows (see rows.follow_row_indices)
PART_OF = frozenset(
    """__getitem__ narrow select split chunk tensor_split split_with_sizes unsafe_split unbind
    topk kthvalue""".split()
)
KEEPS_ROWS_INDEX = frozenset(
    """view reshape flatten ravel squeeze unsqueeze contiguous clone cat concat concatenate
    stack expand expand_as sort msort""".split()
)
# products by a mask (see rows.all_ones)
PRODUCTS = frozenset(
    """mul mul_ __mul__ __rmul__ __imul__ logical_and __and__ __rand__ __iand__
    bitwise_and""".split()
)
# operations that pick or put back rows by an index: inside a module without a rule, the
# fallback's recomputation one example at a time tells whether they kept the examples apart
PICKS = frozenset(
    """__getitem__ __setitem__ index_select index_add index_add_ index_copy index_copy_
    index_put index_put_ gather scatter scatter_ scatter_add scatter_add_ take_along_dim
    masked_select masked_scatter masked_scatter_""".split()
)
# fused operations no rule covers yet, each with the unfused computation that rules cover (said
# where a parameter meets the batch in one)
UNFUSED = {
    "linear_cross_entropy": "compute the logits with an nn.Linear and the loss with "
    "F.cross_entropy on them instead (the same numbers)",
}
