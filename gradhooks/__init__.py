"""gradhooks: per-example gradients for PyTorch by hooks.

    import gradhooks
    with gradhooks.add_hooks(model):            # loss_reduction="mean" (default) or "sum"
        F.cross_entropy(model(x), y).backward()
    model.fc.weight.grad1                       # [batch, *weight.shape]

``grad1[i]`` is the gradient of example ``i``'s own loss: ``grad1.mean(0) == param.grad`` for a
mean-reduced loss, ``grad1.sum(0) == param.grad`` for a sum. autograd-hacks' functions are here
too, so ``import gradhooks as autograd_hacks`` runs its recipe unchanged.
"""

from . import oracle, rules  # noqa: F401  (rules: registers the built-in rules)
from .compat import (
    backprop_hess,
    clear_backprops,
    compute_grad1,
    compute_hess,
    disable_hooks,
    enable_hooks,
    is_supported,
)
from .engine.handle import Hooks, add_hooks, clear_grad1, hooks_of, remove_hooks
from .engine.memory import set_memory_limit
from .engine.pause import paused, set_enabled
from .errors import (
    BatchNotFoundError,
    CheckFailedError,
    ConfigurationError,
    ConfigurationTypeError,
    Grad1TooLarge,
    GradhooksError,
    GradhooksWarning,
    MissingDependencyError,
    MixedExamplesError,
    NumericalError,
    PrivacyBudgetExceeded,
    RuleError,
    SharedInputWarning,
    StateError,
    UnbatchedInputError,
    UnsupportedError,
    UnsupportedInputError,
    UnsupportedModuleError,
)
from .pieces import Direct, Outer, Piece, Rows
from .privacy import audit  # noqa: F401
from .privacy.accounting import PrivacyAccountant, noise_multiplier_for
from .privacy.sampling import PoissonSampler, poisson_loader
from .quantities.noise import NoiseScale
from .rules.registry import REGISTRY, Call, Registry, register
from .tuning import TUNING, Tuning, tuned
from .workflows import distributed  # noqa: F401
from .workflows.check import CheckReport, check_rule
from .workflows.clipping import AdaptiveClipping
from .workflows.convert import convert_batch_norm
from .workflows.dp import ClippedSum, clip_factors, clipped_sum, dp_sgd_step
from .workflows.jacobian import jacobians
from .workflows.kfac import KFactors, KFactorsInverse, ekfac_eigenvalues, kfac, kfac_precondition
from .workflows.kfac_optimizer import KFAC
from .workflows.private import DPOptimizer, PrivateTraining, make_private

__version__ = "0.1.0"

__all__ = [
    # hooks
    "add_hooks",
    "remove_hooks",
    "Hooks",
    "hooks_of",
    "clear_grad1",
    "set_enabled",
    "paused",
    # guards (never silently wrong)
    "set_memory_limit",
    "GradhooksWarning",
    "SharedInputWarning",
    "CheckReport",
    # errors (every refusal is a GradhooksError; see gradhooks.errors)
    "GradhooksError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "StateError",
    "BatchNotFoundError",
    "UnbatchedInputError",
    "MixedExamplesError",
    "UnsupportedError",
    "UnsupportedInputError",
    "UnsupportedModuleError",
    "RuleError",
    "CheckFailedError",
    "NumericalError",
    "MissingDependencyError",
    "Grad1TooLarge",
    "PrivacyBudgetExceeded",
    # more from the same hooks (add_hooks(model, quantities=...))
    "dp_sgd_step",
    "clip_factors",
    "clipped_sum",
    "ClippedSum",
    "DPOptimizer",
    "AdaptiveClipping",
    "make_private",
    "PrivateTraining",
    "PoissonSampler",
    "poisson_loader",
    "PrivacyAccountant",
    "noise_multiplier_for",
    "audit",
    "convert_batch_norm",
    "NoiseScale",
    "kfac",
    "KFactors",
    "KFactorsInverse",
    "kfac_precondition",
    "ekfac_eigenvalues",
    "KFAC",
    "jacobians",
    "distributed",
    # autograd-hacks compatibility
    "compute_grad1",
    "clear_backprops",
    "disable_hooks",
    "enable_hooks",
    "is_supported",
    "backprop_hess",
    "compute_hess",
    # rules
    "register",
    "Registry",
    "REGISTRY",
    "Call",
    "Piece",
    "Outer",
    "Direct",
    "Rows",
    "check_rule",
    # references
    "oracle",
    # thresholds between equivalent paths
    "tuned",
    "Tuning",
    "TUNING",
]
