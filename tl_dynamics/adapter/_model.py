"""``ModelAdapter``: the one object that knows how a TransformerLens model exposes attention."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.adapter import _capture, _rotary, _weights
from tl_dynamics.adapter._host import host_info, hooked_post_norm, layer_specs
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._qknorm import QueryNorm, read_query_norm
from tl_dynamics.errors import TLDynamicsError

Prompt = Union[str, Sequence[str], Tensor]
HALF_DTYPES = (torch.float16, torch.bfloat16)

# role -> hook name template per host; the only place hook strings are spelled.
_BLOCK_HOOKS = {
    "q": "attn.hook_q", "k": "attn.hook_k", "v": "attn.hook_v",
    "rot_q": "attn.hook_rot_q", "rot_k": "attn.hook_rot_k",
    "cos": "attn.hook_cos", "sin": "attn.hook_sin",
    "scores": "attn.hook_attn_scores", "pattern": "attn.hook_pattern", "z": "attn.hook_z",
    "resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
}
_HOST_HOOKS = {
    "bridge": {"out": "attn.o.hook_out", "x": "attn.q.hook_in"},
    "hooked": {"out": "hook_attn_out", "x": "ln1.hook_normalized"},
}


@dataclass(frozen=True)
class Batch:
    """Tokens and which of them are real (not padding).

    ``key_valid`` is built from the tokenizer's padding, never from the pad id (which is often
    the BOS id).
    """

    tokens: Int[Tensor, "batch pos"]
    key_valid: Bool[Tensor, "batch pos"]
    padding_side: str

    @property
    def padded(self) -> bool:
        return not bool(self.key_valid.all())


class ModelAdapter:
    """Reads attention exactly from a ``HookedTransformer`` or a ``TransformerBridge``.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> adapter = ModelAdapter(testing.tiny_model("gpt2"))      # doctest: +SKIP
        >>> layers = adapter.attention("a = b + c", reference=True)  # doctest: +SKIP
        >>> la = layers[0]                                           # doctest: +SKIP
        >>> (la.pattern() - la.reference["pattern"]).abs().max() < 1e-5  # doctest: +SKIP
        tensor(True)
    """

    def __init__(self, model: Any):
        self.model = model
        self.info = host_info(model)
        self.specs = layer_specs(model, self.info)
        # HookedTransformer blocks that normalise the attention output (see hooked_post_norm)
        self.post_norm: str | None = hooked_post_norm(model) if self.info.host == "hooked" else None
        cfg = model.cfg
        self.n_layers: int = int(cfg.n_layers)
        self.n_heads: int = int(cfg.n_heads)
        self.d_head: int = int(cfg.d_head)
        self.d_model: int = int(cfg.d_model)
        self.n_kv_heads: int = int(getattr(cfg, "n_key_value_heads", None) or self.n_heads)
        self.n_ctx: int = int(cfg.n_ctx)
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self._cache: dict[tuple, Tensor | None] = {}

    @classmethod
    def of(cls, model: Any) -> "ModelAdapter":
        """The adapter for ``model``: an adapter is returned unchanged, a model is wrapped.

        Every analysis entry point accepts either, through this one function.

        Example:
            >>> from tl_dynamics import testing
            >>> ad = ModelAdapter.of(testing.tiny_model("gpt2"))
            >>> ModelAdapter.of(ad) is ad
            True
        """
        return model if isinstance(model, ModelAdapter) else cls(model)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None when it has none)."""
        return getattr(self.model, "tokenizer", None)

    def __repr__(self) -> str:
        return (f"ModelAdapter({self.info.architecture}, host={self.info.host} "
                f"TL {self.info.tl_version}, compat={self.info.compat}, layers={self.n_layers}, "
                f"heads={self.n_heads}, kv_heads={self.n_kv_heads})")

    # ----------------------------------------------------------------- validation
    def check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.n_layers:
            raise TLDynamicsError(f"layer {layer!r} is out of range: this model has {self.n_layers} "
                                  f"layers (valid: 0..{self.n_layers - 1})")
        return layer

    def check_head(self, head: int, layer: int | None = None) -> int:
        if not isinstance(head, int) or isinstance(head, bool) or not 0 <= head < self.n_heads:
            where = f" in layer {layer}" if layer is not None else ""
            raise TLDynamicsError(f"head {head!r}{where} is out of range: this model has "
                                  f"{self.n_heads} heads per layer (valid: 0..{self.n_heads - 1})")
        return head

    def check_layers(self, layers: int | Sequence[int] | None) -> list[int]:
        if layers is None:
            return list(range(self.n_layers))
        if isinstance(layers, int):
            layers = [layers]
        return [self.check_layer(layer) for layer in layers]

    def check_heads(self, heads: int | Sequence[int] | None) -> list[int]:
        if heads is None:
            return list(range(self.n_heads))
        if isinstance(heads, int):
            heads = [heads]
        return [self.check_head(head) for head in heads]

    # ----------------------------------------------------------------- tokens
    def tokenize(self, prompt: Prompt | Batch, padding_side: str = "right",
                 attention_mask: Tensor | None = None) -> Batch:
        """Tokens and padding mask for a string, a list of strings, or a token tensor.

        A list of strings is padded on ``padding_side``; a token tensor with padding needs its
        ``attention_mask`` (1 = real token), since pads cannot be told apart by id. A ``Batch``
        is returned unchanged, so every entry point can take either.
        """
        if isinstance(prompt, Batch):
            return prompt
        if padding_side not in ("left", "right"):
            raise TLDynamicsError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if isinstance(prompt, Tensor):
            tokens = prompt[None] if prompt.ndim == 1 else prompt
            if tokens.ndim != 2 or tokens.is_floating_point():
                raise TLDynamicsError(f"token tensor must be integer [batch, pos] or [pos], got "
                                      f"{tuple(prompt.shape)} {prompt.dtype}")
            if attention_mask is None:
                key_valid = torch.ones_like(tokens, dtype=torch.bool)
            else:
                key_valid = attention_mask.reshape(tokens.shape).bool()
        else:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts or any(not isinstance(t, str) for t in texts):
                raise TLDynamicsError("prompt must be a non-empty string, a non-empty list of "
                                      "strings, or a token tensor")
            if any(t == "" for t in texts):
                raise TLDynamicsError("prompt is empty: give at least one character of text")
            if self.model.tokenizer is None:
                raise TLDynamicsError("this model has no tokenizer: pass a token tensor instead")
            tokens = self.model.to_tokens(texts, padding_side=padding_side, truncate=False)
            key_valid = self._padding_mask(tokens, padding_side) if len(texts) > 1 else \
                torch.ones_like(tokens, dtype=torch.bool)
        if tokens.shape[1] == 0:
            raise TLDynamicsError("prompt is empty: it has zero tokens")
        if tokens.shape[1] > self.n_ctx:
            raise TLDynamicsError(f"prompt has {tokens.shape[1]} tokens but this model's context "
                                  f"is {self.n_ctx} tokens (valid: 1..{self.n_ctx})")
        return Batch(tokens=tokens, key_valid=key_valid, padding_side=padding_side)

    def _padding_mask(self, tokens: Tensor, padding_side: str) -> Tensor:
        from transformer_lens.utilities.tokenize_utils import get_attention_mask

        prepend = bool(getattr(self.model.cfg, "default_prepend_bos", True))
        return get_attention_mask(self.model.tokenizer, tokens, prepend,
                                  padding_side=padding_side).bool()

    def str_tokens(self, batch: Batch, row: int = 0) -> list[str]:
        """The token strings of one row, padding included (use ``batch.key_valid`` to drop it)."""
        return self.decode(batch.tokens[row])

    def decode(self, ids: Sequence[int] | Tensor) -> list[str]:
        """One string per token id (the id itself, as text, when the model has no tokenizer).

        Example:
            >>> from tl_dynamics import testing
            >>> ModelAdapter(testing.tiny_model("gpt2")).decode([64, 65])
            ['a', 'b']
        """
        ids = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
        tokenizer = self.tokenizer
        if tokenizer is None:
            return [str(i) for i in ids]
        return [tokenizer.decode([i]) for i in ids]

    def forward(self, batch: Batch, grad: bool = False) -> Tensor:
        """Run the model on ``batch``, passing the padding mask to the host; without gradients
        unless ``grad=True`` (e.g. for Jacobians through hooks)."""
        kwargs: dict[str, Any] = {}
        self._check_padding(batch)
        if batch.padded:
            kwargs["attention_mask"] = batch.key_valid.long()
        with torch.set_grad_enabled(grad):
            return self.model(batch.tokens, **kwargs)

    def _check_padding(self, batch: Batch | None) -> None:
        if batch is None or not batch.padded or self.info.host != "hooked":
            return
        if any(not spec.causal for spec in self.specs):
            raise TLDynamicsError(
                "padded batch on a bidirectional HookedTransformer: it does not mask padding "
                "keys (its mask is applied only for causal attention), so its patterns include "
                "the pads; pass prompts one at a time, or use a TransformerBridge encoder")

    # ----------------------------------------------------------------- hooks
    def hook_name(self, role: str, layer: int) -> str | None:
        """The model's hook point for ``role`` in ``layer``, or None where it has none."""
        template = _HOST_HOOKS[self.info.host].get(role) or _BLOCK_HOOKS.get(role)
        if template is None:
            raise TLDynamicsError(f"unknown hook role {role!r}; valid: "
                                  f"{sorted(set(_BLOCK_HOOKS) | set(_HOST_HOOKS['bridge']))}")
        name = f"blocks.{layer}.{template}"
        if role == "out" and self.post_norm is not None:
            return None  # hook_attn_out is after a post-norm: no hook holds the head-output sum
        unnormalised = self.post_norm == "post" or name not in self.model.hook_dict
        if role == "x" and self.info.host == "hooked" and unnormalised:
            name = f"blocks.{layer}.hook_resid_pre"  # no input normalisation: W_Q reads the stream
        return name if name in self.model.hook_dict else None

    @contextmanager
    def hooks(self, hooks: Sequence[tuple[str, int, Callable[[Tensor], None]]],
              on_forward_end: Callable[[], None] | None = None) -> Iterator[None]:
        """Attach ``fn(activation)`` at ``(role, layer)``; removes exactly these hooks on exit."""
        named = []
        for role, layer, fn in hooks:
            name = self.hook_name(role, self.check_layer(layer))
            if name is None:
                raise TLDynamicsError(f"this {self.info.architecture} model has no {role!r} hook "
                                      f"in layer {layer}")
            named.append((name, fn))
        with _capture.registered(self, named, on_forward_end):
            yield

    @contextmanager
    def capture(self, on_layer: Callable[[LayerAttention], None],
                layers: int | Sequence[int] | None = None, reference: bool = False,
                inputs: bool = False, batch: Batch | None = None) -> Iterator[None]:
        """Call ``on_layer(LayerAttention)`` for each layer during every forward pass inside.

        Only one layer's tensors are held at a time. ``batch`` supplies the padding mask for
        padded inputs run by the caller; without it every position counts as real.
        ``reference=True`` also keeps the model's own scores/pattern/z/output for checking.
        """
        self._check_padding(batch)
        collector = _capture.LayerCollector(self, self.check_layers(layers), on_layer,
                                            reference, inputs, batch)
        with _capture.registered(self, collector.hooks(), collector.flush):
            yield
            collector.flush()

    def attention(self, prompt: Prompt | Batch, layers: int | Sequence[int] | None = None,
                  reference: bool = False, inputs: bool = False,
                  padding_side: str = "right") -> dict[int, LayerAttention]:
        """Run the model once and return ``{layer: LayerAttention}`` for the asked layers."""
        batch = self.tokenize(prompt, padding_side)
        out: dict[int, LayerAttention] = {}
        with self.capture(lambda la: out.__setitem__(la.layer, la), layers, reference, inputs, batch):
            self.forward(batch)
        return out

    # ----------------------------------------------------------------- weights
    def _cached(self, key: tuple, compute: Callable[[], Tensor | None]) -> Tensor | None:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def expand_kv(self, t: Float[Tensor, "batch pos kv_head d_head"]) -> Tensor:
        if t.shape[2] == self.n_heads:
            return t
        return torch.repeat_interleave(t, self.n_heads // t.shape[2], dim=2)

    def _attn_weight(self, layer: int, name: str, bias_shape: tuple[int, ...] | None = None) -> Tensor:
        """A weight (required) or a bias (zeros where the model has none), GQA expanded."""
        def compute() -> Tensor:
            w = _weights.attn_param(self.model, layer, name)
            if w is None and bias_shape is None:
                raise TLDynamicsError(f"layer {layer} of {self.info.architecture} exposes no {name}")
            w = torch.zeros(bias_shape) if w is None else w
            return w if name == "b_O" else _weights.expand_heads(w, self.n_heads)
        return self._cached((name, layer), compute)

    def W_Q(self, layer: int) -> Float[Tensor, "head d_model d_head"]:
        return self._attn_weight(self.check_layer(layer), "W_Q")

    def W_K(self, layer: int) -> Float[Tensor, "head d_model d_head"]:
        return self._attn_weight(self.check_layer(layer), "W_K")

    def W_V(self, layer: int) -> Float[Tensor, "head d_model d_head"]:
        return self._attn_weight(self.check_layer(layer), "W_V")

    def W_O(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        return self._attn_weight(self.check_layer(layer), "W_O")

    def b_Q(self, layer: int) -> Float[Tensor, "head d_head"]:
        return self._attn_weight(self.check_layer(layer), "b_Q", (self.n_heads, self.d_head))

    def b_K(self, layer: int) -> Float[Tensor, "head d_head"]:
        return self._attn_weight(self.check_layer(layer), "b_K", (self.n_heads, self.d_head))

    def b_V(self, layer: int) -> Float[Tensor, "head d_head"]:
        return self._attn_weight(self.check_layer(layer), "b_V", (self.n_heads, self.d_head))

    def b_O(self, layer: int) -> Float[Tensor, " d_model"]:
        return self._attn_weight(self.check_layer(layer), "b_O", (self.d_model,))

    def query_norm(self, layer: int) -> QueryNorm | None:
        """The query normalisation of ``layer`` on qk-norm architectures (``None`` elsewhere).

        Read from the model's own norm module: Gemma 3 (per head, gain ``1 + w``), OLMo 2 (over
        all heads), a HookedTransformer with ``use_qk_norm`` (per head). ``apply`` maps
        ``x W_Q + b_Q`` to the query before rotary.

        Example:
            >>> from tl_dynamics import testing
            >>> ad = ModelAdapter(testing.tiny_model("gemma3"))
            >>> ad.query_norm(0).scope, ModelAdapter(testing.tiny_model("llama")).query_norm(0)
            ('head', None)
        """
        self.check_layer(layer)
        if not self.specs[layer].qk_norm:
            return None

        def compute() -> QueryNorm:
            return read_query_norm(
                self.model.blocks[layer].attn, f"layer {layer} of {self.info.architecture}",
                gemma_gain=self.info.host == "bridge" and self.info.family == "gemma3",
                n_heads=self.n_heads, d_head=self.d_head, W_Q=self.W_Q(layer), b_Q=self.b_Q(layer))
        return self._cached(("query_norm", layer), compute)

    def head_weights(self, layer: int, head: int) -> _weights.HeadWeights:
        """All of one head's weights and its score scale."""
        self.check_layer(layer)
        self.check_head(head, layer)
        return _weights.HeadWeights(
            layer=layer, head=head, W_Q=self.W_Q(layer)[head], W_K=self.W_K(layer)[head],
            W_V=self.W_V(layer)[head], W_O=self.W_O(layer)[head], b_Q=self.b_Q(layer)[head],
            b_K=self.b_K(layer)[head], b_V=self.b_V(layer)[head], b_O=self.b_O(layer),
            scale=self.specs[layer].scale)

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self._cached(("W_E",), lambda: _weights.model_param(self.model, "W_E"))

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self._cached(("W_U",), lambda: _weights.model_param(self.model, "W_U"))

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        def compute() -> Tensor:
            b = _weights.model_param(self.model, "b_U")
            return torch.zeros(self.W_U.shape[1]) if b is None else b
        return self._cached(("b_U",), compute)

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"] | None:
        """Learned absolute position embeddings, or None (rotary, ALiBi)."""
        def compute() -> Tensor | None:
            if self.model.cfg.positional_embedding_type not in ("standard", "shortformer"):
                return None
            pos_embed = getattr(self.model, "pos_embed", None)
            return None if pos_embed is None else _weights.model_param(pos_embed, "W_pos")
        return self._cached(("W_pos",), compute)

    def final_norm(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """The model's own final normalisation (identity where it has none), in float32."""
        ln = getattr(self.model, "ln_final", None)
        if ln is None:
            return resid.float()
        with torch.no_grad():
            return ln(resid.to(self.dtype)).float()

    def unembed(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_vocab"]:
        """``x @ W_U + b_U`` (x already normalised)."""
        return x.float() @ self.W_U + self.b_U

    def logit_lens(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_vocab"]:
        """Logits read from a residual-stream state as the model's own head would: final
        normalisation, then unembedding. Equals the model's logits on the last ``resid_post``
        for decoder language models (tested). Encoders raise: their MLM head is not a final
        norm plus unembedding."""
        if self.is_encoder:
            raise TLDynamicsError(f"the logit lens is not applicable to the encoder "
                                  f"{self.info.architecture}: its masked-LM head is not a final "
                                  "normalisation followed by the unembedding")
        return self.unembed(self.final_norm(resid))

    @property
    def is_encoder(self) -> bool:
        """True for bidirectional (encoder) models."""
        return any(not spec.causal for spec in self.specs)

    def interleaved_cos_sin(self, layer: int, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Adjacent-pair (GPT-J style) rotary tables at ``positions`` ``[batch, pos]``: the
        model's own cached tables where it keeps them (native bridge), else from the base."""
        spec = self.specs[layer]
        rotary = getattr(getattr(self.model.blocks[layer].attn, "original_component", None),
                         "rotary", None)
        if rotary is not None and hasattr(rotary, "cos_cached"):
            return rotary.cos_cached[positions].float(), rotary.sin_cached[positions].float()
        return _rotary.interleaved_cos_sin(positions, spec.rotary_dim, spec.rotary_base)

    def attention_input(self, layer: int, x: Tensor) -> Tensor:
        """The vector W_Q reads, from the captured ``x`` hook. HookedTransformer's
        ``ln1.hook_normalized`` is taken before the LayerNorm's own weight and bias, so they
        are applied here (identity for LNPre and for models with folded LayerNorm)."""
        if self.info.host != "hooked" or self.post_norm == "post":
            return x  # a bridge's hook is the input itself; OLMo 2 post-norm reads the stream
        ln = self.model.blocks[layer].ln1
        weight, bias = getattr(ln, "w", None), getattr(ln, "b", None)
        if isinstance(weight, Tensor):
            x = x * weight.detach().float()
        if isinstance(bias, Tensor):
            x = x + bias.detach().float()
        return x

    def hooked_alibi(self, layer: int, n_pos: int) -> Tensor:
        """HookedTransformer's own ALiBi bias ``[head, pos, pos]`` for ``layer``, as its last
        forward pass added it. HookedTransformer caches the bias at the longest context seen
        and slices its *last* rows, so after a longer prompt each row carries a constant shift
        (softmax-invariant); reading its buffer reproduces its scores exactly either way."""
        buffer = getattr(self.model.blocks[layer].attn, "alibi", None)
        if isinstance(buffer, Tensor) and buffer.shape[-1] >= n_pos:
            return buffer[:, -n_pos:, :n_pos].detach().float()
        from transformer_lens.components import AbstractAttention

        return AbstractAttention.create_alibi_bias(self.n_heads, n_pos, "cpu").float()
