"""tl_dynamics: attention and the residual stream as a dynamical system, for TransformerLens."""

from tl_dynamics.errors import TLDynamicsError

__version__ = "0.1.0"
__all__ = ["TLDynamicsError", "__version__"]
