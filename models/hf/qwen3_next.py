"""Qwen3-Next: Gated DeltaNet layers beside output-gated attention layers (``layer_types`` of
"linear_attention" and "full_attention"; older configs give ``full_attention_interval``: every
4th layer attends), sparse MoE MLPs with a gated shared expert.

A linear-attention layer is the shared ``gated_deltanet`` feature (``models/linear_attention.py``):
transformers' ``in_proj_qkvz`` holds q, k, v and z of each key head in turn (the ``groups`` of
the weight map), ``in_proj_ba`` b and a likewise, ``conv1d`` the taps of q, k and v. An attention
layer is GQA with a zero-centred RMSNorm ((1 + w) scaling) of each query and key head, rotary
embeddings on ``partial_rotary_factor`` of each head (0.25 when the config gives none), and its
output times the sigmoid of a gate that ``q_proj`` projects beside each query head. Every norm of
the model but the Gated DeltaNet's is zero-centred (the ``rmsnorm_plus_one`` feature). The MoE is
Qwen2-MoE's: a softmax router over ``num_experts`` (top-k renormalised when ``norm_topk_prob``)
and a shared expert scaled by ``sigmoid(shared_expert_gate(x))``; layer i is MoE unless it is in
``mlp_only_layers`` and where ``(i + 1) % decoder_sparse_step`` is 0. HF drops no token and has
no router z-loss (the family's ``execution``, as Mixtral's).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, LINEAR, MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    layer_types,
    rope,
    rope_to_hf,
    sizes,
    sizes_to_hf,
)
from shardzoo.models.moe_arch import NO_MOE

# Qwen3NextConfig's fields and transformers' defaults (the defaults are Qwen3-Next-80B-A3B's)
SCHEMA = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
              num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
              initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False,
              rope_parameters=None, attention_bias=False, attention_dropout=0.0, head_dim=256,
              linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
              linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
              shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
              output_router_logits=False, router_aux_loss_coef=0.001, mlp_only_layers=None, layer_types=None,
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
FEATURES = llama.ROTARY | {"rmsnorm_plus_one", "partial_rotary", "qk_norm_head", "attention_bias",
                           "attention_out_bias", "layer_pattern", "moe", "moe_pattern", "expert_width",
                           "shared_experts", "shared_expert_gate", "gated_deltanet", "attention_output_gate"}
_LINEAR = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")


def _partial_rotary(hf: HFConfig) -> float:
    """transformers' default 0.25 where neither rope_parameters nor the top level gives one."""
    params = hf.raw.get("rope_parameters") or {}
    given = params.get("partial_rotary_factor", hf.raw.get("partial_rotary_factor"))
    return 0.25 if given is None else float(given)


def hybrid_fields(hf: HFConfig) -> dict:
    """Everything but the MLPs: sizes, rotary, the Gated DeltaNet and output-gated attention
    layers (Qwen3.5 reads them alike)."""
    hf.ignore(*INERT)
    out = sizes(hf) | rope(hf, theta=10000.0)
    out["partial_rotary_factor"] = _partial_rotary(hf)
    if out["hidden_act"] != "silu":
        raise hf.refuse("hidden_act", "the Gated DeltaNet's convolution is followed by SiLU; shardzoo reads 'silu'")
    n = out["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # transformers derives them from full_attention_interval (default 4)
        every = hf.raw.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % every else FULL for i in range(n)]
    if any(t not in (FULL, LINEAR) for t in types):
        raise hf.refuse("layer_types", f"Qwen3-Next's layers are {FULL!r} or {LINEAR!r}")
    bias = hf.get("attention_bias")
    return out | {name: hf.get(name) for name in _LINEAR} | dict(
        norm_type="rmsnorm_plus_one", qk_norm="head", attention_bias=bias, attention_out_bias=bias,
        attn_output_gate=True, layer_types=tuple(types))


def from_hf(hf: HFConfig) -> dict:
    out = hybrid_fields(hf)
    n = out["num_hidden_layers"]
    experts, step = hf.get("num_experts"), hf.get("decoder_sparse_step")
    dense = set(hf.get("mlp_only_layers") or ())
    if experts and not hf.get("shared_expert_intermediate_size"):
        raise hf.refuse("shared_expert_intermediate_size", "a Qwen3-Next MoE layer without a shared expert still "
                                                           "has its gate; shardzoo reads only shared experts > 0")
    return out | dict(
        num_local_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok"),
        moe_intermediate_size=hf.get("moe_intermediate_size"), norm_topk_prob=hf.get("norm_topk_prob"),
        router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size"), shared_expert_gate=True,
        mlp_layer_types=tuple(MOE if experts and (i + 1) % step == 0 and i not in dense else DENSE
                              for i in range(n)))


def hybrid_to_hf(a) -> dict:
    """``hybrid_fields``' keys of ``a``."""
    flat = a.linear_attention.flat() if a.linear_attention else SCHEMA
    linear = {name: flat[name] for name in _LINEAR}
    return sizes_to_hf(a) | rope_to_hf(a) | linear | dict(
        partial_rotary_factor=a.partial_rotary_factor, attention_bias=a.attention_bias, layer_types=layer_types(a))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kinds = a.layer_specs()
    return hybrid_to_hf(a) | dict(
        num_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, shared_expert_intermediate_size=m.shared_expert_intermediate_size,
        decoder_sparse_step=1, mlp_only_layers=[i for i, s in enumerate(kinds) if s.mlp == DENSE],
        norm_topk_prob=m.norm_topk_prob, router_aux_loss_coef=m.router_aux_loss_coef)


# --------------------------------------------------------------------------------- weights
def linear_attention_weights(a) -> list[Weight]:
    """A Gated DeltaNet's tensors: in_proj_qkvz and in_proj_ba per key head in turn, conv1d's
    channels q | k | v."""
    x = llama.LAYER + "linear_attn."
    la = a.linear_attention
    nk, nv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    r = nv // nk
    qkvz = (dk, dk, r * dv, r * dv)
    out = [Weight(("linear_attn", n, "kernel"), x + "in_proj_qkvz.weight", "linear", part=(j, 4), widths=qkvz,
                  groups=nk) for j, n in enumerate("qkvz")]
    out += [Weight(("linear_attn", n, "kernel"), x + "in_proj_ba.weight", "linear", part=(j, 2), groups=nk)
            for j, n in enumerate("ba")]
    out += [Weight(("linear_attn", f"conv_{n}"), x + "conv1d.weight", "depthwise", part=(j, 3),
                   widths=(nk * dk, nk * dk, nv * dv)) for j, n in enumerate("qkv")]
    return out + [Weight(("linear_attn", "A_log"), x + "A_log"), Weight(("linear_attn", "dt_bias"), x + "dt_bias"),
                  Weight(("linear_attn", "norm"), x + "norm.weight"),
                  Weight(("linear_attn", "out", "kernel"), x + "out_proj.weight", "linear", n_in=2)]


def attention_weights(a) -> list[Weight]:
    """The output-gated attention: q_proj holds each head's query, then its gate."""
    s, nh = llama.LAYER + "self_attn.", a.num_attention_heads
    out = [Weight(("attn", n, "kernel"), s + "q_proj.weight", "linear", part=(j, 2), groups=nh)
           for j, n in enumerate(("q", "gate"))]
    out += [Weight(("attn", n, "kernel"), s + f"{n}_proj.weight", "linear") for n in "kv"]
    out += [Weight(("attn", "o", "kernel"), s + "o_proj.weight", "linear", n_in=2)]
    out += [Weight(("attn", f"{n}_norm", "scale"), s + f"{n}_norm.weight", "vec") for n in "qk"]
    if a.attention_bias:
        out += [Weight(("attn", n, "bias"), s + "q_proj.bias", "vec", part=(j, 2), groups=nh)
                for j, n in enumerate(("q", "gate"))]
        out += [Weight(("attn", n, "bias"), s + f"{n}_proj.bias", "vec") for n in "kvo"]
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
           Weight(("mlp_norm", "scale"), h + "post_attention_layernorm.weight")]
    out += linear_attention_weights(a) if spec.mixer == LINEAR else attention_weights(a)
    return out + (moe_weights(a) if spec.mlp == MOE else llama.mlp_weights(a))


def moe_weights(a) -> list[Weight]:
    """The MoE MLP: router, experts, the shared expert and its gate."""
    x = llama.LAYER + "mlp."
    shared = [Weight(("shared_expert", n, "kernel"), x + f"shared_expert.{n}_proj.weight", "linear")
              for n in ("gate", "up", "down")]
    shared.append(Weight(("shared_expert_gate", "kernel"), x + "shared_expert_gate.weight", "linear"))
    return mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj")) + shared


# --------------------------------------------------------------------------------- presets
# Qwen/Qwen3-Next-80B-A3B-Instruct/config.json (Qwen3NextConfig's defaults but intermediate_size,
# unused: every layer is MoE): 48 layers, 3 Gated DeltaNet to 1 attention, 512 experts top-10
_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4)
BASE = dict(norm_type="rmsnorm_plus_one", qk_norm="head", attn_output_gate=True, partial_rotary_factor=0.25,
            shared_expert_gate=True, norm_topk_prob=True, router_aux_loss_coef=0.001, router_z_loss_coef=0.0)
QWEN3_NEXT_80B = BASE | _GDN | dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=10000000.0,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 12, num_local_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, bos_token_id=151643, eos_token_id=151645)
QWEN3_NEXT = Family(
    "qwen3_next", ("qwen3_next",), "Qwen3NextForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={
        "qwen3-next-80b-a3b": QWEN3_NEXT_80B,
        # 3 linear : 1 attention, a dense first layer, then MoE layers with their shared expert
        "qwen3-next-tiny": BASE | llama.TINY | dict(
            num_hidden_layers=4, head_dim=16, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_layer_types=(DENSE, MOE, MOE, MOE)),
    })
