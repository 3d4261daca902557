"""JetMoE: a mixture of attention heads (``models/moa.py``) and a MoE MLP in every layer.

Each layer's attention routes every token to ``num_experts_per_tok`` of ``num_local_experts``
query/output projection pairs (``self_attention.experts``: stacked ``input_linear`` and
``output_linear``, a router ``router.layer`` and one output bias), with keys and values from one
fused ``kv_proj`` (k rows, then v rows) of ``num_key_value_heads`` heads of ``kv_channels``;
``num_attention_heads`` is derived (kv heads x k). The MLP is Granite-MoE's layout (stacked
experts, ``input_linear`` gate | up rows) with one output bias (``mlp.bias``). Both routers are
the softmax of the top-k logits (Mixtral's renormalised top-k), and transformers drops no token:
the import sets ``moe_dispatch="dropless"`` and no z-loss (Mixtral's ``HF_MOE``).

transformers builds the layers' two RMSNorms with RMSNorm's default epsilon (1e-6) and only the
final norm with ``rms_norm_eps`` (``layer_norm_eps``: ``models/norms.py`` LayerNorms). Its
``aux_loss_coef`` weights both routers' load-balancing losses (transformers takes one loss over
all routers' logits together, shardzoo one per router and layer).
"""

from __future__ import annotations

from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_to_hf,
    special_tokens,
)
from shardzoo.models.moa import MOA

SCHEMA = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=12, num_key_value_heads=16, kv_channels=128,
              intermediate_size=5632, max_position_embeddings=4096, activation_function="silu", num_local_experts=8,
              num_experts_per_tok=2, output_router_logits=False, aux_loss_coef=0.01, use_cache=True, bos_token_id=1,
              eos_token_id=2, pad_token_id=None, tie_word_embeddings=True, rope_parameters=None, rms_norm_eps=1e-6,
              initializer_range=0.01, attention_dropout=0.0, num_attention_heads=32)
FEATURES = llama.ROTARY | {"layer_pattern", "layer_norm_eps", "moe", "moe_output_bias", "mixture_of_attention"}
LAYER_NORM_EPS = 1e-6  # transformers' JetMoeRMSNorm(hidden_size) in every layer


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    hf.unalias({"head_dim": "kv_channels"})
    hf.ignore("num_attention_heads")  # transformers derives it: kv heads x num_experts_per_tok
    heads, k, e = hf.get("num_key_value_heads"), hf.get("num_experts_per_tok"), hf.get("num_local_experts")
    out = rope(hf, theta=10000.0)
    out.pop("partial_rotary_factor")
    aux = hf.get("aux_loss_coef")
    return out | special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), intermediate_size=hf.get("intermediate_size"),
        num_hidden_layers=hf.get("num_hidden_layers"), num_attention_heads=heads * k, num_key_value_heads=heads,
        head_dim=hf.get("kv_channels"), max_position_embeddings=hf.get("max_position_embeddings"),
        rms_norm_eps=hf.get("rms_norm_eps"), layer_norm_eps=LAYER_NORM_EPS,
        initializer_range=hf.get("initializer_range"),
        hidden_act=hf.get("activation_function"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        layer_types=(MOA,) * hf.get("num_hidden_layers"),
        num_local_experts=e, num_experts_per_tok=k, router_aux_loss_coef=aux, norm_topk_prob=True,
        moe_output_bias=True, moa_num_experts=e, moa_num_experts_per_tok=k, moa_aux_loss_coef=aux)


def to_hf(a) -> dict:
    return rope_to_hf(a) | dict(
        hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers, num_key_value_heads=a.kv_heads,
        kv_channels=a.head_size, intermediate_size=a.expert_size, max_position_embeddings=a.max_position_embeddings,
        activation_function=a.hidden_act, num_local_experts=a.moe.num_local_experts,
        num_experts_per_tok=a.moe.num_experts_per_tok, aux_loss_coef=a.moe.router_aux_loss_coef,
        rms_norm_eps=a.rms_norm_eps, num_attention_heads=a.num_attention_heads)


def layer_weights(a, spec) -> list[Weight]:
    """Two norms, the mixture of attention heads and the MoE MLP, their experts stacked ``[expert, out, in]``."""
    h, stacked = llama.LAYER, dict(experts=a.moe.num_local_experts, stacked_experts=True)
    moa, mlp = h + "self_attention.", h + "mlp."
    return [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
            Weight(("mlp_norm", "scale"), h + "post_attention_layernorm.weight"),
            Weight(("attn", "router", "kernel"), moa + "experts.router.layer.weight", "linear"),
            Weight(("attn", "q_experts"), moa + "experts.input_linear.weight", "linear", **stacked),
            Weight(("attn", "o_experts"), moa + "experts.output_linear.weight", "linear", n_in=2, **stacked),
            Weight(("attn", "o_bias"), moa + "experts.bias", "vec"),
            Weight(("attn", "k", "kernel"), moa + "kv_proj.weight", "linear", part=(0, 2)),
            Weight(("attn", "v", "kernel"), moa + "kv_proj.weight", "linear", part=(1, 2)),
            Weight(("moe", "router", "kernel"), mlp + "router.layer.weight", "linear"),
            Weight(("moe", "wi_gate"), mlp + "input_linear.weight", "linear", part=(0, 2), **stacked),
            Weight(("moe", "wi_up"), mlp + "input_linear.weight", "linear", part=(1, 2), **stacked),
            Weight(("moe", "wo"), mlp + "output_linear.weight", "linear", **stacked),
            Weight(("moe", "output_bias"), mlp + "bias", "vec")]


# jetmoe/jetmoe-8b/config.json (its older names: ffn_hidden_size, moe_num_experts, moe_top_k)
JETMOE_8B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=16, head_dim=128, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, layer_norm_eps=LAYER_NORM_EPS, initializer_range=0.01, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2,
                 layer_types=(MOA,) * 24, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                 moe_output_bias=True, moa_num_experts=8, moa_num_experts_per_tok=2, moa_aux_loss_coef=0.01)
JETMOE = Family(
    "jetmoe", ("jetmoe",), "JetMoeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights,
    layer_weights, execution=mixtral.HF_MOE, presets={"jetmoe-8b": JETMOE_8B})
