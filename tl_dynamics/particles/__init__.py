"""Idealised self-attention dynamics: tokens as interacting particles on the sphere
(Geshkovski et al.; definitions: docs/math.md §6).

``simulate`` integrates (SA)/(USA) for batches of runs; ``phase_diagram`` sweeps beta;
``from_head`` seeds ``Q, K, V, beta`` from a real head. The analysis contract
(docs/developing.md): ``compute(model, prompt, *, layers=None, heads=None, ...)`` runs the
head-seeded flow beside the model's own clustering of the prompt's tokens (``BesideModel``),
and ``report_section`` shows it. There is no ``attach``: the flow is simulated, not read from
the user's forward passes. Clusters, cosines and merge events come from ``tl_dynamics.sphere``.
"""

from tl_dynamics.particles._beside import BESIDE_EPS, BesideModel, beside_model, compute
from tl_dynamics.particles._dynamics import identity_qkv, random_init, random_qkv, suggest_dt, velocity
from tl_dynamics.particles._observables import close_fraction, cluster_count, cluster_labels, mean_cosine
from tl_dynamics.particles._phase import PhaseDiagram, PhaseParams, phase_diagram, phase_figure
from tl_dynamics.particles._report import ParticlesAnalysis, report_html, report_section
from tl_dynamics.particles._result import ParticleRun, RunParams
from tl_dynamics.particles._seeding import HeadDynamics, HeadSource, from_head
from tl_dynamics.particles._simulation import simulate

__all__ = ["BESIDE_EPS", "BesideModel", "HeadDynamics", "HeadSource", "ParticleRun",
           "ParticlesAnalysis", "PhaseDiagram", "PhaseParams", "RunParams", "beside_model",
           "close_fraction", "cluster_count", "cluster_labels", "compute", "from_head",
           "identity_qkv", "mean_cosine", "phase_diagram", "phase_figure", "random_init",
           "random_qkv", "report_html", "report_section", "simulate", "suggest_dt", "velocity"]
