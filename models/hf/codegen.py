"""CodeGen (Salesforce): GPT-J's model (``models/hf/gptj.py``: the parallel block, interleaved
rotary on ``rotary_dim`` features of each head, a biased output head) with q, k and v fused in
``qkv_proj`` as the 4 model-parallel shards it was trained on hold them: 4 blocks of columns,
each a quarter of every one of q, v and k in that order.
"""

from __future__ import annotations

from shardzoo.models.hf import gptj
from shardzoo.models.hf.base import Family, Weight

SHARDS = 4  # CodeGenAttention's mp_num
SCHEMA = gptj.SCHEMA | dict(n_ctx=2048)  # CodeGenConfig's fields and defaults (transformers 5.25)


def layer_weights(a, spec) -> list[Weight]:
    out = [w for w in gptj.layer_weights(a, spec) if not w.name.endswith(("q_proj.weight", "k_proj.weight",
                                                                           "v_proj.weight"))]
    qkv = gptj.PREFIX + "h.{i}.attn.qkv_proj.weight"
    return out + [Weight(("attn", n, "kernel"), qkv, "linear", part=(j, 3), groups=SHARDS)
                  for n, j in (("q", 0), ("v", 1), ("k", 2))]


CODEGEN = Family(
    "codegen", ("codegen",), "CodeGenForCausalLM", SCHEMA, gptj.FEATURES, gptj.from_hf, gptj.to_hf,
    gptj.global_weights, layer_weights,
    presets={
        # Salesforce/codegen-350M-mono/config.json
        "codegen-350m": gptj.BASE | dict(vocab_size=51200, hidden_size=1024, intermediate_size=4096,
                                         num_hidden_layers=20, num_attention_heads=16, max_position_embeddings=2048,
                                         partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=50256),
        "codegen-tiny": gptj.BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=256,
                                         partial_rotary_factor=0.5, bos_token_id=None, eos_token_id=None),
    })
