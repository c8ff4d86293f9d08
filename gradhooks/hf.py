"""``gradhooks.hf``: DP fine-tuning with Hugging Face's ``Trainer`` (needs ``transformers``:
``pip install "gradhooks[hf]"``).

The public name of :mod:`gradhooks.workflows.hf`, where the classes and their documentation
live: ``from gradhooks.hf import DPTrainer, DPArguments``.
"""

from .workflows.hf import DPArguments, DPTrainer, per_example_loss

__all__ = ["DPTrainer", "DPArguments", "per_example_loss"]
