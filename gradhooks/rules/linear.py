"""nn.Linear: ``y = x Wᵀ + b`` on ``[batch, *, in]``; the ``*`` positions share the weight."""

from einops import rearrange
from torch import nn

from ..pieces import Outer
from ..registry import Call, register


@register(nn.Linear)
def linear(call: Call) -> dict[str, Outer]:
    (x,) = call.inputs
    a = rearrange(x, "batch ... inp -> batch (...) inp")
    g = rearrange(call.grad_output, "batch ... out -> batch (...) out")
    return {"weight": Outer(a, g), "bias": Outer(None, g)}
