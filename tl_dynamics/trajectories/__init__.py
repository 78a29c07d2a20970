"""Depth-wise trajectories: tokens through the layers, particles on the sphere, attractors.

The analysis contract (docs/developing.md): ``compute(model, prompt, *, layers=None, ...)``
gives a ``Trajectory`` (per-token paths of one batch, with that batch's ``TrajectoryStats``);
``attach`` collects during your own forward passes: its ``result()`` is a ``Trajectory`` of
every pass (what ``compute`` gives), its ``stats()`` their ``TrajectoryStats``; ``stream``
gives ``TrajectoryStats`` only (exactly mergeable statistics over many prompts; per-token
arrays do not stream; ``TrajectoryStats.merge`` merges them exactly); ``block_jacobian`` (local
stability), ``class_probe`` (class attractors) and ``report_section``. Unit vectors, cosines
and clusters come from ``tl_dynamics.sphere``. Definitions: docs/math.md §5.
"""

from tl_dynamics.trajectories._collect import attach, compute, stream
from tl_dynamics.trajectories._jacobian import block_jacobian
from tl_dynamics.trajectories._probe import class_probe
from tl_dynamics.trajectories._report import report_section
from tl_dynamics.trajectories._stats import TrajectoryStats
from tl_dynamics.trajectories._trajectory import Trajectory

__all__ = [
    "Trajectory",
    "TrajectoryStats",
    "attach",
    "block_jacobian",
    "class_probe",
    "compute",
    "report_section",
    "stream",
]
