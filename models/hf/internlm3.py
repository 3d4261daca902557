"""InternLM3: Llama's model (transformers computes it with LlamaForCausalLM) with its own config
names for the biases, ``qkv_bias`` (q/k/v/o) and ``bias`` (the MLP), read either way, and
``head_dim`` 128 by default.
"""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig

# InternLM3Config's fields and defaults (transformers 5.25)
SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k != "pretraining_tp"}
          | dict(vocab_size=128512, hidden_size=4096, intermediate_size=10240, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-5,
                 pad_token_id=2, bos_token_id=1, eos_token_id=2, head_dim=128, qkv_bias=None, bias=None))


def from_hf(hf: HFConfig) -> dict:
    fields = llama.llama_from_hf(hf)
    attention, mlp = hf.get("qkv_bias"), hf.get("bias")  # the published config.json's names
    if attention is not None:
        fields |= dict(attention_bias=attention, attention_out_bias=attention)
    return fields | ({} if mlp is None else dict(mlp_bias=mlp))


# transformers 5 has no InternLM3ForCausalLM: AutoModelForCausalLM builds a LlamaForCausalLM
INTERNLM3 = Family(
    "internlm3", ("internlm3",), "LlamaForCausalLM", SCHEMA, llama.LLAMA_FEATURES, from_hf, llama.llama_to_hf,
    llama.global_weights, llama.layer_weights,
    presets={"internlm3-tiny": llama.TINY | dict(head_dim=16, attention_bias=True, mlp_bias=True)})
