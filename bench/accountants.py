"""ε of the same DP-SGD runs under each accountant, and the time each takes, side by side.

    python -m bench.accountants            # needs dp-accounting; Opacus' PRV where installed

For each run (noise multiplier σ, sampling rate q, steps T, δ = 1e-5) it prints, as a Markdown
table, ε by gradhooks' ``PrivacyAccountant("rdp")`` (the default) and ``("pld")``, and by
Opacus' ``RDPAccountant`` and ``PRVAccountant`` (its default). Each time is one ``epsilon()``
call with the library already imported (the first call of a process also imports it: about
1 s, SciPy).
"""

from __future__ import annotations

import time

import gradhooks

RUNS = [  # (what, σ, expected batch size, examples, epochs)
    ("MNIST, 60 epochs", 1.1, 256, 60_000, 60),
    ("SST-2, 3 epochs", 0.8, 1024, 67_349, 3),
    ("2,000 examples, 20 epochs", 1.0, 64, 2_000, 20),
]
DELTA = 1e-5


def _timed(fn):
    fn()  # imports, caches
    start = time.perf_counter()
    value = fn()
    return float(value), time.perf_counter() - start


def main() -> None:
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant
    except ImportError:
        PRVAccountant = RDPAccountant = None
    head = "| run | σ | q | steps | gradhooks RDP | gradhooks PLD | Opacus RDP | Opacus PRV |"
    print(head + "\n" + "| --- " * 8 + "|")
    for what, sigma, batch, n, epochs in RUNS:
        q, steps = batch / n, epochs * n // batch
        cells = [what, f"{sigma}", f"{q:.4g}", f"{steps:,}"]
        for method in ("rdp", "pld"):

            def ours(method=method, sigma=sigma, q=q, steps=steps):
                acc = gradhooks.PrivacyAccountant(method)
                acc.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
                return acc.epsilon(DELTA)

            eps, secs = _timed(ours)
            cells.append(f"{eps:.2f} ({secs:.2f} s)")
        for cls in (RDPAccountant, PRVAccountant):
            if cls is None:
                cells.append("(no opacus)")
                continue

            def theirs(cls=cls, sigma=sigma, q=q, steps=steps):
                acc = cls()
                acc.history = [(sigma, q, steps)]
                return acc.get_epsilon(DELTA)

            eps, secs = _timed(theirs)
            cells.append(f"{eps:.2f} ({secs:.2f} s)")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
