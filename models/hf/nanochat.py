"""nanochat (Karpathy's, ``nanochat``): Llama's attention without norm weights: every RMSNorm
weightless (``norm_type`` ``rmsnorm_no_weight``), one of the embeddings before the first layer
(``embedding_norm``), the queries and keys RMS-normalised per head after the rotary embedding
(``qk_norm`` "l2", which commutes with it); a plain MLP (``mlp.fc1``, relu2, ``mlp.fc2``); the
output logits soft-capped (``final_logit_softcapping``).

Its rotary turns the other way (``rotate_half`` gives ``[x2, -x1]``): the rotation by -t is the
rotation by t between two swaps of each head's halves, which the weightless qk-norm and q.k do
not see; so the q and k projections are read with each head's halves swapped
(``Weight.halves_swapped``) and shardzoo's rotary computes the same model.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_parameters_to_hf,
    sizes,
    sizes_to_hf,
)

# NanoChatConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=50304, hidden_size=768, intermediate_size=8192, num_hidden_layers=12,
              num_attention_heads=6, num_key_value_heads=None, max_position_embeddings=2048, hidden_act="relu2",
              attention_dropout=0.0, rms_norm_eps=1e-6, initializer_range=0.02, rope_parameters=None, use_cache=True,
              final_logit_softcapping=15.0, attention_bias=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
              tie_word_embeddings=False)
FEATURES = (llama.ROTARY - {"rmsnorm", "gated_mlp"}) | {
    "rmsnorm_no_weight", "embedding_norm", "qk_norm_l2", "plain_mlp", "final_softcap", "attention_bias",
    "attention_out_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    rotary = rope(hf)
    rotary.pop("partial_rotary_factor")
    bias = hf.get("attention_bias")  # q/k/v and o
    return sizes(hf) | rotary | dict(
        norm_type="rmsnorm_no_weight", embedding_norm=True, qk_norm="l2", mlp_type="plain",
        final_logit_softcapping=hf.get("final_logit_softcapping"), attention_bias=bias, attention_out_bias=bias)


def to_hf(a) -> dict:
    # no pad id (an import's own survives the export): transformers' 1 need not be the model's
    return sizes_to_hf(a) | dict(rope_parameters=rope_parameters_to_hf(a), attention_bias=a.attention_bias,
                                 final_logit_softcapping=a.final_logit_softcapping, pad_token_id=None)


def global_weights(a) -> list[Weight]:
    return [w for w in llama.global_weights(a) if w.path[0] != "final_norm"]  # weightless


def layer_weights(a, spec) -> list[Weight]:
    """q, k (each head's halves swapped), v, o and the MLP's fc1 and fc2; no norm weights."""
    h = llama.LAYER
    out = [w if w.path[1] not in ("q", "k") else Weight(**{**w.__dict__, "halves_swapped": True})
           for w in llama.attention_weights(a) if w.path[0] == "attn"]
    for leaf, name in (("up", "fc1"), ("down", "fc2")):
        out.append(Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"))
    return out


BASE = dict(norm_type="rmsnorm_no_weight", embedding_norm=True, qk_norm="l2", mlp_type="plain", hidden_act="relu2",
            final_logit_softcapping=15.0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
NANOCHAT = Family(
    "nanochat", ("nanochat",), "NanoChatForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights,
    presets={
        # nanochat's d20 (its published model_config: 20 layers of 1280, 10 heads, the 65536-id
        # tokenizer, 2048 positions, an MLP 4 x wide); token ids NanoChatConfig's
        "nanochat-d20": BASE | dict(vocab_size=65536, hidden_size=1280, intermediate_size=5120, num_hidden_layers=20,
                                    num_attention_heads=10, max_position_embeddings=2048, rope_theta=10000.0),
        "nanochat-tiny": llama.TINY | BASE | dict(num_key_value_heads=None),
    })
