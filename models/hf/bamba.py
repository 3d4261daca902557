"""Bamba (IBM): Mamba2 layers with attention on the layers ``attn_layer_indices`` names, every
layer then a SwiGLU MLP; pre-norms (``input_layernorm``, ``pre_ff_layernorm``), GQA attention
with rotary embeddings on half of each head (transformers fixes partial_rotary_factor at 0.5),
biases on all four projections with ``attention_bias``. The mamba mixer is the shared
``mamba2`` feature (``models/ssm.py``, its fields read as ``mamba2.mamba_fields``).
"""

from __future__ import annotations

import math

from shardzoo.models.arch import FULL, MAMBA
from shardzoo.models.hf import llama, mamba2
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, rope, rope_to_hf, sizes

# BambaConfig's fields and transformers' defaults
SCHEMA = dict(vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, num_logits_to_keep=1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, max_position_embeddings=262144, attention_dropout=0.0,
              attn_layer_indices=None, mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
              time_step_limit=[0.0, math.inf], z_loss_coefficient=0.0, rope_parameters=None, attention_bias=False,
              mlp_bias=False)
FEATURES = llama.ROTARY | {"partial_rotary", "layer_pattern", "mamba2", "mamba_proj_bias", "time_step_limit",
                           "attention_bias", "attention_out_bias", "mlp_bias"}
NAMES = dict(heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups", state="mamba_d_state",
             conv="mamba_d_conv", chunk="mamba_chunk_size", conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias",
             expand="mamba_expand", act="hidden_act", limit="time_step_limit")


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "num_logits_to_keep")
    out = sizes(hf) | rope(hf) | mamba2.mamba_fields(hf, NAMES)
    out["partial_rotary_factor"] = 0.5  # BambaConfig sets it whatever the config says
    n, attn = out["num_hidden_layers"], hf.get("attn_layer_indices") or ()
    if any(not isinstance(i, int) or not 0 <= i < n for i in attn):
        raise hf.refuse("attn_layer_indices", f"each must be a layer index in 0..{n - 1}")
    bias = hf.get("attention_bias")
    return out | dict(layer_types=tuple(FULL if i in attn else MAMBA for i in range(n)), attention_bias=bias,
                      attention_out_bias=bias, mlp_bias=hf.get("mlp_bias"))


def to_hf(a) -> dict:
    types = a.layer_types or ()
    out = dict(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
               num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
               num_key_value_heads=a.kv_heads, max_position_embeddings=a.max_position_embeddings,
               rms_norm_eps=a.rms_norm_eps, hidden_act=a.hidden_act, attention_bias=a.attention_bias,
               mlp_bias=a.mlp_bias, attn_layer_indices=[i for i, t in enumerate(types) if t == FULL])
    rotary = rope_to_hf(a)
    rotary.pop("partial_rotary_factor", None)  # always 0.5 in transformers
    return out | rotary | mamba2.mamba_to_hf(a, NAMES)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight"),
           Weight(("final_norm", "scale"), "model.final_layernorm.weight")]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
           Weight(("mlp_norm", "scale"), h + "pre_ff_layernorm.weight")] + llama.mlp_weights(a, "feed_forward.")
    if spec.mixer == MAMBA:
        return out + mamba2.mamba_weights(a, h + "mamba.")
    return out + [w for w in llama.attention_weights(a) if w.path[0] == "attn"]


# --------------------------------------------------------------------------------- presets
BAMBA = Family(
    "bamba", ("bamba",), "BambaForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        "bamba-tiny": llama.TINY | dict(num_hidden_layers=4, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
                                        layer_types=(MAMBA, FULL, MAMBA, MAMBA), mamba_num_heads=8, mamba_head_dim=16,
                                        mamba_n_groups=2, ssm_state_size=16, mamba_chunk_size=64),
    })
