"""GPTBigCode (StarCoder 1, SantaCoder): GPT-2's learned positions, LayerNorms and plain MLP
(``nn.Linear`` weights, tanh GELU) with multi-query attention (``multi_query``: one key/value
head; ``c_attn`` holds q, k and v in turn, the query's width that of all heads), else q|k|v
fused per head; biases everywhere; ``scale_attn_weights`` false: the attention scale 1.
"""

from __future__ import annotations

from shardzoo.models.hf import phi
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, special_tokens

PREFIX = "transformer."
# GPTBigCodeConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
              activation_function="gelu_pytorch_tanh", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
              layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True, use_cache=True,
              bos_token_id=50256, eos_token_id=50256, pad_token_id=None, attention_softmax_in_fp32=True,
              scale_attention_softmax_in_fp32=True, multi_query=True, add_cross_attention=False,
              tie_word_embeddings=True)
FEATURES = frozenset({"learned_positions", "layernorm", "pre_norms", "plain_mlp", "attention_bias",
                      "attention_out_bias", "mlp_bias", "multipliers"})


def from_hf(hf: HFConfig) -> dict:
    # float32 softmax: shardzoo's attention computes it so
    hf.ignore(*INERT, "n_ctx", "attention_softmax_in_fp32", "scale_attention_softmax_in_fp32")
    d = hf.get("n_embd")
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=hf.get("n_inner") or 4 * d,
                num_hidden_layers=hf.get("n_layer"), num_attention_heads=hf.get("n_head"),
                num_key_value_heads=1 if hf.get("multi_query") else None,
                attention_multiplier=None if hf.get("scale_attn_weights") else 1.0,
                max_position_embeddings=hf.get("n_positions"), rms_norm_eps=hf.get("layer_norm_epsilon"),
                hidden_act=hf.get("activation_function"), mlp_type="plain", position_embedding="learned",
                norm_type="layernorm", attention_bias=True, attention_out_bias=True, mlp_bias=True,
                tie_word_embeddings=hf.get("tie_word_embeddings"), initializer_range=hf.get("initializer_range"),
                **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(n_embd=a.hidden_size, n_inner=a.intermediate_size, n_layer=a.num_hidden_layers,
                n_head=a.num_attention_heads, n_positions=a.max_position_embeddings, layer_norm_epsilon=a.rms_norm_eps,
                activation_function=a.hidden_act, multi_query=a.kv_heads == 1 < a.num_attention_heads,
                scale_attn_weights=a.attention_multiplier is None)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "wte.weight"), Weight(("pos_embed", "embedding"), PREFIX + "wpe.weight")]
    out += phi._both(("final_norm",), PREFIX + "ln_f")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h, heads = PREFIX + "h.{i}.", a.num_attention_heads
    out = phi._both(("attn_norm",), h + "ln_1") + phi._both(("mlp_norm",), h + "ln_2")
    # multi-query: [q of every head | k | v]; else each head's q, k, v in turn
    fused = dict(widths=(heads, 1, 1)) if a.kv_heads == 1 < heads else dict(groups=heads)
    for j, n in enumerate("qkv"):
        out += [Weight(("attn", n, "kernel"), h + "attn.c_attn.weight", "linear", part=(j, 3), **fused),
                Weight(("attn", n, "bias"), h + "attn.c_attn.bias", "vec", part=(j, 3), **fused)]
    out += [Weight(("attn", "o", "kernel"), h + "attn.c_proj.weight", "linear", n_in=2),
            Weight(("attn", "o", "bias"), h + "attn.c_proj.bias", "vec")]
    for leaf, name in (("up", "c_fc"), ("down", "c_proj")):
        out += [Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"),
                Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")]
    return out


BASE = dict(position_embedding="learned", norm_type="layernorm", mlp_type="plain", hidden_act="gelu_pytorch_tanh",
            rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=True, mlp_bias=True, num_key_value_heads=1,
            tie_word_embeddings=True, vocab_size=49152, max_position_embeddings=8192, bos_token_id=0,
            eos_token_id=0)
GPT_BIGCODE = Family(
    "gpt_bigcode", ("gpt_bigcode",), "GPTBigCodeForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights,
    presets={
        # bigcode/starcoderbase-1b/config.json
        "starcoderbase-1b": BASE | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                        num_attention_heads=16),
        "gpt-bigcode-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=256, bos_token_id=None,
                                        eos_token_id=None),
    })
