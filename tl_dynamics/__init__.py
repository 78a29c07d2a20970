"""tl_dynamics: attention and the residual stream as a dynamical system, for TransformerLens.

``tl_dynamics.load_model(name_or_folder)`` loads a shipped model, a tiny random one, a Hugging
Face or TransformerLens checkpoint folder, or a hub name (see ``tl_dynamics.models``);
``tl_dynamics.show_versions()`` prints what it runs on (paste it into a bug report).
"""

from typing import TYPE_CHECKING, Any

from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:  # imported on first use at run time (``__getattr__`` below)
    from tl_dynamics.compat import show_versions
    from tl_dynamics.models import load_model

__version__ = "0.1.0"
__all__ = ["TLDynamicsError", "__version__", "load_model", "show_versions"]


# Subpackages reachable as attributes after ``import tl_dynamics`` (``tl_dynamics.docs.math("2.3")``,
# as the README shows), each imported on first use.
SUBMODULES = (
    "adapter",
    "atlas",
    "circuits",
    "collect",
    "contextual_mlp",
    "docs",
    "errors",
    "models",
    "odds_ratio",
    "particles",
    "qk_attribution",
    "report",
    "scale",
    "testing",
    "trajectories",
    "viz",
    "zoo",
)


def __getattr__(name: str) -> Any:
    """``load_model``, ``show_versions`` and the subpackages are imported on first use (they pull
    in torch and transformers)."""
    if name == "load_model":
        from tl_dynamics.models import load_model

        return load_model
    if name == "show_versions":
        from tl_dynamics.compat import show_versions

        return show_versions
    if name in SUBMODULES:
        import importlib

        return importlib.import_module(f"tl_dynamics.{name}")
    raise AttributeError(f"module 'tl_dynamics' has no attribute {name!r}")
