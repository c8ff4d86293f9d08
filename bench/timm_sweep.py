"""timm's model families (and a few vit-pytorch and x-transformers models) against the loop.

    python -m bench.timm_sweep                          # the smallest model of each timm module
    python -m bench.timm_sweep --models resnet,vit_*    # modules, or model names (fnmatch)
    python -m bench.timm_sweep --library vit-pytorch    # lucidrains' vit-pytorch, x-transformers
    python -m bench.timm_sweep --out /tmp/sweep --limit 60

For each module of timm (``timm.list_modules()``), its registered model with the fewest
parameters (counted on the meta device; a model above ``MAX_PARAMS`` is made again with
``depth=2`` where it takes that), made with ``pretrained=False``, ``num_classes=3`` and the
smallest input of ``SIZES`` it runs on (``img_size=`` passed where the model takes it), in
float64, every dropout and drop-path at 0, a batch of 3. The loss is a cross-entropy of the
logits with ``reduction="sum"``; ``add_hooks(model, loss_reduction="sum")`` and one
``backward()`` give ``grad1``, compared parameter by parameter with each example's own gradient
(:func:`gradhooks.oracle.loop_grad`, a batch of one at a time). Two modes per model:

- **train**: the model as it is in training mode. Where it has BatchNorm layers, they normalise
  by statistics of the batch, which couple the examples: no per-example gradient exists, and a
  refusal is the right answer (a ``grad1`` written there is counted a mismatch);
- **bn-eval**: (models with BatchNorm only) training mode with every BatchNorm layer in eval
  mode, normalising by its frozen running statistics, as DP-SGD fine-tunes such a model:
  ``grad1`` must match the loop.

Each is classified as :mod:`bench.sweep` says (match, refused, mismatch, crash, skipped).
Writes ``<out>/timm-sweep.{json,md}`` (``<out>`` is ``bench/results``; with ``--library``,
``<library>-sweep.*``).

timm imports torchvision, whose wheel on PyPI is built against CUDA torch: with a CPU-only torch
its C ops do not load, and its import then fails at the first fake kernel it registers for them.
:func:`import_timm` declares those two operators' schemas (no kernel: calling them raises) so
that torchvision's Python parts, and timm, import.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/timm_sweep.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad

from .sweep import (
    FLOAT32_RTOL,
    OUTCOMES,
    REPORT_ORDER,
    ROUNDED,
    RTOL,
    Result,
    Skip,
    TimeLimit,
    compare,
    counts,
    detail_cell,
    first_line,
    hooked_backward,
    progress,
    time_limit,
)

ROOT = Path(__file__).resolve().parent.parent
BATCH = 3
CLASSES = 3
SIZES = (32, 64, 96, 128, 160, 192, 224, 240, 256)  # 240: crossvit (two patch sizes)
MAX_PARAMS = 30_000_000
MODES = ("train", "bn-eval")
# The families people fine-tune most, swept first (timm module names).
PRIORITY = (
    "resnet resnetv2 efficientnet mobilenetv3 convnext regnet densenet vision_transformer deit "
    "swin_transformer beit eva levit mobilevit efficientformer maxxvit metaformer mlp_mixer "
    "convmixer nfnet rexnet ghostnet xcit cait pit tnt twins pvt_v2 edgenext fastvit hiera"
).split()
# torchvision's operators whose fake kernels its import registers unconditionally.
TORCHVISION_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_torchvision_schemas = []  # the library that declares them, kept alive


@dataclass
class SweepResult(Result):
    input: int = 0  # the side of the square input
    batchnorm: int = 0  # the model's BatchNorm layers


# -- timm, its models, their inputs --------------------------------------------------------------


def import_timm():
    """``import timm``, declaring torchvision's operators first where its C ops do not load."""
    return import_vision("timm")


def import_vision(module: str):
    """``import module`` (timm, vit_pytorch: they import torchvision), declaring torchvision's
    operators first where its C ops do not load."""
    import importlib

    try:
        return importlib.import_module(module)
    except RuntimeError as e:
        if "torchvision::" not in str(e) or _torchvision_schemas:
            raise
    for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", module)]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in TORCHVISION_OPS:
        lib.define(schema)
    _torchvision_schemas.append(lib)
    return importlib.import_module(module)


@functools.cache
def import_torchvision() -> None:
    """Import torchvision where it is installed, as :func:`import_vision` does. transformers
    imports it (its image models, and diffusers' and sentence-transformers' models), and the
    PyPI wheel, built against CUDA torch, fails to import beside a CPU-only torch unless its
    operators are declared first: without this, every transformers model fails to import
    where ``pip install torch==2.13.0+cpu -e ".[bench]"`` brought torchvision with BackPACK."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        import_vision("torchvision")


def _count(name: str, **kw) -> int:
    timm = import_timm()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kw)
    return sum(p.numel() for p in model.parameters())


def smallest(module: str) -> tuple[str, int]:
    """The model of timm's ``module`` with the fewest parameters, and their number."""
    timm = import_timm()
    best = None
    for name in timm.list_models(module=module):
        try:
            n = _count(name)
        except Exception:  # noqa: BLE001 (a variant that cannot be made: the next one)
            continue
        if best is None or n < best[1]:
            best = (name, n)
    if best is None:
        raise Skip(f"no model of {module} can be made")
    return best


def selection(patterns: str | None) -> list[tuple[str, str]]:
    """(module, model) pairs: the smallest model of each module matched by ``patterns``, and the
    models matched by name; without ``patterns``, of every module, ``PRIORITY`` first."""
    timm = import_timm()
    modules = [m for m in PRIORITY if m in timm.list_modules()]
    modules += [m for m in timm.list_modules() if m not in modules]
    if not patterns:
        return [(m, "") for m in modules]
    picked = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matched = [(m, "") for m in modules if fnmatch.fnmatchcase(m, pattern)]
        if not matched:
            names = timm.list_models(pattern)
            matched = [(_module_of(n), n) for n in names]
        if not matched:
            raise SystemExit(f"no timm module or model matches {pattern!r}")
        picked += [m for m in matched if m not in picked]
    return picked


def _module_of(name: str) -> str:
    timm = import_timm()
    return next((m for m in timm.list_modules() if name in timm.list_models(module=m)), "")


def _quiet(model: nn.Module) -> nn.Module:
    """Every dropout, drop-path and drop-block of ``model`` at 0 (they draw random numbers)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if "drop" in key and isinstance(value, float):
                setattr(m, key, 0.0)
    return model


def _logits(out) -> torch.Tensor:
    """The logits of a forward's output (the first tensor of a tuple: the class token's head)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise Skip(f"returns {type(out).__name__}, no logits tensor")
    return out


def summed_loss(out, y) -> torch.Tensor:
    return F.cross_entropy(_logits(out), y, reduction="sum")


def _runs(model: nn.Module, size: int) -> bool:
    x = torch.randn(BATCH, 3, size, size)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits = _logits(model.train()(x))
    except Exception:  # noqa: BLE001 (too small for this model: the next size)
        return False
    return logits.shape == (BATCH, CLASSES)


def build(name: str, **kw) -> tuple[nn.Module, int]:
    """``name`` (made with ``kw``) at the smallest input of ``SIZES`` it runs on, in float64,
    without randomness; made again with ``depth=2`` where it has more than ``MAX_PARAMS``
    parameters."""
    timm = import_timm()
    extra = dict(kw)
    try:
        size = _count(name, **extra)
    except Exception as e:
        raise Skip(f"cannot be made: {first_line(e)}") from e
    if size > MAX_PARAMS:
        try:
            if _count(name, **{**extra, "depth": 2}) <= MAX_PARAMS:
                extra["depth"] = 2
        except Exception:  # noqa: BLE001 (takes no depth)
            pass
        if "depth" not in extra:
            raise Skip(f"{size:,} parameters, above {MAX_PARAMS:,}")

    def make(**kw):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return timm.create_model(name, pretrained=False, num_classes=CLASSES, **extra, **kw)

    sized = True
    fixed = None
    for side in SIZES:
        try:
            model = make(img_size=side) if sized else fixed
        except TypeError:
            sized, fixed = False, make()
            model = fixed
        except Exception:  # noqa: BLE001 (an img_size this model cannot take)
            continue
        if _runs(_quiet(model), side):
            torch.manual_seed(0)
            model = make(img_size=side) if sized else make()  # fresh running statistics
            return _quiet(model).double().train(), side
    raise Skip(f"runs on none of the inputs {SIZES[0]}..{SIZES[-1]} square")


def batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# -- one model in one mode -------------------------------------------------------------------


def check(
    name: str, mode: str = "bn-eval", limit: float = 120.0, module: str = "", **kw
) -> SweepResult:
    """``name`` (a timm model, made with ``kw``) through the sweep in ``mode``: its
    :class:`SweepResult`."""
    res = SweepResult(module or _module_of(name), task=mode, model=name)
    return _timed(res, limit, lambda: build(name, **kw))


def _timed(res: SweepResult, limit: float, make) -> SweepResult:
    start = time.perf_counter()
    try:
        with time_limit(limit), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", gradhooks.GradhooksWarning)
            _check(res, *make())
        res.warnings = sorted({str(w.message).splitlines()[0][:200] for w in caught
                               if issubclass(w.category, gradhooks.GradhooksWarning)})  # fmt: skip
    except (Skip, TimeLimit) as e:
        res.outcome, res.detail = "skipped", str(e)
    res.seconds = round(time.perf_counter() - start, 2)
    return res


def _check(res: SweepResult, model: nn.Module, side: int) -> None:
    res.input = side
    res.params = sum(p.numel() for p in model.parameters())
    norms = batchnorms(model)
    res.batchnorm = len(norms)
    if res.task == "bn-eval":
        if not norms:
            raise Skip("no BatchNorm layer: the same as train")
        for m in norms:
            m.eval()
    coupled = any(m.training for m in norms)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, side, side, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            first = _logits(model(x))
            model.load_state_dict(state)
            again = _logits(model(x))
            model.load_state_dict(state)
    except Skip:
        raise
    except Exception as e:
        raise Skip(f"does not run: {first_line(e)}") from e
    if not torch.equal(first, again):
        raise Skip("its training-mode forward draws random numbers")
    if coupled:
        # No per-example gradient exists: only a refusal is right.
        if hooked_backward(res, model, lambda: summed_loss(model(x), y), "sum"):
            res.outcome = "mismatch"
            res.detail = (
                f"grad1 written, though {len(norms)} BatchNorm layers in training mode couple "
                "the examples"
            )
            for _, p in params:
                if hasattr(p, "grad1"):
                    del p.grad1
        model.load_state_dict(state)
        return
    with torch.no_grad():
        ones = torch.cat([_logits(model(x[b : b + 1])) for b in range(BATCH)])
    res.batch_vs_one = float((ones - first).abs().max() / first.abs().max().clamp_min(1e-300))
    rtol = FLOAT32_RTOL if res.batch_vs_one > ROUNDED else RTOL
    try:
        want = loop_grad(model, summed_loss, x, y)
    except Exception as e:
        raise Skip(f"the loop of batches of one fails: {first_line(e)}") from e
    want = {n: (torch.zeros_like(p).expand(BATCH, *p.shape) if want[n] is None else want[n])
            for n, p in params}  # fmt: skip
    model.zero_grad(set_to_none=True)
    if hooked_backward(res, model, lambda: summed_loss(model(x), y), "sum"):
        compare(res, params, _reference(res, model, params, want, x, y), rtol)


def _reference(res: SweepResult, model, params, want: dict, x, y) -> dict:
    """``want``, the loop's gradients, where their sum is autograd's batched gradient (up to
    rounding); else ``vmap(grad)``'s, where theirs is. (torch's backward of a batch of one can
    be wrong where that of the batch is not: BatchNorm's, in eval mode, of an output-gradient
    whose strides a transpose gave.)"""
    largest = max((float(w.abs().max()) for w in want.values() if w.numel()), default=0.0)

    def off(grads: dict) -> list[str]:
        return [n for n, p in params if p.grad is not None
                and float((p.grad - grads[n].sum(0)).abs().max()) > 1e-6 * largest]  # fmt: skip

    wrong = off(want)
    if not wrong:
        return want
    try:
        other = vmap_grad(model, summed_loss, x, y)
    except Exception:  # noqa: BLE001 (vmap cannot run this model: the loop it is)
        return want
    other = {n: torch.zeros_like(want[n]) if other.get(n) is None else other[n] for n, _ in params}
    if off(other):
        return want
    res.detail = (
        f"the loop's gradients do not sum to autograd's batched gradient ({wrong[0]}), "
        "vmap(grad)'s do: compared with vmap(grad)"
    )
    return other


# -- the sweep and its report --------------------------------------------------------------------


def write(
    results: list[SweepResult], out: Path, command: str, name: str, library: str
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in MODES if any(r.task == m for r in results)]
    by_mode = {m: counts([r for r in results if r.task == m]) for m in modes}
    versions = {"torch": torch.__version__, library: _version(library)}
    meta = {"command": command, **versions, "batch": BATCH, "rtol": RTOL, "counts": by_mode}
    js = out / f"{name}.json"
    js.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=1) + "\n")
    lines = [
        f"# {library} models against the per-example loop",
        "",
        f"`{command}`",
        "",
        f"torch {torch.__version__}, {library} {versions[library]}; random initialisation in "
        f"float64, training mode without dropout or drop-path, batch {BATCH} of square images "
        f"of the smallest side the model runs on, a summed cross-entropy of {CLASSES} classes; "
        f"`grad1` of every trainable parameter against a loop of batches of one, "
        f"`rtol={RTOL:g}` (`{FLOAT32_RTOL:g}` where a row says so). Mode `train`: as the "
        "model is (BatchNorm there couples the examples: a refusal is right); `bn-eval`: "
        "BatchNorm layers in eval mode (frozen statistics: must match).",
        "",
        "| outcome | " + " | ".join(modes) + " |",
        "| --- |" + " --- |" * len(modes),
        *(f"| {o} | " + " | ".join(str(by_mode[m][o]) for m in modes) + " |" for o in OUTCOMES),
        "",
        "| family | model | mode | parameters | input | outcome | detail | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {o: i for i, o in enumerate(REPORT_ORDER)}
    for r in sorted(results, key=lambda r: (order[r.outcome], r.family, r.task)):
        lines.append(f"| {r.family} | {r.model} | {r.task} | {r.params:,} | {r.input or ''} | "
                     f"{r.outcome} | {detail_cell(r)} | {r.seconds:.1f} |")  # fmt: skip
    md = out / f"{name}.md"
    md.write_text("\n".join(lines) + "\n")
    return js, md


def _modes(check_in, isolated: bool = False) -> list[SweepResult]:
    """The train row, and the bn-eval row where the model has BatchNorm (without, it would say
    no more than the train row); with ``isolated``, each in a child process of its own."""
    run = _isolated if isolated else (lambda f, mode: f(mode))
    train = run(check_in, "train")
    return [train, run(check_in, "bn-eval")] if train.batchnorm else [train]


def _isolated(check_in, mode: str) -> SweepResult:
    """``check_in(mode)`` in a forked child: a segmentation fault inside torch ends the child,
    and is a crash of this model, not the end of the sweep."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child():
        send.send(check_in(mode))
        send.close()

    proc = ctx.Process(target=child)
    proc.start()
    send.close()
    try:
        res = receive.recv()
    except EOFError:
        res = None
    proc.join()
    if res is None:
        code = proc.exitcode or 0
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        res = SweepResult("", task=mode, outcome="crash", detail=f"the process ended by {why}")
    return res


def _version(library: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(library)
    except PackageNotFoundError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.timm_sweep", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--models", default=None,
        help="timm modules or model names, comma-separated fnmatch patterns (default: the "
        "smallest model of every module)",
    )  # fmt: skip
    p.add_argument("--library", default="timm", choices=("timm", *LIBRARIES))
    p.add_argument("--limit", type=float, default=120.0, help="seconds per model and mode")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the results")
    p.add_argument(
        "--threads", type=int, default=1,
        help="torch's threads (1: tiny models gain nothing from more, on a shared machine they "
        "lose much)",
    )  # fmt: skip
    p.add_argument(
        "--no-isolate", dest="isolate", action="store_false",
        help="run every model in this process (by default each runs in a forked child, so that "
        "a segmentation fault is one model's crash)",
    )  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    argv = sys.argv[1:] if argv is None else argv
    command = "python -m bench.timm_sweep" + (" " + " ".join(argv) if argv else "")
    results = []
    stem = "timm-sweep" if args.library == "timm" else f"{args.library}-sweep"
    if args.library == "timm":
        items = selection(args.models)
    else:
        items = [(args.library, n) for n in LIBRARIES[args.library] if not args.models
                 or any(fnmatch.fnmatchcase(n, q) for q in args.models.split(","))]  # fmt: skip
    bar = progress(items)
    for i, (module, name) in enumerate(items):
        label = name or module
        if bar is None:
            print(f"[{i + 1}/{len(items)}] {label}", file=sys.stderr, flush=True)
        else:
            bar.set_postfix_str(label)
        if args.library != "timm":
            results += _modes(
                lambda mode: check_other(args.library, name, mode, args.limit),  # noqa: B023
                args.isolate,
            )
        elif not name:
            try:
                name, _ = smallest(module)
            except Skip as e:
                results.append(SweepResult(module, task="train", detail=str(e)))
        if name and args.library == "timm":
            results += _modes(
                lambda mode: check(name, mode, args.limit, module),  # noqa: B023
                args.isolate,
            )
        for r in results:
            if not r.model:  # (a child that died said nothing)
                r.family, r.model = module, name
        if bar is not None:
            bar.update(1)
        write(results, Path(args.out), command, stem, args.library)  # so far, kept if stopped
    if bar is not None:
        bar.close()
    js, md = write(results, Path(args.out), command, stem, args.library)
    for mode in MODES:
        counted = counts([r for r in results if r.task == mode])
        if any(counted.values()):
            print(f"{mode}: " + ", ".join(f"{n} {o}" for o, n in counted.items()))
    for r in results:
        if r.outcome in ("mismatch", "crash"):
            print(f"{r.outcome}: {r.model} ({r.task}): {r.detail}")
    print(f"wrote {js} and {md}")
    return 0


# -- vit-pytorch and x-transformers ----------------------------------------------------------------


def _vit_pytorch(kind: str) -> tuple[nn.Module, int]:
    import importlib

    import_vision("vit_pytorch")

    def of(module: str):
        return importlib.import_module(f"vit_pytorch.{module}")

    common = dict(image_size=32, patch_size=8, num_classes=CLASSES, dim=32, depth=2, heads=4,
                  mlp_dim=64)  # fmt: skip
    if kind in ("ViT", "SimpleViT"):  # (from their files: the package may stand without its
        # __init__, as bench.lib_sweep imports it where torchvision is missing)
        return getattr(of({"ViT": "vit", "SimpleViT": "simple_vit"}[kind]), kind)(**common), 32
    if kind == "CaiT":
        return of("cait").CaiT(**common, cls_depth=1), 32
    if kind == "DeepViT":
        return of("deepvit").DeepViT(**common), 32
    if kind == "PiT":
        return of("pit").PiT(**{**common, "patch_size": 4, "depth": (1, 1, 1), "heads": 2}), 32
    if kind == "CvT":
        return of("cvt").CvT(num_classes=CLASSES, s1_emb_dim=16, s2_emb_dim=32, s2_heads=2,
                          s2_depth=1, s3_emb_dim=32, s3_heads=2, s3_depth=1), 32  # fmt: skip
    if kind == "LeViT":
        return of("levit").LeViT(image_size=64, num_classes=CLASSES, stages=3, dim=(32, 48, 64),
                              depth=1, heads=(2, 2, 2), mlp_mult=2), 64  # fmt: skip
    if kind == "MaxViT":
        return of("max_vit").MaxViT(num_classes=CLASSES, dim_conv_stem=16, dim=16, dim_head=8,
                                 depth=(1, 1), window_size=2, dropout=0.0), 32  # fmt: skip
    if kind == "MobileViT":
        return of("mobile_vit").MobileViT(image_size=(64, 64), dims=[16, 16, 16],
                                       channels=[8, 8, 16, 16, 16, 16, 16, 16, 16, 16, 32],
                                       num_classes=CLASSES, depths=(1, 1, 1)), 64  # fmt: skip
    if kind == "CCT":
        return of("cct").CCT(img_size=32, embedding_dim=32, n_conv_layers=1, kernel_size=3, stride=1,
                          padding=1, num_layers=2, num_heads=2, mlp_ratio=2.0,
                          num_classes=CLASSES, positional_embedding="learnable",
                          attention_dropout=0.0, stochastic_depth_rate=0.0), 32  # fmt: skip
    small = {**common, "dim_head": 8}
    if kind == "CrossViT":
        return of("cross_vit").CrossViT(image_size=32, num_classes=CLASSES, sm_dim=16, lg_dim=32,
                                     sm_patch_size=8, lg_patch_size=16, sm_enc_heads=2,
                                     sm_enc_mlp_dim=32, sm_enc_dim_head=8, lg_enc_depth=1,
                                     lg_enc_heads=2, lg_enc_mlp_dim=32, lg_enc_dim_head=8,
                                     cross_attn_depth=1, cross_attn_heads=2,
                                     cross_attn_dim_head=8, depth=1, dropout=0.0,
                                     emb_dropout=0.0), 32  # fmt: skip
    if kind == "T2TViT":
        return of("t2t").T2TViT(image_size=32, num_classes=CLASSES, dim=32, depth=1, heads=2,
                             mlp_dim=32, dim_head=8), 32  # fmt: skip
    if kind == "NesT":
        return of("nest").NesT(image_size=32, patch_size=4, num_classes=CLASSES, dim=16, heads=2,
                            num_hierarchies=2, block_repeats=(1, 1), dim_head=8), 32  # fmt: skip
    if kind == "XCiT":
        return of("xcit").XCiT(**small, cls_depth=1), 32
    modules = {"SmallDataViT": "vit_for_small_dataset", "ParallelViT": "parallel_vit",
               "RegisterViT": "simple_vit_with_register_tokens",
               "QKNormViT": "simple_vit_with_qk_norm",
               "ValueResidualViT": "simple_vit_with_value_residual"}  # fmt: skip
    if kind in modules:
        module = of(modules[kind])
        return (getattr(module, "ViT", None) or module.SimpleViT)(**small), 32
    if kind == "RvT":
        return of("rvt").RvT(**small), 32
    if kind == "ScalableViT":
        return of("scalable_vit").ScalableViT(num_classes=CLASSES, dim=16, depth=(1, 1, 1, 1),
                                           heads=(1, 1, 1, 1), reduction_factor=(2, 2, 1, 1),
                                           window_size=(2, 2, 1, 1), iwsa_dim_key=8,
                                           iwsa_dim_value=8, ssa_dim_key=8, ssa_dim_value=8,
                                           ff_expansion_factor=2), 64  # fmt: skip
    if kind == "TwinsSVT":
        return of("twins_svt").TwinsSVT(num_classes=CLASSES, s1_emb_dim=8, s1_local_patch_size=2,
                                     s1_global_k=2, s2_emb_dim=8, s2_local_patch_size=2,
                                     s2_global_k=2, s3_emb_dim=8, s3_local_patch_size=2,
                                     s3_global_k=2, s3_depth=1, s4_emb_dim=8,
                                     s4_local_patch_size=1, s4_global_k=1, s4_depth=1), 64  # fmt: skip
    if kind == "RegionViT":
        return of("regionvit").RegionViT(dim=(8, 16, 16, 16), depth=(1, 1, 1, 1), window_size=2,
                                      num_classes=CLASSES), 64  # fmt: skip
    raise Skip(f"no recipe for {kind}")


def _x_transformers(kind: str) -> tuple[nn.Module, int]:
    from x_transformers import Encoder, ViTransformerWrapper

    attn = {"ViTransformerWrapper": {},
            "rotary+gated": dict(rotary_pos_emb=True, ff_glu=True, attn_qk_norm=True),
            "residual+sandwich": dict(sandwich_norm=True, gate_residual=True)}  # fmt: skip
    if kind not in attn:
        raise Skip(f"no recipe for {kind}")
    return ViTransformerWrapper(image_size=32, patch_size=8, num_classes=CLASSES,
                                attn_layers=Encoder(dim=32, depth=2, heads=4, **attn[kind])), 32  # fmt: skip


LIBRARIES = {
    "vit-pytorch": tuple(
        "ViT SimpleViT CaiT DeepViT PiT CvT LeViT MaxViT MobileViT CCT CrossViT T2TViT NesT XCiT "
        "SmallDataViT ParallelViT RegisterViT QKNormViT ValueResidualViT RvT ScalableViT "
        "TwinsSVT RegionViT".split()
    ),
    "x-transformers": ("ViTransformerWrapper", "rotary+gated", "residual+sandwich"),
}


def check_other(library: str, name: str, mode: str, limit: float = 120.0) -> SweepResult:
    """One model of vit-pytorch or x-transformers (a tiny configuration of each)."""
    make = {"vit-pytorch": _vit_pytorch, "x-transformers": _x_transformers}[library]

    def built():
        torch.manual_seed(0)
        try:
            model, side = make(name)
        except Skip:
            raise
        except Exception as e:
            raise Skip(f"cannot be made: {first_line(e)}") from e
        return _quiet(model).double().train(), side

    return _timed(SweepResult(library, task=mode, model=name), limit, built)


if __name__ == "__main__":
    sys.exit(main())
