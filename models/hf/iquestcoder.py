"""IQuest-Coder: Llama (transformers builds ``LlamaForCausalLM`` for it) under its own
``model_type``, with its own defaults (``head_dim`` 128, no ``pretraining_tp``)."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family

# IQuestCoderConfig's fields and defaults (transformers 5.25)
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k != "pretraining_tp"} | dict(
    vocab_size=76800, hidden_size=5120, intermediate_size=27648, num_hidden_layers=80, num_attention_heads=40,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, head_dim=128)

IQUESTCODER = Family(
    "iquestcoder", ("iquestcoder",), "LlamaForCausalLM", SCHEMA, llama.LLAMA_FEATURES, llama.llama_from_hf,
    llama.llama_to_hf, llama.global_weights, llama.layer_weights,
    presets={"iquestcoder-tiny": llama.TINY | dict(head_dim=32, attention_bias=True, mlp_bias=True)})
