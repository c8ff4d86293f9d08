"""Every torch function the tracker has no handler for, inside a module with a weight, against
the float64 per-example loop.

``python -m bench.unhandled_ops [--limit N] [--only NAME,...] [--start K]``

The tracker follows the batch through the torch functions it has a handler for
(:func:`gradhooks.tracking.ops.handler_for`); any other loses it (the result's layout is
unknown). This sweeps torch's OpInfo database for the operations whose run puts such a
function among the tracker's unknown operations, and for each runs models in float64, each a
module without a rule whose weight scales the operation's input, ``x * w`` (``w`` of the
input's shape but dimension 0: the tracker gives ``w`` its per-example gradients itself), or
``(x[..., None] @ w)[..., 0]`` (``w`` of shape ``[1, 1]``: a product with a parameter, which
the module's per-example fallback recomputes):

- ``dim0``: ``op(x * w, *args)``, the sample's input ``x`` taken as the batch along its
  dimension 0 (with the arguments of as many rows, given to the model beside it): the
  operation's own arguments decide whether dimension 0 keeps its meaning (an elementwise
  operation) or not (a reduction, a product, a reordering of the rows);
- ``rows``: ``torch.stack([op(x[b] * w, *args) for b in ...])``, a batch of 3 copies of
  the sample's input, where each example's rows stay its own (a control).

Each is run through ``add_hooks(loss_reduction="sum")`` with a sum-of-squares loss and compared
with :func:`gradhooks.oracle.loop_grad`. A run is *right* (``grad1`` is the loop's), *refused*
(an error of :mod:`gradhooks.errors`), *silent wrong* (``grad1`` differs from the loop's, or the
loop cannot run one example alone: no per-example gradient exists, yet ``grad1`` was given),
or a *crash* (another exception, where the model runs without gradhooks). Runs whose model
fails or gives no gradient to ``w`` without gradhooks are left out.

``torch.testing._internal.common_methods_invocations`` is a private testing module of torch's
(it needs ``expecttest``).
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch
from torch import nn

import gradhooks
from gradhooks.errors import GradhooksError
from gradhooks.oracle import loop_grad
from gradhooks.tracking import Layout, Tracker
from gradhooks.tracking.ops import handler_for
from gradhooks.tracking.ops.common import op_name

D = torch.float64
RTOL, ATOL = 1e-6, 1e-9
COPIES = 3  # the examples of the control


def unhandled_functions() -> set[str]:
    """The names of the public torch functions (``torch.overrides``' list) without a handler."""
    names = set()
    for func in torch.overrides.get_testing_overrides():
        try:
            name = op_name(func)
        except Exception:
            continue
        if handler_for(name) is None:
            names.add(name)
    return names


def _sum_sq(out) -> torch.Tensor:
    leaves = out if isinstance(out, tuple | list) else (out,)
    found = [
        (t.real**2 + t.imag**2).sum() if t.is_complex() else (t**2).sum()
        for t in leaves
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    if not found:
        raise TypeError("no floating-point output")
    return 0.5 * sum(found)


class Dim0(nn.Module):
    """``op(x * w, *args)`` (``fallback``: ``x`` times a ``[1, 1]`` weight as a matrix
    product), the arguments at ``alongside`` given with ``x`` (``more``)."""

    def __init__(self, op, args, kwargs, shape, alongside=(), fallback=False):
        super().__init__()
        self.op, self.args, self.kwargs, self.alongside = op, args, kwargs, alongside
        self.fallback = fallback
        self.w = nn.Parameter(1 + 0.1 * torch.randn((1, 1) if fallback else shape, dtype=D))

    def scaled(self, x):
        return (x.unsqueeze(-1) @ self.w).squeeze(-1) if self.fallback else x * self.w

    def forward(self, x, *more):
        args = list(self.args)
        for i, m in zip(self.alongside, more):
            args[i] = m
        return self.op(self.scaled(x), *args, **self.kwargs)


class Rows(Dim0):
    def forward(self, x):
        return torch.stack([self.op(self.scaled(x[b]), *self.args, **self.kwargs)
                            for b in range(x.shape[0])])  # fmt: skip


def _unknown_names(op, x, args, kwargs) -> set[str]:
    """The functions without a handler that a run of ``op`` on ``x`` (examples on dimension
    0) leaves the tracker not knowing."""
    tracker = Tracker(x.shape[0], {})
    x = x.clone()
    tracker.set_layout(x, Layout(0))
    try:
        with tracker, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            op(x, *args, **kwargs)
    except Exception:
        return set()
    return {n for n in tracker.unknown if handler_for(n) is None}


def classify(model: nn.Module, x: tuple) -> tuple[str, str]:
    """What gradhooks does with ``model`` on the batch ``x`` (its inputs) against the loop."""
    try:
        model.zero_grad()
        _sum_sq(model(*x)).backward()
        if model.w.grad is None:
            return "skipped", "no gradient to w"
    except Exception as e:
        return "skipped", f"fails without gradhooks: {type(e).__name__}"
    model.zero_grad()
    try:
        want = loop_grad(model, _sum_sq, x)["w"]
    except Exception as e:
        want, why = None, f"{type(e).__name__}: {str(e)[:80]}"
    try:
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            _sum_sq(model(*x)).backward()
            got = model.w.grad1
    except GradhooksError as e:
        return "refused", type(e).__name__
    except Exception as e:
        return "crash", f"{type(e).__name__}: {str(e)[:100]}"
    finally:
        model.zero_grad()
    if want is None:
        return "silent wrong", f"grad1 given where one example alone fails ({why})"
    if got is None:
        return ("right", "") if not want.any() else ("silent wrong", "grad1 missing")
    if got.shape != want.shape:
        return "silent wrong", f"grad1 {tuple(got.shape)} for {tuple(want.shape)}"
    scale = float(want.abs().max()) if want.numel() else 0.0
    if torch.allclose(got, want, rtol=RTOL, atol=ATOL * max(scale, 1.0)):
        return "right", ""
    return "silent wrong", f"max difference {float((got - want).abs().max()):.3g} of {scale:.3g}"


def _samples(info, most: int = 3):
    dtypes = info.supported_dtypes("cpu")
    if D not in dtypes:
        return
    torch.manual_seed(0)
    found = 0
    for k, s in enumerate(info.sample_inputs_func(info, "cpu", D, False)):
        x = s.input
        if (
            isinstance(x, torch.Tensor)
            and x.layout is torch.strided
            and x.dim() >= 1
            and x.shape[0] >= 2
            and x.numel() <= 400
        ):
            yield s
            found += 1
        if found >= most or k >= 30:
            return


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=0, help="the first N operations only")
    parser.add_argument("--only", default="", help="OpInfo names, comma-separated")
    parser.add_argument(
        "--start", type=int, default=0,
        help="from the K-th OpInfo on (after one that ends the process: each run is printed "
        "as it ends, after a line '# K name' for its OpInfo)",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    from torch.testing._internal.common_methods_invocations import op_db

    missing = unhandled_functions()
    only = set(filter(None, opts.only.split(",")))
    variants = ("dim0", "dim0/fallback", "rows", "rows/fallback")
    counts = {v: collections.Counter() for v in variants}
    wrong, crashes, probed, seen = [], [], set(), 0
    warnings.simplefilter("ignore")
    for k, info in enumerate(op_db):
        if k < opts.start or (only and info.name not in only):
            continue
        print(f"# {k} {info.name}", flush=True)
        try:
            samples = list(_samples(info))
        except Exception:  # (the database's own sample inputs fail here)
            continue
        for s in samples:
            x, args, kwargs = s.input.detach(), list(s.args), dict(s.kwargs)
            names = _unknown_names(info.op, x, args, kwargs)
            if not names:
                continue  # (the tracker follows it: tests/test_tracking_ops.py checks those)
            probed |= names
            seen += 1
            alongside = tuple(
                i for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim()
                and a.shape[0] == x.shape[0]
            )  # fmt: skip
            more = [args[i].detach().clone() for i in alongside]
            for variant in variants:
                torch.manual_seed(0)
                fallback = variant.endswith("fallback")
                if variant.startswith("dim0"):
                    model = Dim0(info.op, args, kwargs, x.shape[1:], alongside, fallback)
                    batch = (x.clone(), *more)
                else:
                    model = Rows(info.op, args, kwargs, x.shape, (), fallback)
                    batch = (x.unsqueeze(0).expand(COPIES, *x.shape).clone(),)
                try:
                    got, why = classify(model, batch)
                except Exception as e:  # (the comparison itself: complex outputs, ...)
                    got, why = "skipped", f"{type(e).__name__}"
                counts[variant][got] += 1
                print(f"run\t{info.name}\t{variant}\t{got}\t{why}", flush=True)
                line = f"{info.name} {variant} {tuple(x.shape)} ({', '.join(sorted(names))})"
                if got == "silent wrong":
                    wrong.append(f"{line}: {why}")
                elif got == "crash":
                    crashes.append(f"{line}: {why}")
            break  # (the first sample the tracker loses the batch in)
        if opts.limit and seen >= opts.limit:
            break
    print(f"public torch functions without a handler: {len(missing)}; met in the OpInfo "
          f"samples probed: {len(probed & missing)} (+{len(probed - missing)} other names); "
          f"operations probed: {seen}")  # fmt: skip
    for variant, c in counts.items():
        print(f"{variant}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print("\nsilent wrong:")
    print("\n".join(f"  {w}" for w in wrong) or "  none")
    print("\ncrashes:")
    print("\n".join(f"  {c}" for c in crashes) or "  none")


if __name__ == "__main__":
    main()
