"""Ernie 4.5 (Baidu): the dense ``ernie4_5`` and ``ernie4_5_moe``. The dense one: Llama's layout with rotary embeddings turning
interleaved pairs of features (2i, 2i+1) in float32 (``rope_interleaved``, as Cohere), one flag
``use_bias`` for every projection's bias (q/k/v, o, and the MLP's gate, up and down; not the
output head), tied embeddings by default.

transformers quirks: ``head_dim`` defaults to 128 (not hidden_size / heads) when config.json
lacks it, and ``num_key_value_heads`` to 2; an explicit null means hidden_size / heads and
as many kv heads as heads. The rotary base defaults to 500000.

Ernie 4.5 MoE: the same attention; the MoE layers (from ``moe_layer_start_index`` to
``moe_layer_end_index``, every ``moe_layer_interval``-th; the others dense MLPs of
``intermediate_size``) route by a float32 softmax whose top-k is chosen with a correction bias
added (``moe_statics.e_score_correction_bias``, a parameter no gradient trains) and weighted by
the unbiased probabilities renormalised (``biased_softmax_router``), plus shared experts: one
gated MLP ``moe_num_shared_experts`` x ``moe_intermediate_size`` wide. ``use_bias`` also gives
the output head a bias (tied weight, own bias). transformers drops no token and has no z-loss
(the family's ``execution``, as Mixtral's). Not read: the multi-token-prediction layer
(``num_nextn_predict_layers``; transformers' forward does not use it either).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, rope, sizes
from shardzoo.models.moe_arch import NO_MOE

# Ernie4_5Config's fields and defaults (transformers 5)
SCHEMA = dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
              num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=131072,
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=True, rope_parameters=None, use_bias=False, head_dim=128)
THETA = 500000.0
FEATURES = llama.ROTARY | {"rope_interleaved", "attention_bias", "attention_out_bias", "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    out = sizes(hf) | rope(hf, theta=THETA)
    out.pop("partial_rotary_factor")  # whole heads rotate
    out.update(num_key_value_heads=hf.get("num_key_value_heads") or out["num_attention_heads"],
               head_dim=hf.get("head_dim"))  # absent: 128; null: hidden_size / heads
    bias = hf.get("use_bias")
    return out | dict(rope_interleaved=True, attention_bias=bias, attention_out_bias=bias, mlp_bias=bias)


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(use_bias=a.attention_bias)


# Ernie4_5_MoeConfig's fields and defaults (transformers 5); no head_dim field (hidden_size /
# heads unless config.json has one)
MOE_SCHEMA = ({k: v for k, v in SCHEMA.items() if k != "head_dim"}
              | dict(hidden_size=2560, intermediate_size=12288, num_hidden_layers=28, num_attention_heads=20,
                     num_key_value_heads=4, moe_intermediate_size=1536, moe_k=6, moe_num_experts=64,
                     moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1,
                     moe_layer_interval=1, moe_norm_min=1e-12, output_router_logits=False,
                     router_aux_loss_coef=0.001, num_nextn_predict_layers=None))
MOE_FEATURES = FEATURES | {"moe", "moe_pattern", "expert_width", "shared_experts", "biased_softmax_router",
                           "lm_head_bias"}


def _moe_layers(n: int, start: int, end: int | None, interval: int) -> tuple[str, ...]:
    end = n - 1 if end in (-1, None) else end  # -1 (and null, which transformers cannot build): the last
    return tuple(MOE if (i + 1) % interval == 0 and start <= i <= end else DENSE for i in range(n))


def moe_from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "num_nextn_predict_layers")
    out = sizes(hf) | rope(hf, theta=THETA)
    out.pop("partial_rotary_factor")
    out["num_key_value_heads"] = hf.get("num_key_value_heads") or out["num_attention_heads"]
    if hf.get("moe_norm_min") > 1e-6:  # the floor of the k weights' sum: shardzoo divides by the sum
        raise hf.refuse("moe_norm_min", "shardzoo renormalises the chosen experts' weights by their sum; "
                                        "only a floor below 1e-6 (transformers' 1e-12) computes the same")
    experts, shared = hf.get("moe_num_experts"), hf.get("moe_num_shared_experts") or 0
    if not experts:
        raise hf.refuse("moe_num_experts", "an Ernie 4.5 MoE model needs experts (use ernie4_5 for a dense one)")
    bias = hf.get("use_bias")
    kinds = _moe_layers(out["num_hidden_layers"], hf.get("moe_layer_start_index"), hf.get("moe_layer_end_index"),
                        hf.get("moe_layer_interval"))
    return out | dict(
        rope_interleaved=True, attention_bias=bias, attention_out_bias=bias, mlp_bias=bias, lm_head_bias=bias,
        num_local_experts=experts, num_experts_per_tok=hf.get("moe_k"),
        moe_intermediate_size=hf.get("moe_intermediate_size"), mlp_layer_types=kinds,
        shared_expert_intermediate_size=shared * hf.get("moe_intermediate_size"), norm_topk_prob=True,
        router_kind="softmax_bias", router_aux_loss_coef=hf.get("router_aux_loss_coef"))


def moe_to_hf(a) -> dict:
    m = a.moe or NO_MOE
    kinds = tuple(s.mlp for s in a.layer_specs())
    moe = [i for i, k in enumerate(kinds) if k == MOE] or [0]
    start, end, n = moe[0], moe[-1], a.num_hidden_layers
    interval = next((k for k in range(1, n + 1) if _moe_layers(n, start, end, k) == kinds), 1)
    return llama.rotary_to_hf(a) | dict(
        use_bias=a.attention_bias, moe_num_experts=m.num_local_experts, moe_k=m.num_experts_per_tok,
        moe_intermediate_size=a.expert_size, moe_num_shared_experts=m.shared_expert_intermediate_size // a.expert_size,
        moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval,
        router_aux_loss_coef=m.router_aux_loss_coef)


def moe_global_weights(a) -> list[Weight]:
    out = llama.global_weights(a)
    if a.lm_head_bias:  # a tied head has its own bias (``lm_head_bias``)
        out.append(Weight(("lm_head_bias",) if a.tie_word_embeddings else ("lm_head", "bias"), "lm_head.bias", "vec"))
    return out


def moe_layer_weights(a, spec) -> list[Weight]:
    """A dense layer as Ernie 4.5's; a MoE layer's router ``mlp.gate``, correction bias
    ``mlp.moe_statics.e_score_correction_bias`` ([1, expert]), experts ``mlp.experts.E.*``
    and ``mlp.shared_experts.*``."""
    if spec.mlp != MOE:
        return llama.layer_weights(a, spec)
    x = llama.LAYER + "mlp."
    # [1, expert] in HF: a "linear" of one output reads it as [expert]
    out = [Weight(("moe", "router_bias"), x + "moe_statics.e_score_correction_bias", "linear")]
    if a.moe.shared_expert_intermediate_size:
        for n in ("gate", "up", "down"):
            out.append(Weight(("shared_expert", n, "kernel"), x + f"shared_experts.{n}_proj.weight", "linear"))
            if a.mlp_bias:
                out.append(Weight(("shared_expert", n, "bias"), x + f"shared_experts.{n}_proj.bias", "vec"))
    return (llama.attention_weights(a) + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
            + out)


BASE = dict(rope_interleaved=True, rms_norm_eps=1e-5, rope_theta=THETA, tie_word_embeddings=True)
# baidu/ERNIE-4.5-0.3B-PT/config.json (Ernie4_5Config's defaults)
ERNIE_03B = BASE | dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
                        num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                        bos_token_id=1, eos_token_id=2)
ERNIE4_5 = Family(
    "ernie4_5", ("ernie4_5",), "Ernie4_5ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={"ernie-4.5-0.3b": ERNIE_03B,
             "ernie4.5-tiny": BASE | llama.TINY | dict(attention_bias=True, attention_out_bias=True, mlp_bias=True)})
MOE_BASE = BASE | dict(router_kind="softmax_bias", norm_topk_prob=True, router_aux_loss_coef=0.001,
                       router_z_loss_coef=0.0)
ERNIE4_5_MOE = Family(
    "ernie4_5_moe", ("ernie4_5_moe",), "Ernie4_5_MoeForCausalLM", MOE_SCHEMA, MOE_FEATURES, moe_from_hf, moe_to_hf,
    moe_global_weights, moe_layer_weights, execution=mixtral.HF_MOE,
    presets={
        # baidu/ERNIE-4.5-21B-A3B-PT/config.json (Ernie4_5_MoeConfig's defaults): 64 experts top-6 and
        # 2 shared in layers 1-27, layer 0 dense
        "ernie-4.5-21b-a3b": MOE_BASE | dict(
            vocab_size=103424, hidden_size=2560, intermediate_size=12288, num_hidden_layers=28,
            num_attention_heads=20, num_key_value_heads=4, max_position_embeddings=131072, num_local_experts=64,
            num_experts_per_tok=6, moe_intermediate_size=1536, shared_expert_intermediate_size=2 * 1536,
            mlp_layer_types=("dense",) + ("moe",) * 27, bos_token_id=1, eos_token_id=2),
        # a dense layer 0, then MoE layers of 4 experts (top 2) with one shared expert
        "ernie4.5-moe-tiny": MOE_BASE | llama.TINY | dict(
            num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            mlp_layer_types=("dense", "moe")),
    })
