"""RecurrentGemma (Griffin): ``block_types`` cycling recurrent blocks (models/rglru.py: a
convolution and the RG-LRU, lru_width wide) and local attention (multi-query, sliding windows of
``attention_window_size``, rotary on half of each head, q/k/v biases by ``attention_bias``, an
output bias always), Gemma's (1 + w) RMSNorms, a gated MLP with biases ``intermediate_size / 2``
wide, logits soft-capped by ``logits_soft_cap``, the head tied. The embeddings are scaled by
sqrt(hidden_size) rounded to bfloat16, as transformers' buffer holds it: an ``embedding_multiplier``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from shardzoo.models.arch import SLIDING
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    Weight,
    rope,
    rope_parameters_to_hf,
    special_tokens,
)
from shardzoo.models.rglru import RECURRENT

PREFIX = "model."
# RecurrentGemmaConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(num_hidden_layers=26, vocab_size=256000, hidden_size=2560, intermediate_size=3 * 2560,
              num_attention_heads=10, lru_width=None, attention_window_size=2048, conv1d_width=4, logits_soft_cap=30.0,
              rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
              hidden_activation="gelu_pytorch_tanh", rope_parameters=None,
              block_types=["recurrent", "recurrent", "attention"], attention_dropout=0.0, num_key_value_heads=None,
              attention_bias=False, w_init_variance_scale=0.01, tie_word_embeddings=True)
FEATURES = frozenset({"rope", "partial_rotary", "rmsnorm_plus_one", "pre_norms", "gated_mlp", "mlp_bias",
                      "attention_bias", "attention_out_bias", "sliding_window", "layer_pattern", "final_softcap",
                      "multipliers", "rglru"})
KINDS = {"recurrent": RECURRENT, "attention": SLIDING}


def embedding_scale(hidden: int) -> float:
    """sqrt(hidden_size) rounded to bfloat16 (transformers' ``normalizer`` buffer)."""
    return float(np.float32(hidden**0.5).astype(ml_dtypes.bfloat16))


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "w_init_variance_scale")  # the initial weights' spread
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads")
    d, n, heads = hf.get("hidden_size"), hf.get("num_hidden_layers"), hf.get("num_attention_heads")
    blocks = list(hf.get("block_types"))
    if not blocks or any(b not in KINDS for b in blocks):
        raise hf.refuse("block_types", f"each block one of {', '.join(KINDS)}")
    scaling = rope(hf, rotary=0.5)
    if scaling["rope_scaling"] is not None:
        raise hf.refuse("rope_parameters", "RecurrentGemma's rotary embeddings take no scaling")
    return scaling | special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=hf.get("intermediate_size") // 2,
        num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
        rms_norm_eps=hf.get("rms_norm_eps"), hidden_act=hf.get("hidden_activation"),
        tie_word_embeddings=hf.get("tie_word_embeddings"), final_logit_softcapping=hf.get("logits_soft_cap"),
        sliding_window=hf.get("attention_window_size"), layer_types=tuple(KINDS[blocks[i % len(blocks)]] for i in range(n)),
        lru_width=hf.get("lru_width") or d, conv1d_width=hf.get("conv1d_width"), norm_type="rmsnorm_plus_one",
        mlp_bias=True, attention_bias=hf.get("attention_bias"), attention_out_bias=True,
        embedding_multiplier=embedding_scale(d))


def _block_types(types) -> list[str]:
    """The shortest period of ``types`` (recurrent / attention) that repeats through the layers."""
    names = ["recurrent" if t == RECURRENT else "attention" for t in types]
    for p in range(1, len(names) + 1):
        if all(names[i] == names[i % p] for i in range(len(names))):
            return names[:p]
    return names


def to_hf(a) -> dict:
    if a.embedding_multiplier != embedding_scale(a.hidden_size) or a.scale_embeddings:
        raise HFError(f"recurrent_gemma scales its embeddings by sqrt(hidden_size) in bfloat16 "
                      f"({embedding_scale(a.hidden_size)}); embedding_multiplier={a.embedding_multiplier}")
    return dict(hidden_size=a.hidden_size, intermediate_size=2 * a.intermediate_size,
                num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                num_key_value_heads=a.kv_heads, rms_norm_eps=a.rms_norm_eps, hidden_activation=a.hidden_act,
                logits_soft_cap=a.final_logit_softcapping, attention_window_size=a.sliding_window,
                block_types=_block_types(a.layer_types or ()), lru_width=a.rglru.lru_width,
                conv1d_width=a.rglru.conv1d_width, attention_bias=a.attention_bias,
                rope_parameters=rope_parameters_to_hf(a, partial=True))


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "embed_tokens.weight"),
           Weight(("final_norm", "scale"), PREFIX + "final_norm.weight")]
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h = PREFIX + "layers.{i}."
    out = [Weight(("attn_norm", "scale"), h + "temporal_pre_norm.weight"),
           Weight(("mlp_norm", "scale"), h + "channel_pre_norm.weight")]
    t = h + "temporal_block."
    if spec.mixer == RECURRENT:
        r = ("recurrent",)
        for name in ("linear_y", "linear_x"):
            out += [Weight(r + (name, "kernel"), t + f"{name}.weight", "linear"),
                    Weight(r + (name, "bias"), t + f"{name}.bias", "vec")]
        out += [Weight(r + ("linear_out", "kernel"), t + "linear_out.weight", "linear", n_in=2),
                Weight(r + ("linear_out", "bias"), t + "linear_out.bias", "vec"),
                Weight(r + ("conv",), t + "conv_1d.weight", "depthwise"),
                Weight(r + ("conv_bias",), t + "conv_1d.bias", "vec"),
                Weight(r + ("recurrent_param",), t + "rg_lru.recurrent_param", "vec")]
        for name in ("input_gate", "recurrent_gate"):
            out += [Weight(r + (f"{name}_weight",), t + f"rg_lru.{name}_weight"),
                    Weight(r + (f"{name}_bias",), t + f"rg_lru.{name}_bias")]
    else:
        for n in "qkv":
            out.append(Weight(("attn", n, "kernel"), t + f"{n}_proj.weight", "linear"))
            if a.attention_bias:
                out.append(Weight(("attn", n, "bias"), t + f"{n}_proj.bias", "vec"))
        out += [Weight(("attn", "o", "kernel"), t + "o_proj.weight", "linear", n_in=2),
                Weight(("attn", "o", "bias"), t + "o_proj.bias", "vec")]
    for n in ("gate", "up", "down"):
        out += [Weight(("mlp", n, "kernel"), h + f"mlp_block.{n}_proj.weight", "linear"),
                Weight(("mlp", n, "bias"), h + f"mlp_block.{n}_proj.bias", "vec")]
    return out


def _published(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    """The published configs: vocabulary 256000, one kv head, the RG-LRU as wide as the model, windows of 2048."""
    return dict(vocab_size=256000, hidden_size=hidden, intermediate_size=intermediate // 2, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=1, sliding_window=2048, lru_width=hidden,
                layer_types=tuple((RECURRENT, RECURRENT, SLIDING)[i % 3] for i in range(layers)),
                partial_rotary_factor=0.5, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
                hidden_act="gelu_pytorch_tanh", norm_type="rmsnorm_plus_one", mlp_bias=True, attention_out_bias=True,
                tie_word_embeddings=True, embedding_multiplier=embedding_scale(hidden), bos_token_id=2, eos_token_id=1)


RECURRENT_GEMMA = Family(
    "recurrent_gemma", ("recurrent_gemma",), "RecurrentGemmaForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    global_weights, layer_weights,
    presets={
        "recurrentgemma-2b": _published(2560, 15360, 26, 10),  # google/recurrentgemma-2b/config.json
        "recurrentgemma-9b": _published(4096, 24576, 38, 16),  # google/recurrentgemma-9b/config.json
        "recurrentgemma-tiny": dict(
            vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, sliding_window=16, lru_width=64, layer_types=(RECURRENT, RECURRENT, SLIDING),
            partial_rotary_factor=0.5, final_logit_softcapping=30.0, hidden_act="gelu_pytorch_tanh",
            norm_type="rmsnorm_plus_one", mlp_bias=True, attention_out_bias=True, tie_word_embeddings=True,
            embedding_multiplier=embedding_scale(64), bos_token_id=None,
            eos_token_id=None),
    })
