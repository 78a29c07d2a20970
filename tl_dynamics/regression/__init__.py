"""Attention as in-context regression: which heads' outputs are closest to a least-squares
solve over their context (docs/math.md §8).

- ``compute(model, prompt, *, layers=None, heads=None, ...)`` returns a ``RegressionResult``:
  per head and destination band, the held-out R² of linear attention, ridge (a lambda path and
  the GCV pick), gradient descent and the baselines, with bootstrap intervals, and each head's
  claim against its control.
- ``report_section``: the report page's section.

Regression reads whole prefixes in float64 after each layer is captured: there is no ``attach``
(its sums need every key of a destination's context at once, and its gains the fitting units
before any R² is given; ``compute`` runs one forward pass).
"""

from tl_dynamics.regression._collect import compute
from tl_dynamics.regression._report import report_section
from tl_dynamics.regression._result import RegressionResult

__all__ = ["RegressionResult", "compute", "report_section"]
