"""Arcee (AFM): Llama's layout with a plain MLP (``up_proj``, ``down_proj``, no gate) and the
squared ReLU (``hidden_act="relu2"``); one flag, ``attention_bias``, for q/k/v/o biases.

No AFM-4.5B preset: ``ArceeConfig``'s defaults are not that model's config.json (their
bos/eos ids lie outside their vocabulary), and nothing else here states it exactly.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig

# ArceeConfig's fields and defaults (transformers 5)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k != "pretraining_tp"}
          | dict(vocab_size=32000, hidden_size=2560, intermediate_size=18432, hidden_act="relu2",
                 max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001))
FEATURES = (llama.ROTARY - {"gated_mlp"}) | {"plain_mlp", "attention_bias", "attention_out_bias", "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    return llama.llama_from_hf(hf) | dict(mlp_type="plain")


def to_hf(a) -> dict:
    return llama.llama_to_hf(a)


ARCEE = Family(
    "arcee", ("arcee",), "ArceeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,  # mlp.up_proj and down_proj only (plain)
    presets={"arcee-tiny": llama.TINY | dict(mlp_type="plain", hidden_act="relu2", rms_norm_eps=1e-5)})
