"""Nemotron-H (NVIDIA): each layer one RMSNorm and one of a Mamba2 mixer, attention, an MLP or
a MoE MLP (``layers_block_type``: "linear_attention", "full_attention", "mlp", "moe"; older
configs spell it ``hybrid_override_pattern``, a string of M, *, -, E). As layer patterns: a
mamba layer is ``layer_types`` "mamba" with ``mlp_layer_types`` "none", an attention layer
"full_attention" with "none", an MLP layer "none" with "dense", a MoE layer "none" with "moe".
Attention is GQA without positions (no rotary: ``rope_layers`` all false) and without biases;
the MLP is plain (up, relu2, down). The mixer is the shared ``mamba2`` feature (``models/ssm.py``).

A MoE layer (Nemotron 3 Nano's) is DeepSeek-V3's router (``sigmoid_groups``: sigmoid scores,
``e_score_correction_bias`` for the choice, ``n_group``/``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``) over ``n_routed_experts`` experts WITHOUT a gate (``expert_type``
"plain": up_proj, relu2, down_proj, ``moe_intermediate_size`` wide), plus one shared plain MLP
``moe_shared_expert_intermediate_size`` wide (transformers builds it whatever
``n_shared_experts`` says). No load-balancing loss and no dropped token (Mixtral's
``execution``). ``moe_latent_size`` (experts in a narrower latent) is refused.
"""

from __future__ import annotations

import math

from shardzoo.models.arch import DENSE, FULL, MAMBA, MOE, NONE
from shardzoo.models.hf import llama, mamba2, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, HFError, Weight, special_tokens
from shardzoo.models.moe_arch import NO_MOE

# NemotronHConfig's fields and transformers' defaults
SCHEMA = dict(vocab_size=131072, hidden_size=4096, layers_block_type=None, tie_word_embeddings=False, use_cache=True,
              num_logits_to_keep=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, attention_bias=False,
              attention_dropout=0.0, sliding_window=None, intermediate_size=21504, mlp_hidden_act="relu2",
              mlp_bias=False, use_mamba_kernels=True, ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64,
              mamba_hidden_act="silu", n_groups=8, conv_kernel=4, expand=2, time_step_min=0.001, time_step_max=0.1,
              time_step_limit=[0.0, math.inf], time_step_floor=1e-4, use_conv_bias=True, chunk_size=128,
              mamba_proj_bias=False, mamba_ssm_cache_dtype="float32", n_routed_experts=8, output_router_logits=False,
              n_shared_experts=1, moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688,
              moe_latent_size=None, moe_shared_expert_overlap=True, num_experts_per_tok=2, routed_scaling_factor=1.0,
              n_group=1, topk_group=1, norm_topk_prob=True, num_nextn_predict_layers=0, mtp_layers_block_type=None,
              use_bias=False, initializer_range=0.02, layer_norm_epsilon=1e-5, residual_in_fp32=False,
              hidden_dropout=0.0, rescale_prenorm_residual=True)
FEATURES = frozenset({"rope", "rmsnorm", "pre_norms", "plain_mlp", "mlp_bias", "layer_pattern", "nope_layers",
                      "mlp_free_layers", "mamba2", "mamba_proj_bias", "time_step_limit", "moe", "moe_pattern",
                      "expert_width", "shared_experts", "routed_scaling", "sigmoid_router", "plain_experts"})
NAMES = dict(heads="mamba_num_heads", head_dim="mamba_head_dim", groups="n_groups", state="ssm_state_size",
             conv="conv_kernel", chunk="chunk_size", conv_bias="use_conv_bias", proj_bias="use_bias", expand=None,
             act="mamba_hidden_act", limit="time_step_limit")
# the older keys NemotronHConfig still reads, and the field each sets
LEGACY = dict(mamba_n_groups="n_groups", mamba_d_conv="conv_kernel", mamba_dt_limit="time_step_limit",
              mamba_conv_bias="use_conv_bias", mamba_chunk_size="chunk_size", mamba_expand="expand",
              mamba_dt_min="time_step_min", mamba_dt_max="time_step_max", mamba_dt_init_floor="time_step_floor")
KINDS = {"linear_attention": (MAMBA, NONE), "full_attention": (FULL, NONE), "mlp": (NONE, DENSE),
         "moe": (NONE, MOE)}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# settings of the initialisation, the kernels, the cache's dtype, MTP settings of a model without
# MTP layers (num_nextn_predict_layers > 0 is refused), n_shared_experts (transformers builds one
# shared MLP whatever it says) and the overlap of the shared expert's compute
_UNUSED = ("time_step_min", "time_step_max", "time_step_floor", "rescale_prenorm_residual", "use_mamba_kernels",
           "mamba_ssm_cache_dtype", "residual_in_fp32", "expand", "num_logits_to_keep", "mamba_proj_bias",
           "attention_bias", "mtp_layers_block_type", "n_shared_experts", "moe_shared_expert_overlap")
# the MoE settings, read when a layer is "moe" (else meaningless)
_MOE = ("n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
        "num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")


def block_types(hf: HFConfig) -> list[str]:
    """``layers_block_type``, or the older ``hybrid_override_pattern`` spelled out."""
    types = hf.get("layers_block_type")
    if types is None and "hybrid_override_pattern" in hf.raw:
        pattern = hf.raw["hybrid_override_pattern"]
        if not isinstance(pattern, str) or any(c not in PATTERN for c in pattern):
            raise hf.refuse("hybrid_override_pattern", f"each letter must be one of {', '.join(PATTERN)}")
        types = [PATTERN[c] for c in pattern]
    if types is None:  # transformers' default
        types = ["linear_attention", "moe", "full_attention", "mlp"]
    key = "layers_block_type" if "layers_block_type" in hf.raw else "hybrid_override_pattern"
    if not types or any(t not in KINDS for t in types):
        raise hf.refuse(key, f"each layer must be one of {', '.join(KINDS)}")
    return types


def moe_fields(hf: HFConfig, types: list[str]) -> dict:
    """The MoE layers' router, plain experts and shared expert (none without a "moe" layer)."""
    if "moe" not in types:
        hf.ignore(*_MOE)
        return {}
    if hf.get("moe_latent_size") is not None:
        raise hf.refuse("moe_latent_size", "shardzoo's nemotron_h runs experts at hidden_size (null) only")
    return dict(num_local_experts=hf.get("n_routed_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
                moe_intermediate_size=hf.get("moe_intermediate_size"), expert_type="plain",
                shared_expert_intermediate_size=hf.get("moe_shared_expert_intermediate_size"),
                router_kind="sigmoid_groups", n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                norm_topk_prob=hf.get("norm_topk_prob"), routed_scaling_factor=hf.get("routed_scaling_factor"),
                router_aux_loss_coef=0.0)


def from_hf(hf: HFConfig) -> dict:
    for old, new in LEGACY.items():
        if old in hf.raw and new not in hf.raw:
            hf.raw[new] = hf.raw[old]
    hf.ignore(*INERT, *_UNUSED, "num_hidden_layers")  # num_hidden_layers: the pattern's length
    types = block_types(hf)
    n, heads = len(types), hf.get("num_attention_heads")
    return special_tokens(hf) | mamba2.mamba_fields(hf, NAMES) | moe_fields(hf, types) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), num_hidden_layers=n,
        intermediate_size=hf.get("intermediate_size"), num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim"),
        max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=hf.get("layer_norm_epsilon"),
        initializer_range=hf.get("initializer_range"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        hidden_act=hf.get("mlp_hidden_act"), mlp_type="plain", mlp_bias=hf.get("mlp_bias"),
        layer_types=tuple(KINDS[t][0] for t in types), mlp_layer_types=tuple(KINDS[t][1] for t in types),
        rope_layers=(False,) * n)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kinds = {v: k for k, v in KINDS.items()}
    specs = a.layer_specs()
    types = [kinds[(s.mixer if s.mixer != "attention" else FULL, s.mlp)] for s in specs]
    moe = {}
    if m.num_local_experts and (m.expert_type, m.router_kind) != ("plain", "sigmoid_groups"):
        raise HFError(f"Nemotron-H's MoE layers have plain experts and the sigmoid_groups router; this model has "
                      f"expert_type={m.expert_type!r}, router_kind={m.router_kind!r}")
    if m.num_local_experts:
        moe = dict(n_routed_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
                   moe_intermediate_size=a.expert_size,
                   moe_shared_expert_intermediate_size=m.shared_expert_intermediate_size, n_group=m.n_group,
                   topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob,
                   routed_scaling_factor=m.routed_scaling_factor)
    return mamba2.mamba_to_hf(a, NAMES) | moe | dict(
        hidden_size=a.hidden_size, layers_block_type=types, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.kv_heads, head_dim=a.head_size, max_position_embeddings=a.max_position_embeddings,
        intermediate_size=a.intermediate_size, layer_norm_epsilon=a.rms_norm_eps, mlp_hidden_act=a.hidden_act,
        mlp_bias=a.mlp_bias)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "backbone.embeddings.weight"),
           Weight(("final_norm", "scale"), "backbone.norm_f.weight")]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = "backbone.layers.{i}."
    if spec.mixer == NONE:  # an MLP layer, or a MoE layer: router, experts and the shared MLP
        out = [Weight(("mlp_norm", "scale"), h + "norm.weight")]
        mlp, x = ("mlp", h + "mixer.") if spec.mlp == DENSE else ("shared_expert", h + "mixer.shared_experts.")
        for n in ("up", "down"):
            out.append(Weight((mlp, n, "kernel"), x + f"{n}_proj.weight", "linear"))
            if a.mlp_bias:
                out.append(Weight((mlp, n, "bias"), x + f"{n}_proj.bias", "vec"))
        if spec.mlp == MOE:
            e = a.moe.num_local_experts
            out += [Weight(("moe", "router", "kernel"), h + "mixer.gate.weight", "linear"),
                    Weight(("moe", "router_bias"), h + "mixer.gate.e_score_correction_bias"),
                    Weight(("moe", "wi_up"), h + "mixer.experts.{e}.up_proj.weight", "linear", experts=e),
                    Weight(("moe", "wo"), h + "mixer.experts.{e}.down_proj.weight", "linear", experts=e)]
        return out
    out = [Weight(("attn_norm", "scale"), h + "norm.weight")]
    if spec.mixer == MAMBA:
        return out + mamba2.mamba_weights(a, h + "mixer.")
    return out + [Weight(("attn", n, "kernel"), h + f"mixer.{n}_proj.weight", "linear") for n in "qkv"] + [
        Weight(("attn", "o", "kernel"), h + "mixer.o_proj.weight", "linear", n_in=2)]


def _pattern(pattern: str) -> dict:
    types = [KINDS[PATTERN[c]] for c in pattern]
    return dict(num_hidden_layers=len(types), layer_types=tuple(t for t, _ in types),
                mlp_layer_types=tuple(m for _, m in types), rope_layers=(False,) * len(types))


# --------------------------------------------------------------------------------- presets
NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_3_NANO = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_H = Family(
    "nemotron_h", ("nemotron_h",), "NemotronHForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights, execution=mixtral.HF_MOE,
    presets={
        # nvidia/Nemotron-H-8B-Base-8K/config.json: 24 mamba, 4 attention and 24 MLP layers
        "nemotron-h-8b": _pattern(NEMOTRON_H_8B) | dict(
            vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, mlp_type="plain",
            hidden_act="relu2", bos_token_id=1, eos_token_id=2, mamba_num_heads=128, mamba_head_dim=64,
            mamba_n_groups=8, ssm_state_size=128, mamba_conv_kernel=4, mamba_chunk_size=128),
        # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B's config.json: 23 mamba, 23 MoE and 6 attention layers;
        # 128 plain relu2 experts (top-6, one group) 1856 wide and a shared one 3712 wide
        "nemotron-3-nano-30b-a3b": _pattern(NEMOTRON_3_NANO) | dict(
            vocab_size=131072, hidden_size=2688, intermediate_size=1856, num_attention_heads=32,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-5,
            mlp_type="plain", hidden_act="relu2", bos_token_id=1, eos_token_id=2, mamba_num_heads=64,
            mamba_head_dim=64, mamba_n_groups=8, ssm_state_size=128, mamba_conv_kernel=4, mamba_chunk_size=128,
            num_local_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
            shared_expert_intermediate_size=3712, expert_type="plain", router_kind="sigmoid_groups",
            norm_topk_prob=True, routed_scaling_factor=2.5, router_aux_loss_coef=0.0, router_z_loss_coef=0.0),
        "nemotron-h-tiny": llama.TINY | _pattern("M-M*-") | dict(
            mlp_type="plain", hidden_act="relu2", rms_norm_eps=1e-5, mamba_num_heads=8, mamba_head_dim=16,
            mamba_n_groups=2, ssm_state_size=16, mamba_chunk_size=64),
    })
