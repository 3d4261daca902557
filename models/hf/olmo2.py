"""OLMo 2: Llama's tensors with the norms moved onto the outputs (``post_attention_layernorm``
and ``post_feedforward_layernorm``, no pre-norms) and qk-norm over the whole q and k
projections (``q_norm`` of heads x head_dim, ``k_norm`` of kv_heads x head_dim)."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig

SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k not in ("mlp_bias", "pretraining_tp", "head_dim")}
          | dict(vocab_size=50304, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=50279, pad_token_id=1))
FEATURES = (llama.ROTARY - {"pre_norms"}) | {"post_norms", "qk_norm_projection", "attention_bias",
                                             "attention_out_bias"}


def from_hf(hf: HFConfig) -> dict:
    bias = hf.get("attention_bias")  # one flag for q/k/v/o
    return llama.rotary_fields(hf) | dict(norm_position="post", qk_norm="projection", attention_bias=bias,
                                          attention_out_bias=bias)


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias)


# OLMo 2 (allenai/OLMo-2-0425-1B/config.json): norms on the outputs, qk-norm over the projections.
BASE = dict(vocab_size=100352, rope_theta=500000.0, norm_position="post", qk_norm="projection",
            bos_token_id=None, eos_token_id=100257)
OLMO2 = Family(
    "olmo2", ("olmo2",), "Olmo2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={
        "olmo-2-1b": BASE | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                 num_attention_heads=16, max_position_embeddings=4096),
        "olmo2-tiny": BASE | llama.TINY,
    })
