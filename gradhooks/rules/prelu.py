"""nn.PReLU: ``y = x`` where ``x >= 0``, ``weight[c] · x`` elsewhere.

``weight``: ``[num_parameters]``, one slope per channel (axis 1 of the input) or a single
slope shared by every element. Per example,

    grad1[b, c] = Σ_{positions of channel c where x < 0} x · g

a :class:`Direct` ``[batch, num_parameters]``. Rules never scale: the engine applies mean/sum.
"""

from __future__ import annotations

import math

from torch import nn

from ..errors import UnbatchedInputError
from ..pieces import Direct
from .registry import Call, register


@register(nn.PReLU)
def prelu(call: Call) -> dict[str, Direct]:
    m: nn.PReLU = call.module
    x = call.inputs[0]
    if x.dim() == 0 or (m.num_parameters > 1 and x.dim() < 2):
        raise UnbatchedInputError(
            f"'{call.name or '<model>'}' (PReLU, num_parameters={m.num_parameters}) got an "
            f"input of shape {tuple(x.shape)}: per-example gradients need [batch, channels, *] "
            "([batch, *] with num_parameters=1)"
        )
    contrib = (x * call.grad_output).masked_fill(x >= 0, 0)
    if m.num_parameters == 1:
        shape = (x.shape[0], 1, math.prod(x.shape[1:]))
    else:
        shape = (*x.shape[:2], math.prod(x.shape[2:]))
    return {"weight": Direct(contrib.reshape(shape).sum(-1))}
