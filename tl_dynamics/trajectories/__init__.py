"""Depth-wise trajectories: tokens through the layers, particles on the sphere, attractors.

``compute`` (one batch, per-token), ``stream``/``attach`` (exactly mergeable statistics over
many prompts), ``block_jacobian`` (local stability), ``class_probe`` (class attractors) and
``report_section``. Definitions: ``docs/math.md`` §4 of the shared folder.
"""

from tl_dynamics.trajectories._exact import ExactSum
from tl_dynamics.trajectories._jacobian import JacobianSpectrum, block_jacobian, dense_block_jacobian
from tl_dynamics.trajectories._particles import BIN_EDGES, DEFAULT_EPS, N_BINS
from tl_dynamics.trajectories._points import Standardizer
from tl_dynamics.trajectories._probe import ClassProbe, class_probe
from tl_dynamics.trajectories._stats import TrajectoryStats
from tl_dynamics.trajectories._stream import Accumulator, attach, merge, stream
from tl_dynamics.trajectories._trajectory import Trajectory, compute
from tl_dynamics.trajectories._views import report_section

__all__ = ["Accumulator", "BIN_EDGES", "ClassProbe", "DEFAULT_EPS", "ExactSum", "JacobianSpectrum",
           "N_BINS", "Standardizer", "Trajectory", "TrajectoryStats", "attach", "block_jacobian",
           "class_probe", "compute", "dense_block_jacobian", "merge", "report_section", "stream"]
