"""OV copying read on the model's own pass (``copy_pass``): does what a head writes when it
attends a position raise that position's token in the logits, above the other probe tokens?

The weights-only copying score (eigenvalues of ``W_E W_V W_O W_U``, ``circuits.copying_scores``)
reads the raw embedding and leaves out every norm and MLP. On a pretrained model with anisotropic
embeddings a few directions dominate that product, so a random head scores near +1 or -1 and the
score cannot tell copying from chance (SmolLM2-135M: chance 0.96). This score reads the pass:

    u_j = v_j W_O[h]                 what head h writes when it attends source j (its value there)
    l_j(t) = (C u_j) . W_dir[:, t]   its direct effect on token t's logit (``logit_directions``:
                                     the final norm's gain times ``W_U``, centred for LayerNorm; the
                                     norm's positive scale does not change ranks)
    copy_j = mean over probe tokens s of sign(l_j(t_j) - l_j(s))

``copy_pass`` is the mean of ``copy_j`` over a probe's positions after the first: +1 when the head
raises the token it attends above every other probe token, -1 when it lowers it below all (the
head writes against what it reads), 0 in expectation for a head that does not copy, whatever
directions it favours: the other probe tokens are drawn like ``t_j``, so a head that raises a
class of tokens raises them alike. Only the direct path to the logits is read (not what later
layers make of the write), as in direct logit attribution.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tl_dynamics.adapter import LayerAttention, ModelAdapter
from tl_dynamics.atlas._probes import Probes

# Sources per chunk of the [sources, head, probe tokens] logit block (memory stays flat).
SOURCE_CHUNK = 2048


class CopyReader:
    """Reads ``copy_pass`` of every head of a layer from its captured values, per probe."""

    def __init__(self, adapter: ModelAdapter, probes: Probes):
        toks = probes.repeat.tokens[:, probes.offset :]
        self.ids = toks.reshape(-1).unique()  # the probe tokens, sorted: the comparison set
        center, W = adapter.logit_directions(self.ids)
        # centred once for LayerNorm: (u - mean u) W = u (W - mean over rows of W)
        self.W = W - W.mean(0, keepdim=True) if center else W
        self.start = probes.offset + 1  # the positions after the first real one
        self.vocab_ok = bool(self.ids.max() < adapter.W_U.shape[1]) if self.ids.numel() else False

    def __call__(self, la: LayerAttention, tokens: Tensor) -> Tensor:
        """``[batch, head]``: each head's ``copy_pass`` on the probes ``tokens`` ``[batch, pos]``.

        The logits are read as ``v_j (W_O[h] W_dir)``: the head's ``[d_head, tokens]`` map is
        formed once per layer (from the directions, centred once for LayerNorm), a tenth of the
        work of writing every ``u_j`` into ``d_model`` on SmolLM2."""
        v = la.v[:, self.start :]  # [b, n, h, d]
        t = tokens[:, self.start :].to(v.device).contiguous()
        own = torch.searchsorted(self.ids.to(v.device), t)  # index of t_j in the comparison set
        W = self.W.to(v.device)
        per_head = torch.einsum("hdm,mt->hdt", la.W_O.float(), W)  # [h, d_head, tokens]
        b, n, h, _ = v.shape
        flat_v, flat_own = v.reshape(b * n, h, -1), own.reshape(b * n)
        out = torch.empty(b * n, h, device=v.device)
        for s0 in range(0, b * n, SOURCE_CHUNK):
            logits = torch.einsum("shd,hdt->sht", flat_v[s0 : s0 + SOURCE_CHUNK], per_head)
            idx = flat_own[s0 : s0 + SOURCE_CHUNK, None, None].expand(-1, h, 1)
            mine = logits.gather(-1, idx)
            out[s0 : s0 + SOURCE_CHUNK] = torch.sign(mine - logits).mean(-1)
        return out.reshape(b, n, h).mean(1)
