"""Ministral 3 (``ministral3``, Ministral3ForCausalLM; the text model of Mistral's ``mistral3``
checkpoints): Mistral's layout whose queries, after the rotary embedding, are scaled on every
layer by 1 + beta * log(1 + floor(p / original_max_position_embeddings)) (``rope_parameters``'
``llama_4_scaling_beta``; models/query_scaling.py ``Llama4Scaling``). Its rotary is YaRN by
default; ``rope_parameters`` also carries ``max_position_embeddings``, which transformers ignores
(export writes the model's, as Ministral3Config does).
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    rope,
    rope_parameters_to_hf,
    sizes,
    sizes_to_hf,
)
from shardzoo.models.query_scaling import Llama4Scaling

# Ministral3Config's default rotary (transformers 5.25): what a config.json without rope_parameters gets
DEFAULT_ROPE = dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=16384,
                    beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)
SCHEMA = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
              max_position_embeddings=262144, initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True,
              pad_token_id=11, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_parameters=None,
              sliding_window=None, attention_dropout=0.0)
FEATURES = llama.ROTARY | {"sliding_window", "llama_4_scaling"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    params = dict(hf.get("rope_parameters") or DEFAULT_ROPE)
    beta = params.pop("llama_4_scaling_beta", None)
    params.pop("max_position_embeddings", None)  # transformers' rope validation ignores it
    length = params.get("original_max_position_embeddings")
    if beta is None or not isinstance(length, int) or isinstance(length, bool):
        raise hf.refuse("rope_parameters", "Ministral 3 scales its queries by rope_parameters' "
                                           "llama_4_scaling_beta and original_max_position_embeddings (an integer)")
    rotary = rope(hf, params=params, theta=DEFAULT_ROPE["rope_theta"])
    rotary.pop("partial_rotary_factor")
    return sizes(hf) | rotary | dict(sliding_window=hf.get("sliding_window"), llama_4_scaling_beta=float(beta),
                                     llama_4_scaling_length=length)


def to_hf(a) -> dict:
    q = a.llama_4_scaling or Llama4Scaling()
    params = rope_parameters_to_hf(a)
    if params.get("original_max_position_embeddings", q.original_max_position_embeddings) != \
            q.original_max_position_embeddings:
        raise HFError(f"ministral3 keeps one original_max_position_embeddings for its rotary scaling "
                      f"({params['original_max_position_embeddings']}) and its query scaling "
                      f"(llama_4_scaling original_max_position_embeddings={q.original_max_position_embeddings})")
    params |= dict(original_max_position_embeddings=q.original_max_position_embeddings,
                   llama_4_scaling_beta=q.beta, max_position_embeddings=a.max_position_embeddings)
    # no pad id (an import's own survives the export): transformers' 11 need not fit a vocabulary
    return sizes_to_hf(a) | dict(rope_parameters=params, sliding_window=a.sliding_window, pad_token_id=None)


# mistralai/Ministral-3-8B-Base-2512's text model (Ministral3Config's defaults, which transformers
# says mirror it): YaRN x16 over 16384 positions, queries scaled by beta 0.1
BASE = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
            rms_norm_eps=1e-5, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
            rope_scaling={k: v for k, v in DEFAULT_ROPE.items() if k not in ("rope_theta", "llama_4_scaling_beta")},
            llama_4_scaling_beta=0.1, llama_4_scaling_length=16384)
MINISTRAL3 = Family(
    "ministral3", ("ministral3",), "Ministral3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={
        "ministral3-8b": BASE,
        # positions past 4 get the query temperature
        "ministral3-tiny": llama.TINY | dict(head_dim=16, llama_4_scaling_beta=0.5, llama_4_scaling_length=4),
    })
