"""LFM2-MoE (Liquid AI): LFM2's conv and attention layers (models/hf/lfm2.py) with SwiGLU MLPs
in the first ``num_dense_layers`` layers (``intermediate_size`` wide, no auto-adjusted width) and
MoE in the rest: sigmoid router scores whose choice adds the ``expert_bias`` correction (one
group: DeepSeek-V3's router, ``sigmoid_groups``), the weights renormalised by
``norm_topk_prob`` and times ``routed_scaling_factor``, experts ``w1``/``w3``/``w2``, no shared
expert. ``use_expert_bias: false`` is refused (shardzoo's sigmoid router always has the bias).
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, MOE
from shardzoo.models.hf import lfm2, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

# Lfm2MoeConfig's fields and defaults (transformers 5.25)
SCHEMA = ({k: v for k, v in lfm2.SCHEMA.items() if not k.startswith("block_") and k != "full_attn_idxs"}
          | dict(vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_dense_layers=2,
                 num_experts_per_tok=4, output_router_logits=False, num_experts=32, use_expert_bias=True,
                 routed_scaling_factor=1.0, norm_topk_prob=True, full_attn_idxs=None))
FEATURES = lfm2.FEATURES | {"moe", "moe_pattern", "expert_width", "routed_scaling", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    if not hf.get("use_expert_bias"):
        raise hf.refuse("use_expert_bias", "shardzoo's sigmoid router chooses with a correction bias (true only)")
    out = lfm2.layer_fields(hf)
    dense = hf.get("num_dense_layers")
    return out | dict(
        intermediate_size=hf.get("intermediate_size"), num_local_experts=hf.get("num_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), moe_intermediate_size=hf.get("moe_intermediate_size"),
        router_kind="sigmoid_groups", norm_topk_prob=hf.get("norm_topk_prob"),
        routed_scaling_factor=hf.get("routed_scaling_factor"), router_aux_loss_coef=0.0,
        mlp_layer_types=tuple(DENSE if i < dense else MOE for i in range(out["num_hidden_layers"])))


def to_hf(a) -> dict:
    """LFM2's and the MoE's; no pad id unless the imported config.json had one (the architecture records none,
    and transformers' default, 0, is a token of the vocabulary)."""
    m = a.moe or NO_MOE
    kinds = [s.mlp for s in a.layer_specs()]
    out = lfm2.to_hf(a) | dict(
        num_dense_layers=kinds.index(MOE) if MOE in kinds else len(kinds), num_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=a.expert_size,
        routed_scaling_factor=m.routed_scaling_factor, norm_topk_prob=m.norm_topk_prob, use_expert_bias=True,
        pad_token_id=None)
    del out["block_auto_adjust_ff_dim"]
    return out


def layer_weights(a, spec) -> list[Weight]:
    """LFM2's; a MoE layer's ``feed_forward`` its router, ``expert_bias`` and experts."""
    out = lfm2.layer_weights(a, spec)
    if spec.mlp != MOE:
        return out
    x = lfm2.llama.LAYER + "feed_forward."
    return [w for w in out if w.path[0] != "mlp"] + mixtral.moe_weights(a, "feed_forward.") + [
        Weight(("moe", "router_bias"), x + "expert_bias")]


LFM2_MOE = Family(
    "lfm2_moe", ("lfm2_moe",), "Lfm2MoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, lfm2.global_weights,
    layer_weights, execution=mixtral.HF_MOE,
    presets={"lfm2-moe-tiny": lfm2.LFM2.presets["lfm2-tiny"] | dict(
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_kind="sigmoid_groups",
        router_aux_loss_coef=0.0, mlp_layer_types=(DENSE, MOE, MOE, MOE))})
