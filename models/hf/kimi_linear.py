"""Kimi-Linear: Kimi delta attention layers (``models/kimi_delta.py``) beside multi-head latent
attention without positions, DeepSeek-V3's MoE.

Layers: config.json's ``layer_types`` ("linear_attention": KDA, "kimi_delta" here;
"full_attention": MLA), else ``linear_attn_config``'s 1-based ``kda_layers`` and
``full_attn_layers``, else transformers' default (every 4th from layer 4 attends); the KDA sizes
from ``linear_attn_config`` (``num_heads``, ``head_dim``, ``short_conv_kernel_size``) over the
flat ``linear_*`` fields, as transformers reads them. The latent attention is DeepSeek-V2's
(``models/hf/deepseek_v2.py``) with no rotary embedding on any layer (NoPE: the rotary part of
keys and queries enters unrotated; transformers' ``KimiLinearModel`` has no rotary embedding);
``num_key_value_heads`` must equal the heads. The MoE is DeepSeek-V3's sigmoid router
(``e_score_correction_bias``, ``num_expert_group`` groups, ``moe_renormalize``,
``routed_scaling_factor``) with ``num_shared_experts`` shared experts, on the layers
``mlp_layer_types`` calls "sparse" (else from ``first_k_dense_replace``). On disk (the original
checkpoint's names, which transformers converts): ``block_sparse_moe.experts.E.w1|w3|w2``, KDA's
convolutions ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` and ``A_log`` as [1, 1, heads, 1].
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE
from shardzoo.models.hf import deepseek_v2, llama, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, HFError, Weight, special_tokens
from shardzoo.models.kimi_delta import KIMI, KimiDelta
from shardzoo.models.moe_arch import NO_MOE

HF_LINEAR = "linear_attention"  # transformers' name of a KDA layer
# KimiLinearConfig's fields and transformers' defaults (Kimi-Linear-48B-A3B's), as save_pretrained writes them
SCHEMA = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
              num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32, num_shared_experts=1,
              output_router_logits=False, routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None,
              qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_expert_group=1, topk_group=1,
              num_experts_per_token=8, moe_renormalize=True, hidden_act="silu", model_max_length=1048576,
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, pad_token_id=163839,
              bos_token_id=163584, eos_token_id=163586, pretraining_tp=1, tie_word_embeddings=False,
              attention_bias=False, attention_dropout=0.0, num_experts=256, mlp_layer_types=None, layer_types=None,
              linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4, linear_attn_config=None,
              first_k_dense_replace=1, head_dim=None, qk_head_dim=None)
FEATURES = {"rope", "nope_layers", "rmsnorm", "pre_norms", "gated_mlp", "latent_attention", "moe", "moe_pattern",
            "expert_width", "shared_experts", "routed_scaling", "sigmoid_router", "layer_pattern", "kimi_delta"}
_SIZES = (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
          ("short_conv_kernel_size", "linear_conv_kernel_dim"))


def _layer_types(hf: HFConfig, n: int, linear: dict) -> list[str]:
    """transformers' precedence: layer_types, then linear_attn_config's 1-based lists, then every
    4th layer from layer 4 attending."""
    types = hf.get("layer_types")
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * n
        for i in linear["full_attn_layers"]:
            types[i - 1] = FULL
        for i in linear["kda_layers"]:
            types[i - 1] = HF_LINEAR
    elif types is None:
        types = [FULL if i and i % 4 == 0 else HF_LINEAR for i in range(n)]
    if len(types) != n or any(t not in (FULL, HF_LINEAR) for t in types):
        raise hf.refuse("layer_types", f"Kimi-Linear's {n} layers are each {FULL!r} or {HF_LINEAR!r}")
    return [KIMI if t == HF_LINEAR else FULL for t in types]


def from_hf(hf: HFConfig) -> dict:
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank")
    hf.ignore(*INERT, "head_dim", "qk_head_dim")  # transformers derives both
    n, heads = hf.get("num_hidden_layers"), hf.get("num_attention_heads")
    for key, want, why in (("hidden_act", "silu", "KDA's convolution and the MLPs use hidden_act; shardzoo reads "
                                                  "'silu'"),
                           ("attention_bias", False, "shardzoo's latent attention has no biases"),
                           ("num_key_value_heads", heads, f"latent attention expands keys and values for every "
                                                          f"query head (num_attention_heads={heads})")):
        if hf.get(key) != want:
            raise hf.refuse(key, why)
    linear = hf.get("linear_attn_config") or {}
    # Kimi K3's additions, which transformers' KimiLinear ignores (its numbers would not be the model's)
    for key, value in (("mla_use_output_gate", hf.raw.get("mla_use_output_gate")),
                       ("linear_attn_config.use_full_rank_gate", linear.get("use_full_rank_gate")),
                       ("linear_attn_config.gate_lower_bound", linear.get("gate_lower_bound"))):
        if value:
            raise HFError(f"{hf.where}: {key}={value!r}: Kimi K3's, which neither transformers' nor shardzoo's "
                          "kimi_linear computes")
    kda = KimiDelta(**{field: linear.get(key, hf.get(flat)) for field, (key, flat) in
                       zip(("num_heads", "head_dim", "conv_kernel"), _SIZES, strict=True)})
    mlps = hf.get("mlp_layer_types")
    first = hf.get("first_k_dense_replace")
    mlps = [DENSE if i < first else MOE for i in range(n)] if mlps is None else [
        {"dense": DENSE, "sparse": MOE}.get(m, m) for m in mlps]
    experts, width = hf.get("num_experts"), hf.get("moe_intermediate_size")
    if not experts:
        raise hf.refuse("num_experts", "shardzoo reads Kimi-Linear with routed experts only")
    return special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), num_hidden_layers=n,
        intermediate_size=hf.get("intermediate_size"), num_attention_heads=heads,
        max_position_embeddings=hf.get("model_max_length"), rms_norm_eps=hf.get("rms_norm_eps"),
        initializer_range=hf.get("initializer_range"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        kv_lora_rank=hf.get("kv_lora_rank"), q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=hf.get("qk_nope_head_dim"), qk_rope_head_dim=hf.get("qk_rope_head_dim"),
        v_head_dim=hf.get("v_head_dim"), rope_layers=(False,) * n, layer_types=tuple(_layer_types(hf, n, linear)),
        kimi_delta=kda, mlp_layer_types=tuple(mlps), num_local_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_token"), moe_intermediate_size=width,
        shared_expert_intermediate_size=(hf.get("num_shared_experts") or 0) * width, router_kind="sigmoid_groups",
        n_group=hf.get("num_expert_group") or 1, topk_group=hf.get("topk_group") or 1,
        norm_topk_prob=hf.get("moe_renormalize"), routed_scaling_factor=hf.get("routed_scaling_factor"),
        router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    specs = a.layer_specs()
    kda = a.kimi_delta or KimiDelta()
    linear = [i + 1 for i, s in enumerate(specs) if s.mixer == KIMI]
    kinds = [s.mlp for s in specs]
    return dict(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_attention_heads,
        model_max_length=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps, hidden_act=a.hidden_act,
        **deepseek_v2.latent_flat(a),
        layer_types=[HF_LINEAR if s.mixer == KIMI else FULL for s in specs],
        linear_attn_config=dict(num_heads=kda.num_heads, head_dim=kda.head_dim, short_conv_kernel_size=kda.conv_kernel,
                                kda_layers=linear, full_attn_layers=[i for i in range(1, len(specs) + 1)
                                                                     if i not in linear]),
        mlp_layer_types=["sparse" if kind == MOE else "dense" for kind in kinds],
        first_k_dense_replace=kinds.index(MOE) if MOE in kinds else len(kinds),
        num_experts=m.num_local_experts, num_experts_per_token=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, num_shared_experts=m.shared_expert_intermediate_size // a.expert_size,
        num_expert_group=m.n_group, topk_group=m.topk_group, moe_renormalize=m.norm_topk_prob,
        routed_scaling_factor=m.routed_scaling_factor,
        # transformers' default padding id (163839) is past a smaller vocabulary, which its embedding refuses
        pad_token_id=SCHEMA["pad_token_id"] if a.vocab_size > SCHEMA["pad_token_id"] else None)


# --------------------------------------------------------------------------------- weights
def kda_weights(a) -> list[Weight]:
    """A KDA layer's tensors: projections, the three convolutions, the decay, the gate, the norm."""
    x, h = llama.LAYER + "self_attn.", a.kimi_delta.num_heads
    out = [Weight(("linear_attn", n, "kernel"), x + f"{n}_proj.weight", "linear") for n in "qkvb"]
    out += [Weight(("linear_attn", n, "kernel"), x + f"{n}_proj.weight", "linear") for n in ("f_a", "f_b", "g_a", "g_b")]
    out += [Weight(("linear_attn", f"conv_{n}"), x + f"{n}_conv1d.weight", "depthwise") for n in "qkv"]
    return out + [Weight(("linear_attn", "A_log"), x + "A_log", "vec", hf_shape=(1, 1, h, 1)),
                  Weight(("linear_attn", "dt_bias"), x + "dt_bias", "vec"),
                  Weight(("linear_attn", "norm"), x + "o_norm.weight"),
                  Weight(("linear_attn", "out", "kernel"), x + "o_proj.weight", "linear", n_in=2)]


def layer_weights(a, spec) -> list[Weight]:
    """Latent attention as DeepSeek's (with the layer's norms) or KDA; the MLP under
    ``block_sparse_moe`` (a dense one's gate/up/down_proj, the experts' w1/w3/w2)."""
    if spec.mixer == KIMI:
        out = [Weight(("attn_norm", "scale"), llama.LAYER + "input_layernorm.weight"),
               Weight(("mlp_norm", "scale"), llama.LAYER + "post_attention_layernorm.weight")] + kda_weights(a)
    else:
        out = deepseek_v2.latent_attention_weights(a)
    x = "block_sparse_moe."
    if spec.mlp != MOE:
        return out + llama.mlp_weights(a, x)
    out += mixtral.moe_weights(a, x)
    out += [Weight(("shared_expert", n, "kernel"), llama.LAYER + f"{x}shared_experts.{n}_proj.weight", "linear")
            for n in ("gate", "up", "down")]
    return out + [Weight(("moe", "router_bias"), llama.LAYER + f"{x}gate.e_score_correction_bias")]


# --------------------------------------------------------------------------------- presets
# moonshotai/Kimi-Linear-48B-A3B-Instruct/config.json: 27 layers, MLA on layers 4, 8, ..., 24 and 27
# (1-based), KDA on the others (32 heads of 128); the first dense, then 256 experts top-8 and one shared
_PATTERN = tuple(FULL if i in (4, 8, 12, 16, 20, 24, 27) else KIMI for i in range(1, 28))
BASE = dict(rope_layers=None, router_kind="sigmoid_groups", norm_topk_prob=True, router_aux_loss_coef=0.0,
            router_z_loss_coef=0.0, q_lora_rank=None)
KIMI_LINEAR_48B = BASE | dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=27, num_attention_heads=32,
    max_position_embeddings=1048576, rms_norm_eps=1e-5, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, rope_layers=(False,) * 27, layer_types=_PATTERN,
    kimi_delta=KimiDelta(num_heads=32, head_dim=128, conv_kernel=4), num_local_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024, routed_scaling_factor=2.446,
    mlp_layer_types=(DENSE,) + (MOE,) * 26, bos_token_id=163584, eos_token_id=163586)
# 3 KDA : 1 MLA, a dense first layer, then MoE layers with a shared expert
TINY = BASE | dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    max_position_embeddings=256, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rope_layers=(False,) * 4, layer_types=(KIMI, KIMI, KIMI, FULL), kimi_delta=KimiDelta(4, 16, 4),
    num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    routed_scaling_factor=2.446, mlp_layer_types=(DENSE, MOE, MOE, MOE), bos_token_id=None, eos_token_id=None)
KIMI_LINEAR = Family(
    "kimi_linear", ("kimi_linear",), "KimiLinearForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"kimi-linear-48b-a3b": KIMI_LINEAR_48B, "kimi-linear-tiny": TINY})
