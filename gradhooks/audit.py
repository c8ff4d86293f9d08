"""``gradhooks.audit``: an empirical lower bound on ε from one training run.

The public name of :mod:`gradhooks.privacy.audit`, where the functions and their documentation
live: ``from gradhooks.audit import epsilon_lower_bound``.
"""

from .privacy.audit import epsilon_lower_bound, one_run_p_value

__all__ = ["one_run_p_value", "epsilon_lower_bound"]
