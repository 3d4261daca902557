"""Helium (Kyutai): Llama's layout with interleaved rotary pairs (``rope_interleaved``, as
Cohere), biases on q/k/v by ``attention_bias`` (never on o) and on the MLP by ``mlp_bias``.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig

# HeliumConfig's fields and defaults (transformers 5.25)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k != "pretraining_tp"}
          | dict(vocab_size=48000, hidden_size=2560, intermediate_size=7040, num_hidden_layers=24,
                 num_attention_heads=20, num_key_value_heads=20, head_dim=128, max_position_embeddings=4096,
                 rms_norm_eps=1e-8, pad_token_id=3, eos_token_id=2, bos_token_id=1))
FEATURES = llama.ROTARY | {"rope_interleaved", "attention_bias", "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    return llama.rotary_fields(hf) | dict(rope_interleaved=True, attention_bias=hf.get("attention_bias"),
                                          mlp_bias=hf.get("mlp_bias"))


def to_hf(a) -> dict:
    return llama.rotary_to_hf(a) | dict(attention_bias=a.attention_bias, mlp_bias=a.mlp_bias)


HELIUM = Family(
    "helium", ("helium",), "HeliumForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={
        # kyutai/helium-1-preview-2b/config.json
        "helium-1-preview-2b": dict(vocab_size=48000, hidden_size=2560, intermediate_size=7040, num_hidden_layers=24,
                                    num_attention_heads=20, num_key_value_heads=20, head_dim=128,
                                    max_position_embeddings=4096, rms_norm_eps=1e-8, rope_theta=100000.0,
                                    rope_interleaved=True, bos_token_id=1, eos_token_id=2),
        "helium-tiny": llama.TINY | dict(rope_interleaved=True, attention_bias=True, mlp_bias=True)})
