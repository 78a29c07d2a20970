"""Local stability: the block Jacobian ``d z_t^(l+1) / d z_t^(l)`` along a token's trajectory.

The block's input at token ``t`` is replaced (in place, inside the ``resid_pre`` hook) by a
leaf tensor ``x``, and the forward pass is stopped right after ``resid_post`` of the same
layer, so one graph holds ``y = z_t^(l+1)(x)`` with every other token fixed. Products with the
Jacobian come from autograd on that graph: ``J^T u`` is one backward pass (VJP), ``J v`` the
double-backward trick (differentiate the linear map ``u -> J^T u`` again, a JVP).

* Top singular values: subspace (block power) iteration on ``J^T J`` with ``2k`` vectors and a
  Rayleigh-Ritz step, until each of the top ``k`` Ritz pairs has residual
  ``|J^T u_i - sigma_i v_i| <= tol * sigma_i`` (at most ``max_iter`` iterations, ``4k`` products
  each; the singular values are then accurate to about ``tol**2 * sigma`` over the gap).
* Spectral radius: Arnoldi on ``J`` (JVPs only, full re-orthogonalisation); the radius is the
  largest Ritz value's modulus, accepted when its residual ``|h_{m+1,m} s_m| < tol |lambda|``
  or when the Krylov space spans all of ``d_model`` (then exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Complex, Float
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter, Prompt
from tl_dynamics.errors import TLDynamicsError

DEFAULT_K = 4
DEFAULT_TOL = 1e-4
DEFAULT_MAX_ITER = 200


class _Stop(TLDynamicsError):
    """Raised inside the ``resid_post`` hook to end the forward pass after the block."""


@dataclass(frozen=True)
class JacobianSpectrum(viz.Result):
    """Top singular values and spectral radius of one block's per-token Jacobian."""

    architecture: str
    layer: int
    position: int
    token: str
    singular_values: Float[Tensor, " k"]
    spectral_radius: float
    ritz_values: Complex[Tensor, " m"]
    iterations: int
    arnoldi_steps: int
    converged: bool

    def to_dataframe(self) -> Any:
        import pandas as pd

        return pd.DataFrame(
            {
                "layer": self.layer,
                "position": self.position,
                "token": self.token,
                "singular_index": range(len(self.singular_values)),
                "singular_value": self.singular_values.tolist(),
                "spectral_radius": self.spectral_radius,
            }
        )

    def show(self) -> Any:
        from tl_dynamics import viz

        return viz.table(
            self.to_dataframe(),
            caption=(
                f"block {self.layer} Jacobian at token {self.position} ({self.token!r}): gain below 1 "
                "in the top directions means contraction"
            ),
        )


class _Graph:
    """``y = block(x)`` at one token, with JVP/VJP products on the retained graph."""

    def __init__(self, adapter: ModelAdapter, batch: Batch, row: int, position: int, layer: int):
        store: dict[str, Tensor] = {}

        def inject(act: Tensor) -> None:
            x = act[row, position].detach().clone().requires_grad_(True)
            store["x"] = x
            act[row, position] = x  # in place: the block reads this token's state from x

        def stop(act: Tensor) -> None:
            store["y"] = act[row, position]
            raise _Stop("block output captured")

        with torch.enable_grad():
            try:
                with adapter.hooks([("resid_pre", layer, inject), ("resid_post", layer, stop)]):
                    _forward_with_grad(adapter, batch)
            except _Stop:
                pass
        if "y" not in store:
            raise TLDynamicsError(
                f"layer {layer}: the forward pass did not reach its residual output"
            )
        self.x, self.y = store["x"], store["y"]
        self.d = self.x.shape[0]
        self._u = torch.zeros_like(self.y, requires_grad=True)
        self._jt_u = torch.autograd.grad(self.y, self.x, self._u, create_graph=True)[0]

    def _grad(self, out: Tensor, inp: Tensor, rows: Tensor) -> Tensor:
        rows = rows.to(out)
        try:  # one vectorised backward for all rows
            res = torch.autograd.grad(out, inp, rows, retain_graph=True, is_grads_batched=True)[0]
        except RuntimeError:  # an op without a batching rule: one backward per row
            res = torch.stack(
                [torch.autograd.grad(out, inp, r, retain_graph=True)[0] for r in rows]
            )
        return res.double().cpu()

    def vjp(self, u: Float[Tensor, "k d"]) -> Float[Tensor, "k d"]:
        """Rows ``J^T u_i``."""
        return self._grad(self.y, self.x, u)

    def jvp(self, v: Float[Tensor, "k d"]) -> Float[Tensor, "k d"]:
        """Rows ``J v_i`` (double-backward: the gradient of ``<J^T u, v>`` with respect to ``u``)."""
        return self._grad(self._jt_u, self._u, v)


def _forward_with_grad(adapter: ModelAdapter, batch: Batch) -> None:
    adapter.forward(batch, grad=True)


def _top_singular(
    g: _Graph, k: int, tol: float, max_iter: int, seed: int
) -> tuple[Tensor, int, bool]:
    block = min(g.d, 2 * k)  # oversampled block: convergence rate sigma_{2k+1} / sigma_k
    gen = torch.Generator().manual_seed(seed)
    v, _ = torch.linalg.qr(torch.randn(g.d, block, generator=gen, dtype=torch.float64))
    sigma = torch.zeros(k, dtype=torch.float64)
    for it in range(1, max_iter + 1):
        w = g.jvp(v.T).T  # J V
        u, sigma_all, yt = torch.linalg.svd(w, full_matrices=False)  # Rayleigh-Ritz
        z = g.vjp(w.T).T  # J^T J V
        sigma = sigma_all[:k]
        # J^T u_i = Z y_i / sigma_i; the Ritz pair's residual is |J^T u_i - sigma_i V y_i|
        jt_u = (z @ yt.T[:, :k]) / sigma.clamp_min(1e-300)
        residual = (jt_u - (v @ yt.T[:, :k]) * sigma).norm(dim=0)
        if bool((residual <= tol * sigma.clamp_min(1e-12)).all()):
            return sigma.float(), it, True
        v, _ = torch.linalg.qr(z)
    return sigma.float(), max_iter, False


def _arnoldi_radius(
    g: _Graph, tol: float, max_iter: int, seed: int
) -> tuple[float, Tensor, int, bool]:
    gen = torch.Generator().manual_seed(seed + 1)
    m_max = min(max_iter, g.d)
    basis = torch.zeros(g.d, m_max + 1, dtype=torch.float64)
    h = torch.zeros(m_max + 1, m_max, dtype=torch.float64)
    q = torch.randn(g.d, generator=gen, dtype=torch.float64)
    basis[:, 0] = q / q.norm()
    ritz = torch.zeros(0, dtype=torch.complex128)
    for m in range(m_max):
        w = g.jvp(basis[:, m][None])[0]
        for _ in range(2):  # full re-orthogonalisation, twice for stability
            coef = basis[:, : m + 1].T @ w
            w = w - basis[:, : m + 1] @ coef
            h[: m + 1, m] += coef
        h[m + 1, m] = w.norm()
        steps = m + 1
        vals, vecs = torch.linalg.eig(h[:steps, :steps])
        top = int(vals.abs().argmax())
        radius = float(vals[top].abs())
        residual = float(h[steps, m] * vecs[-1, top].abs())
        ritz = vals
        if steps == g.d or residual < tol * max(radius, 1e-12) or float(h[steps, m]) < 1e-12:
            return radius, ritz, steps, True
        basis[:, m + 1] = w / h[m + 1, m]
    return float(ritz.abs().max()), ritz, m_max, False


def _single(
    adapter: ModelAdapter, prompt: Prompt | Batch, row: int, position: int
) -> tuple[Batch, int]:
    batch = adapter.tokenize(prompt)
    if not 0 <= row < batch.tokens.shape[0]:
        raise TLDynamicsError(
            f"row {row} is out of range: the batch has {batch.tokens.shape[0]} prompts"
        )
    real = batch.key_valid[row].nonzero().flatten().tolist()
    if not -len(real) <= position < len(real):
        raise TLDynamicsError(
            f"position {position} is out of range: prompt {row} has {len(real)} "
            f"real tokens (valid: {-len(real)}..{len(real) - 1})"
        )
    return batch, real[position]


def block_jacobian(
    model: Any,
    prompt: Prompt | Batch,
    layer: int,
    position: int = -1,
    k: int = DEFAULT_K,
    tol: float = DEFAULT_TOL,
    max_iter: int = DEFAULT_MAX_ITER,
    row: int = 0,
    seed: int = 0,
) -> JacobianSpectrum:
    """Top-``k`` singular values and spectral radius of ``d z_t^(l+1) / d z_t^(l)``.

    The Jacobian of one block at one token (its own position; the context fixed), from
    Jacobian products only: subspace iteration on ``J^T J`` for the singular values, Arnoldi for the
    spectral radius. See the module docstring for the iterations and the stopping rules.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts, ``[batch, pos]`` token ids or a ``Batch``.
        layer: the block.
        position: the token, counted in real tokens of prompt ``row`` (negative from the end).
        k: singular values wanted (``1..d_model``).
        tol: relative tolerance of the stopping rules.
        max_iter: iterations at most.
        row: which prompt of the batch.
        seed: seed of the start vectors.

    Returns:
        ``JacobianSpectrum``: ``singular_values`` ``[k]``, ``spectral_radius``, the Ritz values,
        iteration counts and whether it ``converged``.

    Example:
        >>> from tl_dynamics import testing
        >>> spec = block_jacobian(testing.tiny_model("gpt2"), "x = 1", layer=0)
        >>> spec.singular_values.shape, spec.converged
        (torch.Size([4]), True)
    """
    adapter = ModelAdapter.of(model)
    adapter.check_layer(layer)
    if not isinstance(k, int) or not 1 <= k <= adapter.d_model:
        raise TLDynamicsError(f"k must be an integer in 1..{adapter.d_model} (d_model), got {k!r}")
    if not tol > 0 or not isinstance(max_iter, int) or max_iter < 1:
        raise TLDynamicsError(
            f"tol must be > 0 and max_iter a positive integer, got tol={tol!r}, "
            f"max_iter={max_iter!r}"
        )
    batch, pos = _single(adapter, prompt, row, position)
    g = _Graph(adapter, batch, row, pos, layer)
    sigma, iters, ok_s = _top_singular(g, k, tol, max_iter, seed)
    radius, ritz, steps, ok_r = _arnoldi_radius(g, tol, max_iter, seed)
    return JacobianSpectrum(
        architecture=adapter.info.architecture,
        layer=layer,
        position=pos,
        token=adapter.str_tokens(batch, row)[pos],
        singular_values=sigma,
        spectral_radius=radius,
        ritz_values=ritz,
        iterations=iters,
        arnoldi_steps=steps,
        converged=ok_s and ok_r,
    )


def dense_block_jacobian(
    model: Any, prompt: Prompt | Batch, layer: int, position: int = -1, row: int = 0
) -> Float[Tensor, "d_out d_in"]:
    """The full ``d_model x d_model`` per-token block Jacobian (``d_model`` VJPs), for checks."""
    adapter = ModelAdapter.of(model)
    adapter.check_layer(layer)
    batch, pos = _single(adapter, prompt, row, position)
    g = _Graph(adapter, batch, row, pos, layer)
    return g.vjp(torch.eye(g.d)).float()
