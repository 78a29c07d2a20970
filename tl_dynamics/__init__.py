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


def _public_modules() -> tuple[str, ...]:
    """The public modules and subpackages, read from the package's folder (a new one is listed
    without a list to update)."""
    import pkgutil

    return tuple(
        sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    )


# Subpackages reachable as attributes after ``import tl_dynamics`` (``tl_dynamics.docs.math("2.3")``,
# as the README shows), each imported on first use, and listed by ``dir(tl_dynamics)`` (tab
# completion).
SUBMODULES = _public_modules()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SUBMODULES) | {"load_model", "show_versions"})


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


def _quiet_progress_bars() -> None:
    """In a Jupyter kernel without ipywidgets, ``tqdm.auto`` warns "IProgress not found" when
    first imported (by transformers, or by an analysis) and then draws text bars: import it
    once here with that one warning silenced, so the bars work and the first cell stays clean."""
    import sys

    if "ipykernel" not in sys.modules:
        return
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401


_quiet_progress_bars()
