"""MiniMax-M2: Llama's attention without biases, an RMSNorm of the whole query and key projections
(OLMo 2's qk-norm), rotary embeddings on the first ``rotary_dim`` features of each head (as
``partial_rotary_factor``), and a MoE in every layer: sigmoid router scores whose choice adds
``e_score_correction_bias`` (DeepSeek-V3's router with one group), the chosen weights
renormalised, Mixtral's experts (``block_sparse_moe.experts.E.w1/w3/w2``, ``intermediate_size``
wide). No shared expert, no dense layer.
"""

from __future__ import annotations

from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight, rope, rope_to_hf, sizes_to_hf
from shardzoo.models.moe_arch import NO_MOE

# MiniMaxM2Config's fields and defaults (transformers 5.25), and rotary_dim, which it reads
# from config.json as partial_rotary_factor = rotary_dim / head_dim
SCHEMA = ({k: v for k, v in mixtral.SCHEMA.items() if k != "sliding_window"}
          | dict(vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                 num_attention_heads=48, num_key_value_heads=8, head_dim=128, max_position_embeddings=196608,
                 bos_token_id=200034, eos_token_id=200020, num_local_experts=256, num_experts_per_tok=8,
                 rms_norm_eps=1e-6, rotary_dim=None))
FEATURES = llama.ROTARY | {"partial_rotary", "qk_norm_projection", "moe", "router_jitter", "sigmoid_router"}


def from_hf(hf: HFConfig) -> dict:
    out = llama.rotary_fields(hf, theta=5e6)
    factor = rope(hf)["partial_rotary_factor"]
    dim = hf.get("rotary_dim")
    if dim is not None:
        factor = dim / (out["head_dim"] or out["hidden_size"] // out["num_attention_heads"])
    return out | dict(
        partial_rotary_factor=factor, qk_norm="projection", num_local_experts=hf.get("num_local_experts"),
        num_experts_per_tok=hf.get("num_experts_per_tok"), router_kind="sigmoid_groups", norm_topk_prob=True,
        router_jitter_noise=hf.get("router_jitter_noise"), router_aux_loss_coef=hf.get("router_aux_loss_coef"))


def to_hf(a) -> dict:
    """The rotated width as ``rotary_dim`` too, as the released checkpoints spell it."""
    m = a.moe or NO_MOE
    return sizes_to_hf(a) | rope_to_hf(a) | dict(
        partial_rotary_factor=a.partial_rotary_factor, rotary_dim=round(a.partial_rotary_factor * a.head_size),
        num_local_experts=m.num_local_experts,
        num_experts_per_tok=m.num_experts_per_tok, router_jitter_noise=m.router_jitter_noise,
        router_aux_loss_coef=m.router_aux_loss_coef)


def layer_weights(a, spec) -> list[Weight]:
    """Mixtral's, and the routers' correction bias."""
    return mixtral.layer_weights(a, spec) + [
        Weight(("moe", "router_bias"), llama.LAYER + "block_sparse_moe.e_score_correction_bias")]


# MiniMaxAI/MiniMax-M2/config.json: 62 layers, 48 heads of 128 (rotary on 64: rotary_dim), 256
# experts top-8, 1536 wide, chosen by sigmoid scores with their correction bias
MINIMAX_M2_230B = dict(
    vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48,
    num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5, max_position_embeddings=196608,
    rms_norm_eps=1e-6, rope_theta=5e6, qk_norm="projection", num_local_experts=256, num_experts_per_tok=8,
    router_kind="sigmoid_groups", router_aux_loss_coef=0.001, router_z_loss_coef=0.0, bos_token_id=200034,
    eos_token_id=200020)
MINIMAX_M2 = Family(
    "minimax_m2", ("minimax_m2",), "MiniMaxM2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"minimax-m2": MINIMAX_M2_230B, "minimax-m2-tiny": mixtral.MIXTRAL.presets["mixtral-tiny"] | dict(
        head_dim=32, partial_rotary_factor=0.5, qk_norm="projection", router_kind="sigmoid_groups",
        rope_theta=5e6, rms_norm_eps=1e-6)})
