"""Dataset scale: the dataset-level statistics of ``odds_ratio`` and ``trajectories`` over a
corpus, exact across batches, processes (``torchrun``), Ray Data workers and resumed runs.

``run_stats`` streams a corpus and writes one statistics file (docs/stats-format.md);
``load_stats``/``save_stats`` read and write it bit-exactly; ``merge_stats`` merges files of the
same model and settings; ``ray_stats`` runs it on a Ray cluster (the workers read the data
and compute, the driver merges);
``stats_page`` renders a file as an offline HTML page (``tl-dynamics report --stats FILE``).
"""

from tl_dynamics.scale._format import DatasetStats, save_stats
from tl_dynamics.scale._page import stats_page
from tl_dynamics.scale._ray import ray_stats
from tl_dynamics.scale._read import load_stats, merge_stats
from tl_dynamics.scale._run import run_stats

__all__ = [
    "DatasetStats",
    "load_stats",
    "merge_stats",
    "ray_stats",
    "run_stats",
    "save_stats",
    "stats_page",
]
