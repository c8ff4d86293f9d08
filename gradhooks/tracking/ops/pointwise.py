"""Elementwise operations, which broadcast their operands."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _torch
from ..layout import MIXED, UNKNOWN
from .common import HANDLERS, first_tensor, handles, tensor_args

_POINTWISE = """
    add sub mul div true_divide floor_divide remainder fmod pow float_power atan2 hypot
    copysign xlogy logaddexp logaddexp2 maximum minimum fmax fmin lerp addcmul addcdiv where
    masked_fill bitwise_and bitwise_or bitwise_xor bitwise_not logical_and logical_or
    logical_xor logical_not eq ne lt le gt ge equal isclose clamp clip clamp_min clamp_max
    neg negative abs absolute sign sgn exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square
    reciprocal sin cos tan asin acos atan sinh cosh tanh asinh acosh atanh erf erfc erfinv
    sigmoid logit relu relu6 gelu silu mish elu selu celu leaky_relu rrelu hardtanh hardswish
    hardsigmoid hardshrink softshrink tanhshrink softplus softsign threshold logsigmoid
    log_sigmoid special_expit lgamma digamma sinc xlog1py heaviside deg2rad rad2deg i0
    prelu floor ceil round trunc frac isnan isinf isfinite isneginf isposinf nan_to_num
    dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d
    to type type_as float double half bfloat16 int long bool short char byte cpu cuda
    contiguous clone detach requires_grad_ pin_memory conj real imag positive polar complex
    angle conj_physical resolve_conj resolve_neg
    fill_ zero_ normal_ uniform_ bernoulli bernoulli_ exponential_ random_ copy_ set_
    masked_fill_ where_ clamp_ clip_ nan_to_num_
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__
    __truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__ __floordiv__
    __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__
    __neg__ __pos__ __abs__ __invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__
    __xor__ __rxor__ __ixor__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __lshift__
    __rshift__ new_tensor .data .real .imag
""".split()
# in-place forms: the name with a trailing underscore
_POINTWISE += [n + "_" for n in _POINTWISE if n.isidentifier() and not n.startswith("_")]
# ``torch.special``'s aliases of elementwise functions (``special_erf`` for ``erf``), which carry
# no ``pointwise`` tag of their own and have no in-place forms
_POINTWISE += """
    special_erf special_erfc special_erfinv special_expm1 special_exp2 special_log1p
    special_sinc special_round special_ndtr special_logit special_psi special_digamma
    special_gammaln special_i0 special_xlogy special_polygamma special_multigammaln
    special_gammainc special_gammaincc polygamma polygamma_
""".split()
POINTWISE = frozenset(_POINTWISE)


def is_pointwise(name: str) -> bool:
    """Whether torch function ``name`` is elementwise: in the list above, or, where no other
    handler claims it, an aten operator torch tags ``pointwise`` (``torch.special.i1``,
    ``torch.lcm``, ``torch.nextafter``)."""
    return name in POINTWISE or (name not in HANDLERS and _tagged(name))


# the names torch tags ``pointwise``, by name, with the schemas read and without
_TAGGED: tuple[dict[str, bool], dict[str, bool]] = ({}, {})


def _tagged(name: str) -> bool:
    table = _TAGGED[_torch.available("op_schema")]
    found = table.get(name)
    if found is None:  # (reading the tags is slow: once per name)
        found = table[name] = _torch.tagged(name, "pointwise")
    return found


# operations that make a batch-free tensor batch-sized, and those that then use it row by row


@handles(*_POINTWISE)
def pointwise(args, kwargs, out, layout_of):
    """Broadcasting operations: a layout keeps its dimension counted from the right."""
    o = first_tensor(out)
    if o is None:
        return None
    return broadcast(tensor_args(args, kwargs), o.shape, layout_of)


def broadcast(tensors, shape, layout_of):
    """The layout of an elementwise operation of ``tensors`` broadcast to ``shape``: each
    one's layout keeps its dimension counted from the right."""
    n, result = len(shape), None
    for t in tensors:
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        d = lay.dim + n - t.dim()
        if d < 0 or shape[d] != t.shape[lay.dim]:
            return UNKNOWN
        cand = lay.at(d)
        if result is None:
            result = cand
        elif result != cand:
            return MIXED  # two examples' entries combined
    return result


def where_unselected(name: str, args: tuple, layouts) -> set[int]:
    """``torch.where(cond, x, y)``: the ids of ``x`` or ``y`` where they mix the examples and
    ``cond`` takes none of their entries (Hugging Face's time-series mean scaler: a scale
    from the whole batch, used only for a series with no observation)."""
    if name != "where" or len(args) < 3:
        return set()
    cond, x, y = args[:3]
    if not isinstance(cond, Tensor) or cond.dtype != torch.bool:
        return set()
    found = set()
    if isinstance(x, Tensor) and layouts.get(x) is MIXED and not bool(cond.any()):
        found.add(id(x))
    if isinstance(y, Tensor) and layouts.get(y) is MIXED and bool(cond.all()):
        found.add(id(y))
    return found
