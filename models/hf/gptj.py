"""GPT-J: attention and MLP side by side from one LayerNorm (``ln_1``: x + attn(n) + mlp(n), as
Phi), rotary embeddings (base 10000) on the first ``rotary_dim`` of each head turning interleaved
pairs, q/k/v/out projections without biases, a plain GELU MLP with biases (``fc_in``,
``fc_out``), a final LayerNorm and a biased output head; GPT-2's config names.
"""

from __future__ import annotations

from shardzoo.models.hf import phi
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, special_tokens

PREFIX = "transformer."
# GPTJConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_inner=None,
              activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
              layer_norm_epsilon=1e-5, initializer_range=0.02, use_cache=True, bos_token_id=50256,
              eos_token_id=50256, pad_token_id=None, tie_word_embeddings=False)
FEATURES = frozenset({"rope", "partial_rotary", "rope_interleaved", "layernorm", "pre_norms", "parallel_residual",
                      "plain_mlp", "mlp_bias", "lm_head_bias"})


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "n_ctx")
    d, heads, rotary = hf.get("n_embd"), hf.get("n_head"), hf.get("rotary_dim")
    if not isinstance(rotary, int) or not 0 < rotary <= d // heads or rotary % 2:
        raise hf.refuse("rotary_dim", f"must be an even number of dimensions of a head (at most {d // heads})")
    return dict(
        vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=hf.get("n_inner") or 4 * d,
        num_hidden_layers=hf.get("n_layer"), num_attention_heads=heads, max_position_embeddings=hf.get("n_positions"),
        rms_norm_eps=hf.get("layer_norm_epsilon"), hidden_act=hf.get("activation_function"), mlp_type="plain",
        norm_type="layernorm", block_form="parallel", mlp_bias=True, lm_head_bias=True, rope_interleaved=True,
        rope_theta=10000.0, partial_rotary_factor=rotary / (d // heads),
        tie_word_embeddings=hf.get("tie_word_embeddings"), initializer_range=hf.get("initializer_range"),
        **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(n_embd=a.hidden_size, n_inner=a.intermediate_size, n_layer=a.num_hidden_layers,
                n_head=a.num_attention_heads, n_positions=a.max_position_embeddings,
                rotary_dim=round(a.head_size * a.partial_rotary_factor), layer_norm_epsilon=a.rms_norm_eps,
                activation_function=a.hidden_act)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "wte.weight")] + phi._both(("final_norm",), PREFIX + "ln_f")
    if a.tie_word_embeddings:
        return out + [Weight(("lm_head_bias",), "lm_head.bias", "vec")]
    return out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear"),
                  Weight(("lm_head", "bias"), "lm_head.bias", "vec")]


def layer_weights(a, spec) -> list[Weight]:
    h = PREFIX + "h.{i}."
    out = phi._both(("attn_norm",), h + "ln_1")
    out += [Weight(("attn", n, "kernel"), h + f"attn.{n}_proj.weight", "linear") for n in "qkv"]
    out.append(Weight(("attn", "o", "kernel"), h + "attn.out_proj.weight", "linear", n_in=2))
    for leaf, name in (("up", "fc_in"), ("down", "fc_out")):
        out += [Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"),
                Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")]
    return out


BASE = dict(norm_type="layernorm", mlp_type="plain", block_form="parallel", hidden_act="gelu_new", rms_norm_eps=1e-5,
            mlp_bias=True, lm_head_bias=True, rope_interleaved=True)
GPTJ = Family(
    "gptj", ("gptj",), "GPTJForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # EleutherAI/gpt-j-6b/config.json
        "gpt-j-6b": BASE | dict(vocab_size=50400, hidden_size=4096, intermediate_size=16384, num_hidden_layers=28,
                                num_attention_heads=16, max_position_embeddings=2048, partial_rotary_factor=0.25,
                                bos_token_id=50256, eos_token_id=50256),
        "gptj-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=256, partial_rotary_factor=0.5,
                                 bos_token_id=None, eos_token_id=None),
    })
