"""Phi-3 (mini 4k): Llama's model with fused tensors: ``self_attn.qkv_proj`` (q | k | v rows,
unequal under GQA) and ``mlp.gate_up_proj`` (gate | up), split on import and joined on export.
The 128k models scale their rotary embedding with ``longrope``, whose
``original_max_position_embeddings`` Phi-3 keeps beside ``max_position_embeddings``, at the top
of config.json (transformers prefers it to the one in ``rope_scaling``, as here)."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, Weight, rope

SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp",
                                                                "head_dim")}
          | dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, max_position_embeddings=4096,
                 original_max_position_embeddings=4096, rms_norm_eps=1e-5, eos_token_id=32000,
                 pad_token_id=32000, sliding_window=None, embd_pdrop=0.0, resid_pdrop=0.0))
FEATURES = llama.ROTARY | {"sliding_window", "partial_rotary"}


def from_hf(hf: HFConfig) -> dict:
    out = llama.rotary_fields(hf) | dict(sliding_window=hf.get("sliding_window"),
                                         partial_rotary_factor=rope(hf)["partial_rotary_factor"])
    original = hf.get("original_max_position_embeddings")  # read by the scalings that have one
    scaling = out["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") in ("llama3", "yarn", "longrope"):
        out["rope_scaling"] = scaling | dict(original_max_position_embeddings=original)
    return out


def to_hf(a) -> dict:
    # Phi-3 pads with its end-of-text token (32000 both, published); transformers' default pad
    # id 32000 would not fit a smaller vocabulary.
    eos = a.eos_token_id[0] if isinstance(a.eos_token_id, tuple) else a.eos_token_id
    original = a.rope_scaling_dict.get("original_max_position_embeddings", a.max_position_embeddings)
    out = llama.rotary_to_hf(a) | dict(original_max_position_embeddings=original,
                                       pad_token_id=eos, sliding_window=a.sliding_window)
    if a.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = a.partial_rotary_factor
    return out


def layer_weights(a, spec) -> list[Weight]:
    """q, k, v and gate, up are column blocks of fused tensors."""
    h, heads = llama.LAYER, (a.num_attention_heads, a.kv_heads, a.kv_heads)
    layer = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
             Weight(("mlp_norm", "scale"), h + "post_attention_layernorm.weight"),
             Weight(("attn", "o", "kernel"), h + "self_attn.o_proj.weight", "linear", n_in=2),
             Weight(("mlp", "down", "kernel"), h + "mlp.down_proj.weight", "linear")]
    layer += [Weight(("attn", n, "kernel"), h + "self_attn.qkv_proj.weight", "linear",
                     part=(j, 3), widths=heads) for j, n in enumerate("qkv")]
    layer += [Weight(("mlp", n, "kernel"), h + "mlp.gate_up_proj.weight", "linear", part=(j, 2))
              for j, n in enumerate(("gate", "up"))]
    return layer


# Phi-3 mini 4k (microsoft/Phi-3-mini-4k-instruct/config.json): Mistral's model, fused tensors in HF.
BASE = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, max_position_embeddings=4096,
            rms_norm_eps=1e-5, sliding_window=2047, bos_token_id=1, eos_token_id=32000)
# Phi-3 mini 128k (microsoft/Phi-3-mini-128k-instruct): longrope from 4096 to 131072 positions.
# Its 48 short and long factors (one per rotated pair of head_dim 96) are PLACEHOLDERS (1.0):
# the published lists could not be read here; load the checkpoint's config.json for the real ones.
LONG = BASE | dict(max_position_embeddings=131072, sliding_window=262144,
                   rope_scaling=dict(rope_type="longrope", short_factor=(1.0,) * 48, long_factor=(1.0,) * 48,
                                     original_max_position_embeddings=4096))
PHI3 = Family(
    "phi3", ("phi3",), "Phi3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={"phi-3-mini-4k": BASE, "phi-3-mini-128k": LONG,
             "phi3-tiny": BASE | llama.TINY | dict(sliding_window=8)})
