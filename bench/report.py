"""The benchmark's outputs: a markdown table of ratios to plain forward+backward, and a plot."""

from __future__ import annotations

import json
from pathlib import Path

from .methods import METHODS, PEERS

MIB = 2**20


def write_results(out: str | Path, name: str, data: dict, text: str) -> Path:
    """``data`` as ``out/name.json`` and ``text`` (its tables) as ``out/name.md``, the folder
    made where missing, and ``text`` printed; returns ``out/name``."""
    stem = Path(out) / name
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    stem.with_suffix(".md").write_text(text)
    print(text)
    return stem


def _groups(data: dict) -> dict[tuple[str, int | None], list[dict]]:
    """The records by (device, batch); batch ``None`` where each model ran at its own."""
    own = data.get("batch") == "own"
    groups: dict[tuple[str, int | None], list[dict]] = {}
    for r in data["records"]:
        groups.setdefault((r["device"], None if own else r["batch"]), []).append(r)
    return groups


def _batch(batch: int | None) -> str:
    return "each model at its own batch" if batch is None else f"batch {batch}"


def _ordered(records: list[dict], key: str) -> list[str]:
    seen: list[str] = []
    for r in records:
        if r[key] not in seen:
            seen.append(r[key])
    return seen


def _label(model: str) -> str:
    from .problems import PROBLEMS

    return PROBLEMS[model].label if model in PROBLEMS else model


def ratios(records: list[dict], model: str, what: str) -> dict[str, float]:
    """``{method: value / its base's value}`` for the methods of ``model`` that ran (``what``:
    ``"median_s"`` or ``"peak_bytes"``); the base is plain forward+backward but for the
    methods that name another (the compiled ones: compiled plain)."""
    mine = {r["method"]: r for r in records if r["model"] == model}
    out = {}
    for m, r in mine.items():
        base = METHODS[m].base if m in METHODS else "plain"
        of = mine.get(base, {})
        if r["status"] in ("ok", "wrong") and r.get(what) is not None and of.get(what):
            out[m] = r[what] / of[what]
    return out


def target(records: list[dict], model: str) -> str:
    """The goal for grad1: at most 0.8x the fastest peer, or at most 1.2x the floor where the
    fastest peer is already within 1.5x of it."""
    t = ratios(records, model, "median_s")
    ok = {r["method"] for r in records if r["model"] == model and r["status"] == "ok"}
    peers = [t[m] for m in PEERS if m in t and m in ok]
    if "grad1" not in t or "grad1" not in ok or not peers:
        return ""
    best, g = min(peers), t["grad1"]
    text = f"{g / best:.2f}x best peer"
    floor = t.get("floor")
    if floor:
        text += f", {g / floor:.2f}x floor"
    met = g <= 0.8 * best or (floor is not None and best <= 1.5 * floor and g <= 1.2 * floor)
    return f"{'met' if met else 'missed'} ({text})"


def targets(records: list[dict], model: str) -> str:
    """Every goal this model's records can judge: grad1 (:func:`target`); norms at most 1.5x
    plain's time and 1.3x its peak memory; the DP-SGD step on a path that never forms grad1
    (ghost or book-keeping, the faster) faster than Opacus' fastest DP step (on a real
    workload, :func:`workload_goals` instead); Jacobians at most 0.8x ``vmap(jacrev)``."""
    from .problems import PROBLEMS

    if model in PROBLEMS and PROBLEMS[model].workload:
        return workload_goals(records, model)
    if model in PROBLEMS and PROBLEMS[model].host:
        return host_goals(records, model)
    t = ratios(records, model, "median_s")
    mem = ratios(records, model, "peak_bytes")
    ok = {r["method"] for r in records if r["model"] == model and r["status"] == "ok"}
    verdicts = [f"grad1 {target(records, model)}"] if target(records, model) else []

    def verdict(name: str, met: bool, text: str) -> None:
        verdicts.append(f"{name} {'met' if met else 'missed'} ({text})")

    if "norms" in ok and "norms" in t:
        text = f"{t['norms']:.2f}x plain time"
        met = t["norms"] <= 1.5
        if "norms" in mem:
            text += f", {mem['norms']:.2f}x plain memory"
            met = met and mem["norms"] <= 1.3
        verdict("norms", met, text)
    opacus = [t[m] for m in ("opacus-dp", "opacus-dp-ghost") if m in ok and m in t]
    light = {m: t[m] for m in ("dp", "dp-bk") if m in ok and m in t}  # never form grad1
    if light and opacus:
        best = min(light, key=light.get)
        path = {"dp": "ghost", "dp-bk": "book-keeping"}[best]
        ratio = light[best] / min(opacus)
        verdict("DP step", ratio < 1, f"{path}: {ratio:.2f}x Opacus' fastest")
    if {"jacobians", "jacrev"} <= ok and {"jacobians", "jacrev"} <= set(t):
        ratio = t["jacobians"] / t["jacrev"]
        verdict("Jacobians", ratio <= 0.8, f"{ratio:.2f}x vmap(jacrev)")
    return "; ".join(verdicts)


def workload_goals(records: list[dict], model: str) -> str:
    """The goals on a real workload (a Hugging Face model being fine-tuned): gradhooks' DP step
    (book-keeping or ghost, the faster) at most 1.15x the time of a plain training step (1.05x
    with a LoRA adapter) and 1.2x its peak memory, and at most 0.7x the time of Opacus' fastest
    DP step that runs. The plain training step is ``plain-sgd`` (forward, backward and the SGD
    update that the DP steps also make) where it ran, else plain forward+backward."""
    t = ratios(records, model, "median_s")
    mem = ratios(records, model, "peak_bytes")
    ok = {r["method"] for r in records if r["model"] == model and r["status"] == "ok"}
    light = {m: t[m] for m in ("dp", "dp-bk") if m in ok and m in t}
    if not light:
        return ""
    base = "plain-sgd" if "plain-sgd" in ok and "plain-sgd" in t else "plain"
    best = min(light, key=light.get)
    path = {"dp": "ghost", "dp-bk": "book-keeping"}[best]
    bar = 1.05 if "lora" in model else 1.15
    verdicts = []
    time_ = light[best] / t[base]
    text = f"{path}: {time_:.2f}x {'the plain step' if base != 'plain' else 'plain'}'s time"
    met = time_ <= bar
    if best in mem and base in mem:
        text += f", {mem[best] / mem[base]:.2f}x its memory"
        met = met and mem[best] / mem[base] <= 1.2
    verdicts.append(f"DP step {'met' if met else 'missed'} ({text}; goal {bar}x, 1.2x)")
    opacus = [t[m] for m in ("opacus-dp", "opacus-dp-ghost") if m in ok and m in t]
    if opacus:
        ratio = light[best] / min(opacus)
        verdicts.append(
            f"vs Opacus {'met' if ratio <= 0.7 else 'missed'} ({ratio:.2f}x its fastest)"
        )
    return "; ".join(verdicts)


# the host goals: gradhooks' method, and Opacus' modes that compute the same or more
HOST = {
    "grad1": ("grad1", ("opacus",)),
    "norms": ("norms", ("opacus", "opacus-ghost")),
    "DP step": ("dp-bk", ("opacus-dp", "opacus-dp-ghost")),
}
HOST_PLAIN, HOST_OPACUS = 2.5, 0.7


def host_goals(records: list[dict], model: str) -> str:
    """The goals on a tiny model, where the host's per-call work is most of a step: grad1, the
    norms and the DP step (book-keeping) each at most 2.5x plain forward+backward, and at most
    0.7x the time of Opacus' fastest mode that runs the model and gives as much (grad1: its
    hooks; the norms: hooks or ghost; the DP step: its hooks or ghost DP step)."""
    t = ratios(records, model, "median_s")
    ok = {r["method"] for r in records if r["model"] == model and r["status"] == "ok"}
    verdicts = []
    for name, (mine, peers) in HOST.items():
        if mine not in ok or mine not in t:
            continue
        text = f"{t[mine]:.2f}x plain"
        met = t[mine] <= HOST_PLAIN
        opacus = [t[m] for m in peers if m in ok and m in t]
        if opacus:
            text += f", {t[mine] / min(opacus):.2f}x Opacus' fastest"
            met = met and t[mine] / min(opacus) <= HOST_OPACUS
        verdicts.append(f"{name} {'met' if met else 'missed'} ({text})")
    return "; ".join(verdicts)


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"# {data.get('title', 'gradhooks benchmark')}",
        "",
        f"`{data['command']}`",
        "",
        f"{m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads)"
        + (f", {m['gpu']}" if m.get("gpu") else "")
        + f"; torch {m['torch']}, Python {m['python']}, opacus {m.get('opacus')}, "
        f"backpack {m.get('backpack')}. Median of {data['reps']} steps (the loop: fewer), "
        f"{data.get('clock', 'wall')} clock.",
    ]
    for (device, batch), records in _groups(data).items():
        lines += _section(device, batch, records)
    return "\n".join(lines) + "\n"


def _section(device: str, batch: int, records: list[dict]) -> list[str]:
    """The time and memory tables of one (device, batch), with their notes."""
    lines: list[str] = []
    models = _ordered(records, "model")
    methods = [x for x in _ordered(records, "method") if x != "plain"]
    notes: dict[tuple[str, str], str] = {}  # shared by both tables, numbered in order

    def cell(model: str, method: str, values: dict[str, float]) -> str:
        r = next(r for r in records if r["model"] == model and r["method"] == method)
        text = f"{values[method]:.2f}x" if method in values else "n/a"
        if r["status"] == "ok":
            return text
        label = METHODS[method].label if method in METHODS else method
        notes.setdefault((model, method), f"{_label(model)}, {label}: {r['reason']}")
        number = list(notes).index((model, method)) + 1
        if r["status"] == "wrong":
            return f"{text} WRONG [{number}]"
        return f"{r['status']} [{number}]"

    def header(first: str, extra: list[str]) -> list[str]:
        names = [METHODS[x].label if x in METHODS else x for x in methods]
        cols = ["model", first, *names, *extra]
        return ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]

    def plain(model: str) -> dict:
        return next((r for r in records if r["model"] == model and r["method"] == "plain"), {})

    lines += [
        "",
        f"## {device}, {_batch(batch)}",
        "",
        "Time, as a ratio to plain forward+backward:",
        "",
    ]
    lines += header("plain (ms)", ["goals"])
    for model in models:
        t = ratios(records, model, "median_s")
        ms = f"{plain(model)['median_s'] * 1e3:.1f}" if plain(model).get("median_s") else "n/a"
        row = [_label(model), ms, *(cell(model, x, t) for x in methods), targets(records, model)]
        lines.append("| " + " | ".join(row) + " |")
    if any(r.get("peak_bytes") is not None for r in records):
        lines += ["", "Peak memory of one step, as a ratio to plain forward+backward's:", ""]
        lines += header("plain (MiB)", [])
        for model in models:
            mem = ratios(records, model, "peak_bytes")
            peak = plain(model).get("peak_bytes")
            row = [_label(model), f"{peak / MIB:.1f}" if peak else "n/a"]
            row += [cell(model, x, mem) for x in methods]
            lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += ["", *(f"[{i}] {n}" for i, n in enumerate(notes.values(), 1))]
    said = [r for r in records if r.get("notes")]
    if said:
        lines += ["", "What the methods said of their warm-up step:", ""]
        lines += [f"- {_label(r['model'])}, {METHODS[r['method']].label if r['method'] in METHODS else r['method']}: {r['notes']}" for r in said]  # fmt: skip
    return lines


def plot(data: dict, path: Path) -> Path | None:
    """Time and peak memory per method per model (ratios to plain, log scale); ``None`` when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = _groups(data)
    rows = [("median_s", "time")]
    if any(r.get("peak_bytes") is not None for r in data["records"]):
        rows.append(("peak_bytes", "peak memory"))
    fig, axes = plt.subplots(
        len(rows), len(groups), figsize=(13 * len(groups), 4.5 * len(rows)), squeeze=False,
        constrained_layout=True,
    )  # fmt: skip
    for col, ((device, batch), records) in enumerate(groups.items()):
        models = _ordered(records, "model")
        methods = _ordered(records, "method")
        for row, (what, title) in enumerate(rows):
            ax = axes[row][col]
            width = 0.8 / max(len(methods), 1)
            for i, method in enumerate(methods):
                values = [ratios(records, mo, what).get(method, 0.0) for mo in models]
                xs = [k + i * width for k in range(len(models))]
                label = METHODS[method].label if method in METHODS else method
                ax.bar(xs, values, width, label=label, color=plt.cm.tab20(i % 20))
            ax.set_yscale("log")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks([k + 0.4 - width / 2 for k in range(len(models))])
            ax.set_xticklabels([_label(mo) for mo in models], rotation=15, fontsize=8)
            ax.set_ylabel(f"{title} / plain fwd+bwd (compiled: / compiled plain)"
                          if any(m.startswith("compile") for m in methods)
                          else f"{title} / plain fwd+bwd")  # fmt: skip
            ax.set_title(f"{title}, {device}, {_batch(batch)} (missing bars: not run)")
            ax.grid(axis="y", alpha=0.3)
        # (beside the plot, where it hides no bar)
        axes[0][col].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
