"""Mixtral: Llama's attention (no biases) with a sparse MoE in every layer.

HF's Mixtral has no router z-loss and drops no token: the import sets ``router_z_loss_coef=0``
and ``moe_dispatch="dropless"`` (the family's ``execution``), the two training knobs config.json
has no field for.
"""

from __future__ import annotations

from shardzoo.models.arch import MOE
from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
          | dict(intermediate_size=14336, max_position_embeddings=131072, num_key_value_heads=8,
                 rms_norm_eps=1e-5, sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
                 output_router_logits=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0))
FEATURES = llama.ROTARY | {"sliding_window", "moe", "router_jitter"}
# How transformers' sparse MoE blocks compute: every token reaches its experts, no z-loss.
HF_MOE = dict(moe_dispatch="dropless", router_z_loss_coef=0.0)


def from_hf(hf: HFConfig) -> dict:
    return llama.rotary_fields(hf, theta=1e6) | dict(
        sliding_window=hf.get("sliding_window"), num_local_experts=hf.get("num_local_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), router_jitter_noise=hf.get("router_jitter_noise"),
        router_aux_loss_coef=hf.get("router_aux_loss_coef"), norm_topk_prob=True)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return llama.rotary_to_hf(a) | dict(
        sliding_window=a.sliding_window, num_local_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, router_jitter_noise=m.router_jitter_noise,
        router_aux_loss_coef=m.router_aux_loss_coef)


def moe_weights(a, prefix: str, names=("w1", "w3", "w2"), router: str = "gate") -> list[Weight]:
    """A MoE MLP's router and per-expert tensors ``{prefix}experts.E.{gate,up,down names}``."""
    e, x = a.moe.num_local_experts, llama.LAYER + prefix
    gate, up, down = names
    return [Weight(("moe", "router", "kernel"), x + f"{router}.weight", "linear"),
            Weight(("moe", "wi_gate"), x + f"experts.{{e}}.{gate}.weight", "linear", experts=e),
            Weight(("moe", "wi_up"), x + f"experts.{{e}}.{up}.weight", "linear", experts=e),
            Weight(("moe", "wo"), x + f"experts.{{e}}.{down}.weight", "linear", experts=e)]


def layer_weights(a, spec) -> list[Weight]:
    """Every Mixtral layer is MoE (a dense one only from an override: Llama's MLP names)."""
    if spec.mlp == MOE:
        return llama.attention_weights(a) + moe_weights(a, "block_sparse_moe.")
    return llama.layer_weights(a, spec)


BASE = dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0, rms_norm_eps=1e-5,
            num_key_value_heads=8, max_position_embeddings=32768)
MIXTRAL = Family(
    "mixtral", ("mixtral",), "MixtralForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=HF_MOE,
    presets={
        "mixtral-8x7b": BASE | dict(intermediate_size=14336),
        "mixtral-tiny": BASE | llama.TINY | dict(num_local_experts=4, num_key_value_heads=2,
                                                 max_position_embeddings=256),
    })
