"""Idealised self-attention dynamics: tokens as interacting particles on the sphere
(Geshkovski et al.; definitions: docs/math.md §6).

``simulate`` integrates (SA)/(USA) for batches of runs; ``phase_diagram`` sweeps beta;
``from_head`` seeds ``Q, K, V, beta`` from a real head. The analysis contract
(docs/developing.md): ``compute(model, prompt, *, layers=None, heads=None, ...)`` runs the
head-seeded flow beside the model's own clustering of the prompt's tokens (``BesideModel``),
and ``report_section`` shows it. There is no ``attach``: the flow is simulated, not read from
the user's forward passes. Clusters, cosines and merge events come from ``tl_dynamics.sphere``.
"""

from tl_dynamics.particles._beside import BesideModel, compute
from tl_dynamics.particles._dynamics import random_init
from tl_dynamics.particles._phase import phase_diagram, phase_figure
from tl_dynamics.particles._report import report_section
from tl_dynamics.particles._result import ParticleRun
from tl_dynamics.particles._seeding import from_head
from tl_dynamics.particles._simulation import simulate

__all__ = [
    "BesideModel",
    "ParticleRun",
    "compute",
    "from_head",
    "phase_diagram",
    "phase_figure",
    "random_init",
    "report_section",
    "simulate",
]
