"""Testing tools for users' CI: the equivalence checker, Hypothesis strategies and adversarial drafters."""

from ssmspec.testing.check import CheckReport, EquivalenceError, check_model
from ssmspec.testing.drafters import OracleDrafter, RandomDrafter

__all__ = ["CheckReport", "EquivalenceError", "OracleDrafter", "RandomDrafter", "check_model"]
