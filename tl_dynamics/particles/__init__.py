"""Idealised self-attention dynamics: tokens as interacting particles on the sphere (Geshkovski et al.)."""

from .dynamics import identity_qkv, random_init, random_qkv, suggest_dt, velocity
from .observables import DEFAULT_EPS, close_fraction, cluster_count, cluster_labels, gram, mean_cosine
from .phase import PhaseDiagram, phase_diagram
from .result import ParticleRun
from .seeding import HeadDynamics, from_head
from .simulation import simulate
from .beside import BesideModel, beside_model, report_section
from .views import FigureView, phase_figure, report_html

__all__ = [
    "DEFAULT_EPS",
    "FigureView",
    "HeadDynamics",
    "ParticleRun",
    "PhaseDiagram",
    "close_fraction",
    "cluster_count",
    "cluster_labels",
    "from_head",
    "gram",
    "identity_qkv",
    "mean_cosine",
    "phase_diagram",
    "phase_figure",
    "random_init",
    "random_qkv",
    "report_html",
    "report_section",
    "BesideModel",
    "beside_model",
    "simulate",
    "suggest_dt",
    "velocity",
]
