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
# Phi-3.5 mini (microsoft/Phi-3.5-mini-instruct/config.json): Phi-3 mini with longrope from 4096
# to 131072 positions, 48 short and long factors (one per rotated pair of head_dim 96).
_LONG_FACTOR = (1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
    1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661,
    3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432,
    7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945,
    24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
    50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305,
    58.21000289916992, 60.1400032043457, 62.61000442504883, 62.62000274658203,
    62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094,
    63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938,
    64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062)
_SHORT_FACTOR = (1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
    1.0699999332427979, 1.0999999046325684, 1.1099998950958252, 1.1599998474121094,
    1.1599998474121094, 1.1699998378753662, 1.2899998426437378, 1.339999794960022,
    1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
    2.729999542236328, 2.749999523162842, 2.8399994373321533)
LONG = BASE | dict(max_position_embeddings=131072, sliding_window=262144,
                   rope_scaling=dict(rope_type="longrope", short_factor=_SHORT_FACTOR, long_factor=_LONG_FACTOR,
                                     original_max_position_embeddings=4096))
PHI3 = Family(
    "phi3", ("phi3",), "Phi3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={"phi-3-mini-4k": BASE, "phi-3.5-mini": LONG,
             "phi3-tiny": BASE | llama.TINY | dict(sliding_window=8)})
