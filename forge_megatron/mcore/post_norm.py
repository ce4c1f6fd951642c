"""Norms after attention and MLP (OLMo 2 / OLMo 3's "reordered norm"; with the usual ones too, Gemma 3's sandwich;
after the experts only, A.X K1's), and residuals taken from the norms' outputs (MiniMax-01 / M1:
:class:`NormResidualLayer`).

A Llama-style layer normalises the input of each sublayer; OLMo 2 and OLMo 3 normalise each sublayer's output,
before it joins the residual stream, and leave the stream itself un-normalised until the final norm; Gemma 3 does
both:

    pre-norm (Megatron's TransformerLayer)   post-norm (OLMo)               sandwich (Gemma 3)
    h = x + Attn(RMSNorm(x))                  h = x + RMSNorm_a(Attn(x))     h = x + RMSNorm_a(Attn(RMSNorm(x)))
    y = h + MLP(RMSNorm(h))                   y = h + RMSNorm_m(MLP(h))      y = h + RMSNorm_m(MLP(RMSNorm(h)))

Megatron-Core's layer has no norm after a sublayer, so :class:`PostNormTransformerLayer` adds two, built from the
same norm spec as its input norms (which become identities for OLMo) and applied by forward hooks on the attention
and MLP modules: every other part of Megatron's layer (bias-dropout-add, recomputation, sequence parallelism, MoE) is left
as it is. Under tensor parallelism the attention and MLP outputs are whole tokens again (all-reduced, or reduce-
scattered over the sequence with sequence parallelism), so each norm sees the hidden vectors the unsplit model would;
with sequence parallelism their weights are marked like the other norms' (mcore/model.py ``SequenceParallelNorm``)
and their gradients summed over TP.

A.X K1 (SK Telecom's DeepSeek-V3 derivative) keeps DeepSeek-V3's pre-norm layers and adds one RMSNorm on the output of
each MoE layer's MLP (routed experts plus shared expert), before the residual adds it: :func:`moe_output_norm_spec`
makes only those layers post-norm layers, with an identity after the attention.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


@dataclasses.dataclass
class PostNormLayerSubmodules(TransformerLayerSubmodules):
    """Megatron's layer submodules plus the norms applied to the attention and MLP outputs."""

    post_self_attn_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


class PostNormTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer with ``post_self_attn_layernorm`` on the attention's output and
    ``post_mlp_layernorm`` on the MLP's (module docstring). The sublayers must return no separate bias (OLMo has no
    linear biases): the norm applies to the sum a bias would be part of."""

    def __init__(self, config, submodules: PostNormLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, config=self.config,
                                                     hidden_size=self.config.hidden_size,
                                                     eps=self.config.layernorm_epsilon)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, config=self.config,
                                               hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.self_attention.register_forward_hook(_normalise_output(self.post_self_attn_layernorm))
        self.mlp.register_forward_hook(_normalise_output(self.post_mlp_layernorm))


def _normalise_output(norm):
    def hook(module, args, output):
        out, bias = output
        if bias is not None:
            raise ValueError("a post-norm layer's sublayers must have no output bias (add_bias_linear=False)")
        return norm(out), None

    return hook


def post_norm_spec(spec, keep_pre_norms: bool = False):
    """``spec`` (a layer spec, or a block spec of layer specs) as post-norm layers: their norm module normalises the
    attention and MLP outputs too; the input and pre-MLP norms stay (``keep_pre_norms``: Gemma 3) or become
    identities (OLMo)."""
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[post_norm_spec(s, keep_pre_norms) for s in spec.layer_specs])
    subs = spec.submodules
    norm = subs.pre_mlp_layernorm
    if norm is IdentityOp:
        raise TypeError(f"cannot find the norm module of layer spec {spec!r} (its pre_mlp_layernorm is an identity)")
    fields = {f.name: getattr(subs, f.name) for f in dataclasses.fields(subs) if f.init}
    fields.update(post_self_attn_layernorm=norm, post_mlp_layernorm=norm)
    if not keep_pre_norms:
        fields.update(input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp)
    return dataclasses.replace(spec, module=PostNormTransformerLayer, submodules=PostNormLayerSubmodules(**fields))


def moe_output_norm_spec(spec):
    """``spec`` (a layer spec, or a block spec of layer specs) with a norm on the output of each MoE layer's MLP
    (A.X K1's ``post_mlp_layernorm``): those layers become :class:`PostNormTransformerLayer` with an identity after
    the attention and the layer's own norm class after the MLP; dense layers (a block spec's first ones) and every
    pre-norm are left as they are."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[moe_output_norm_spec(s) for s in spec.layer_specs])
    subs = spec.submodules
    if not isinstance(getattr(subs.mlp, "submodules", None), MoESubmodules):
        return spec  # a dense layer
    if spec.module is not TransformerLayer:
        raise TypeError(f"a norm after the experts needs Megatron's TransformerLayer, got {spec.module!r}")
    fields = {f.name: getattr(subs, f.name) for f in dataclasses.fields(subs) if f.init}
    fields.update(post_mlp_layernorm=subs.pre_mlp_layernorm)
    return dataclasses.replace(spec, module=PostNormTransformerLayer, submodules=PostNormLayerSubmodules(**fields))


class NormResidualLayer(TransformerLayer):
    """MiniMax-Text-01 / MiniMax-M1's layer (``postnorm``): each sublayer's residual is its input norm's *output*,
    scaled, and the sublayer's output is scaled too:

        n = Norm_a(x);  h = alpha_a * n + beta_a * Attn(n);  m = Norm_m(h);  y = alpha_m * m + beta_m * MLP(m)

    so the residual stream between norms holds normalised vectors (M1: alpha = (2 x 80 layers) ** 0.25 = 3.56, beta
    = 1). Megatron's layer adds the sublayer's output to its un-normalised input; this one keeps each norm's output (a
    forward hook) and hands it, times alpha, to the bias-dropout-add in place of that input, with the output times
    beta (the products and the sum in transformers' order). Everything else of Megatron's layer stays: tensor and
    sequence parallelism (the norm's output is the [s / tp, b, h] slice the residual would be), MoE, context
    parallelism, full-layer recomputation (which reruns the hooks). ``attn_scales`` / ``mlp_scales``: (alpha, beta)."""

    def __init__(self, config, submodules, *args, attn_scales=(1.0, 1.0), mlp_scales=(1.0, 1.0), **kwargs):
        if submodules.input_layernorm is IdentityOp or submodules.pre_mlp_layernorm is IdentityOp:
            raise ValueError("a layer whose residuals are its norms' outputs (MiniMax-01) needs both norms as modules "
                             "of their own (the local spec): Transformer Engine's fuses them into the projections")
        super().__init__(config, submodules, *args, **kwargs)
        if getattr(self, "recompute_input_layernorm", False) or getattr(self, "recompute_pre_mlp_layernorm", False):
            raise ValueError("MiniMax-01 layers cannot recompute their norms alone (--recompute-modules layernorm): "
                             "the residuals are the norms' outputs, which that recomputation frees; recompute whole "
                             "layers instead")
        self._normed = {}
        self.input_layernorm.register_forward_hook(self._keeper("attn"))
        self.pre_mlp_layernorm.register_forward_hook(self._keeper("mlp"))
        self.self_attn_bda = self._scaled(self.self_attn_bda, "attn", *attn_scales)
        self.mlp_bda = self._scaled(self.mlp_bda, "mlp", *mlp_scales)

    def _keeper(self, key: str):
        def hook(module, args, output):
            self._normed[key] = output
        return hook

    def _scaled(self, bda, key: str, alpha: float, beta: float):
        alpha, beta = float(alpha), float(beta)

        def scaled_bda(training, fused):
            inner = bda(training, fused)

            def apply(x_with_bias, residual, prob):
                normed = self._normed.pop(key, None)
                if normed is None:
                    raise RuntimeError(f"the MiniMax-01 layer's {key} residual ran before its norm")
                out, bias = x_with_bias
                if bias is not None:
                    raise ValueError("MiniMax-01 layers' sublayers have no output bias (add_bias_linear=False)")
                return inner((out * beta, None), normed * alpha, prob)

            return apply

        return scaled_bda


def norm_residual_specs(layer_specs: list, scales: list) -> list:
    """Each of ``layer_specs`` (Megatron TransformerLayer specs) as a :class:`NormResidualLayer` with its
    ``scales`` ((alpha, beta) of the attention, (alpha, beta) of the MLP)."""
    out = []
    for spec, (attn, mlp) in zip(layer_specs, scales):
        if spec.module is not TransformerLayer:
            raise TypeError(f"MiniMax-01's residuals need Megatron's TransformerLayer, got {spec.module!r}")
        out.append(dataclasses.replace(spec, module=NormResidualLayer,
                                       params={**(spec.params or {}), "attn_scales": tuple(attn),
                                               "mlp_scales": tuple(mlp)}))
    return out
