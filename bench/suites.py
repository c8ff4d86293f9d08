"""The benchmark's tables: each a set of models and methods run together, whose results are
one JSON file and one table of ``bench/RESULTS.md``.

    python -m bench --suite grad1        # writes bench/results/grad1-cpu.{json,md,png}
    python -m bench --suite host         # tiny models, each at its own batch, 1 thread

A flag given on the command line overrides the suite's (``--suite dp --batch 32``).
"""

from __future__ import annotations

from dataclasses import dataclass

OWN_MODELS = "simplecnn,mlp,cifarcnn,resnet18gn,tinygpt,lstm,embedblock"


@dataclass(frozen=True)
class Suite:
    title: str
    models: str
    methods: str
    batch: str
    reps: int
    slow_reps: int = 1
    threads: int | None = None  # torch.set_num_threads (None: torch's default)
    clock: str = "wall"
    memory: bool = True  # the peak-memory pass


SUITES: dict[str, Suite] = {
    "grad1": Suite(
        "Per-example gradients and their norms",
        OWN_MODELS,
        "plain,floor,loop,vmap,opacus,backpack,ew,grad1,opacus-ghost,backpack-l2,norms",
        "64", reps=9, slow_reps=2,
    ),
    "dp": Suite(
        "DP-SGD steps",
        OWN_MODELS,
        "plain,plain-sgd,opacus-dp,opacus-dp-ghost,dp,dp-bk,dp-grad1",
        "64", reps=9,
    ),
    "curvature": Suite(
        "Squared-gradient sums and K-FAC",
        OWN_MODELS,
        "plain,vmap-sgs,opacus-sgs,ew-sgs,backpack-sgs,sgs,backpack-kflr,kfac,backpack-kfac,kfac-mc",
        "64", reps=9,
    ),
    "jacobians": Suite(
        "Per-example Jacobians",
        "simplecnn,mlp,cifarcnn,resnet18gn,embedblock",
        "plain,jacrev,jacobians",
        "16", reps=7, slow_reps=7,
    ),
    "workloads": Suite(
        "Real workloads: DP fine-tuning of Hugging Face models",
        "gpt2-128,gpt2-512,gpt2-lora-128,bert-128,vit-64",
        "plain,plain-sgd,norms,opacus-dp,opacus-dp-ghost,dp,dp-bk",
        "8", reps=5,
    ),
    "host": Suite(
        "Host cost per step: tiny models, 1 thread",
        "tiny-mlp,tiny-cnn,tiny-gpt2,tiny-bert,tiny-llama,tiny-vit",
        "plain,vmap,opacus,grad1,opacus-ghost,norms,opacus-dp,opacus-dp-ghost,dp-bk",
        "own", reps=31, threads=1, clock="cpu", memory=False,
    ),
}  # fmt: skip
