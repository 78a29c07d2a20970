"""The stream entering a layer split into a SAELens SAE's active features instead of components
(docs/math.md §10.7).

With an SAE reading ``blocks.L.hook_resid_pre``, the stream ``r`` the layer reads is exactly

    r = sum_f a_f W_dec[f] + b_dec + (r - (a W_dec + b_dec))

(``a = encode(r)``; the last term is the SAE's error, input less reconstruction), so each active
feature, the decoder bias and the error are parts of a ``Residual`` like the components, and every
query and key stays an exact sum of per-part vectors. An SAE whose decoder is not
``a W_dec + b_dec`` (an out-normalisation), an SAE on another hook, and an SAE spliced into the
stream without its error term (the layer would read the reconstruction, not what the components
wrote) are refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tl_dynamics.adapter._residual import Residual, relative_error
from tl_dynamics.adapter._sae import spliced
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter._model import ModelAdapter

# Relative error within which ``a W_dec + b_dec`` must reproduce the SAE's own decoder output
# (float32 reorders sums; half precision rounds).
DECODE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6}


def sae_layer(sae: Any) -> int:
    """The layer whose input (``blocks.L.hook_resid_pre``) ``sae`` reads; refuses any other hook,
    transcoders and objects that are not SAELens SAEs.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> sae_layer(NS(cfg=NS(metadata=NS(hook_name="blocks.1.hook_resid_pre"))))
        1
    """
    metadata = getattr(getattr(sae, "cfg", None), "metadata", None)
    hook = getattr(metadata, "hook_name", None)
    if not isinstance(hook, str):
        raise TLDynamicsError(
            f"qk attribution: sae must be a SAELens SAE (with cfg.metadata.hook_name), got "
            f"{type(sae).__name__}"
        )
    out = getattr(metadata, "hook_name_out", None)
    parts = hook.split(".")
    ok = len(parts) == 3 and parts[0] == "blocks" and parts[2] == "hook_resid_pre"
    if not ok or not parts[1].isdigit() or out not in (None, hook):
        raise TLDynamicsError(
            f"qk attribution: the SAE reads {hook!r}"
            + (f" and writes {out!r} (a transcoder)" if out not in (None, hook) else "")
            + "; features replace components only for an SAE on the residual stream a layer "
            "reads, 'blocks.<layer>.hook_resid_pre'"
        )
    return int(parts[1])


def feature_residual(res: Residual, sae: Any, architecture: str) -> Residual:
    """``res``'s stream split into ``sae``'s active features, its decoder bias and its error.

    Features active (non-zero) at no valid position are left out: their parts are zero.
    """
    layer = sae_layer(sae)
    if layer != res.layer:
        raise TLDynamicsError(
            f"qk attribution: the SAE reads the input of layer {layer}, not of layer {res.layer}"
        )
    W_dec, b_dec = sae.W_dec.detach(), sae.b_dec.detach()
    r = res.stream.float()
    with torch.no_grad():
        acts = sae.encode(r.to(W_dec)).float()
        recon = sae.decode(acts.to(W_dec)).float()
    W_dec, b_dec = W_dec.float().to(r.device), b_dec.float().to(r.device)
    acts, recon = acts.to(r.device), recon.to(r.device)
    affine = acts @ W_dec + b_dec
    err = relative_error(affine, recon, res.valid)
    tol = DECODE_RTOL.get(sae.W_dec.dtype, 2e-2)
    if err > tol:
        raise TLDynamicsError(
            f"qk attribution: the SAE's reconstruction of layer {layer}'s input on "
            f"{architecture} is not acts @ W_dec + b_dec (relative error {err:.2e} > {tol:g}: an "
            "out-normalisation?), so it cannot be split into features exactly"
        )
    active = (acts[res.valid] != 0).any(0).nonzero()[:, 0].tolist()
    coefs = [acts[..., f : f + 1] for f in active]
    bases: list[torch.Tensor | None] = [W_dec[f : f + 1] for f in active]
    coefs += [torch.ones_like(r[..., :1]), r - affine]
    bases += [b_dec[None], None]
    names = tuple(f"SAE feature {f}" for f in active) + ("SAE decoder bias", "SAE error")
    kinds = ("feature",) * len(active) + ("bias", "error")
    errors = {**res.errors, "SAE decoder": err}
    return Residual(
        layer, names, kinds, coefs, bases, res.stream, res.scale, res.positions, res.valid, errors
    )


def _stream_hooks(layer: int) -> set[str]:
    """The hooks at which a splice changes the stream layer ``layer`` reads without any
    component writing the change."""
    names = {"hook_embed", "hook_pos_embed"} | {
        f"blocks.{l}.hook_resid_pre" for l in range(layer + 1)
    }
    for l in range(layer):
        names |= {f"blocks.{l}.{h}" for h in ("hook_resid_mid", "hook_resid_post", "hook_mlp_out")}
    return names


def refuse_spliced_stream(adapter: "ModelAdapter", layer: int) -> None:
    """Refuse an SAE spliced into the stream before ``layer`` without its error term: what flows
    on is its reconstruction, which no component wrote."""
    wanted = _stream_hooks(layer)
    modules = dict(adapter.model.named_modules())
    for name, kind in spliced(adapter.model, adapter.info.host).items():
        if name in wanted and getattr(modules[name], "use_error_term", False) is not True:
            raise TLDynamicsError(
                f"qk attribution: an SAE ({kind}) is spliced at {name!r} without use_error_term, "
                f"so the stream layer {layer} reads is its reconstruction, not the sum of what the "
                "components wrote; splice it with use_error_term=True, or pass it unspliced as "
                "sae= to split the layer's input into its features"
            )
