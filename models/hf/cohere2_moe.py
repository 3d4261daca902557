"""Cohere 2 MoE: Cohere 2's parallel layer (models/hf/cohere2.py: attention and MLP side by side
from one norm, rotary embeddings on interleaved pairs on the sliding layers, logits times
``logit_scale``) with a MoE where ``mlp_layer_types`` says "sparse": the top-k logits' softmax
(Mixtral's renormalised top-k) over ``num_experts`` experts ``intermediate_size`` wide, and
``num_shared_experts`` shared ones as one MLP added to them. A "dense" layer's MLP is
``prefix_dense_intermediate_size`` wide and rotates on its full layers too when
``prefix_dense_sliding_window_pattern`` is 1. The norms are RMSNorms when ``rms_norm_eps`` is
set, else LayerNorms without bias. Refused: ``expert_selection_fn`` "sigmoid" (no correction
bias to share shardzoo's sigmoid router) and shared experts "average"d with the routed ones.
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE, SLIDING
from shardzoo.models.hf import cohere, cohere2, glm4_moe_lite, llama, mixtral
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

# Cohere2MoeConfig's fields and defaults (transformers 5.25)
SCHEMA = cohere2.SCHEMA | dict(
    num_key_value_heads=64, head_dim=128, num_experts_per_tok=2, num_experts=8, output_router_logits=False,
    num_shared_experts=0, shared_expert_combination_strategy="average", expert_selection_fn="softmax",
    mlp_layer_types=None, prefix_dense_sliding_window_pattern=1, norm_topk_prob=True,
    prefix_dense_intermediate_size=None, rms_norm_eps=None)
FEATURES = cohere2.FEATURES | {"rmsnorm", "moe", "moe_pattern", "expert_width", "shared_experts"}


def _types(hf: HFConfig, first: int) -> tuple[str, ...]:
    """``layer_types``, else as transformers derives them: the first ``first`` (dense) layers by
    ``prefix_dense_sliding_window_pattern``, the rest by ``sliding_window_pattern``."""
    prefix, every = hf.get("prefix_dense_sliding_window_pattern"), hf.get("sliding_window_pattern")
    types = hf.get("layer_types")
    if types is None:
        n = hf.get("num_hidden_layers")
        types = [SLIDING if (i + 1) % prefix else FULL for i in range(first)]
        types += [SLIDING if (i + 1) % every else FULL for i in range(n - first)]
    return tuple(types)


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "norm_topk_prob")  # the softmax of the top-k logits: always renormalised
    if hf.get("expert_selection_fn") != "softmax":
        raise hf.refuse("expert_selection_fn", "shardzoo's cohere2_moe routes by the softmax of the top-k logits")
    shared, width = hf.get("num_shared_experts"), hf.get("intermediate_size")
    if shared and hf.get("shared_expert_combination_strategy") != "sum":
        raise hf.refuse("shared_expert_combination_strategy", "shardzoo adds the shared experts to the routed ones "
                                                              "('sum'); it does not average them")
    hf.ignore("shared_expert_combination_strategy")
    if hf.get("sliding_window") is None:
        raise hf.refuse("sliding_window", "transformers' Cohere 2 MoE needs a window")
    kinds = glm4_moe_lite.mlp_kinds(hf, hf.raw.get("first_k_dense_replace", 0))
    types = _types(hf, hf.raw.get("first_k_dense_replace", 0))
    force = hf.get("prefix_dense_sliding_window_pattern") == 1  # dense layers rotate whatever their kind
    eps = hf.get("rms_norm_eps")
    out = sizes(hf, "layer_norm_eps") | rope(hf)
    out.pop("partial_rotary_factor")
    bias = hf.get("attention_bias")
    return out | dict(
        norm_type="rmsnorm" if eps is not None else "layernorm_no_bias", rms_norm_eps=eps or out["rms_norm_eps"],
        parallel_residual=True, rope_interleaved=True, attention_bias=bias, attention_out_bias=bias,
        logit_scale=hf.get("logit_scale"), sliding_window=hf.get("sliding_window"), layer_types=types,
        rope_layers=tuple(t == SLIDING or (k == DENSE and force) for t, k in zip(types, kinds, strict=True)),
        intermediate_size=hf.get("prefix_dense_intermediate_size") or width, moe_intermediate_size=width,
        num_local_experts=hf.get("num_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
        shared_expert_intermediate_size=shared * width, mlp_layer_types=kinds, norm_topk_prob=True,
        router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    """Cohere 2's and the MoE's; no pad id unless the imported config.json had one (the architecture records none,
    and transformers' default, 0, is a token of the vocabulary)."""
    m = a.moe or NO_MOE
    specs, rms = a.layer_specs(), a.norm_type == "rmsnorm"
    dense_full = [s.rope != "none" for s in specs if s.mlp == DENSE and s.window is None]
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(
        layer_norm_eps=SCHEMA["layer_norm_eps"] if rms else a.rms_norm_eps, rms_norm_eps=a.rms_norm_eps if rms else None,
        logit_scale=a.logit_scale, attention_bias=a.attention_bias, sliding_window=a.sliding_window,
        layer_types=layer_types(a), mlp_layer_types=glm4_moe_lite.mlp_kinds_to_hf(a),
        prefix_dense_sliding_window_pattern=1 if all(dense_full) else 2, intermediate_size=a.expert_size,
        prefix_dense_intermediate_size=a.intermediate_size, num_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, num_shared_experts=m.shared_expert_intermediate_size // a.expert_size,
        shared_expert_combination_strategy="sum", pad_token_id=None)
    out.pop("partial_rotary_factor", None)
    return out


def layer_weights(a, spec) -> list[Weight]:
    """Cohere's; a MoE layer's ``mlp`` its router, experts and ``shared_experts``."""
    m = a.moe or NO_MOE
    out = cohere.layer_weights(a, spec)
    if spec.mlp != MOE:
        return out
    x = llama.LAYER + "mlp.shared_experts."
    out = [w for w in out if w.path[0] != "mlp"] + mixtral.moe_weights(a, "mlp.", ("gate_proj", "up_proj", "down_proj"))
    if m.shared_expert_intermediate_size:
        out += [Weight(("shared_expert", n, "kernel"), x + f"{n}_proj.weight", "linear") for n in ("gate", "up", "down")]
    return out


_TINY = cohere2.COHERE2.presets["cohere2-tiny"]
COHERE2_MOE = Family(
    "cohere2_moe", ("cohere2_moe",), "Cohere2MoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"cohere2-moe-tiny": _TINY | dict(
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.0,
        mlp_layer_types=(DENSE, MOE, MOE, MOE), rope_layers=(True, True, False, True))})
