"""GPT-Neo (EleutherAI): GPT-2's learned positions, LayerNorms and plain GELU MLP (here
``nn.Linear`` weights, out x in), global and local attention layers (``attention_types``, a
window of ``window_size`` keys: Hugging Face's ``layer_types``) with no scaling of the logits
(the attention scale 1), q/k/v without biases and a biased output projection.
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import phi
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, layer_types, special_tokens

PREFIX = "transformer."
# GPTNeoConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=50257, max_position_embeddings=2048, hidden_size=2048, num_layers=24, attention_types=None,
              num_heads=16, intermediate_size=None, window_size=256, activation_function="gelu_new",
              resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.1,
              layer_norm_epsilon=1e-5, initializer_range=0.02, use_cache=True, bos_token_id=50256,
              eos_token_id=50256, pad_token_id=None, tie_word_embeddings=True)
ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "num_layers"}
FEATURES = frozenset({"learned_positions", "layernorm", "pre_norms", "plain_mlp", "attention_out_bias", "mlp_bias",
                      "sliding_window", "layer_pattern", "multipliers"})
KINDS = {"global": FULL, "local": SLIDING}


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)
    hf.ignore(*INERT, "resid_dropout", "embed_dropout", "classifier_dropout", "attention_layers")
    n, d = hf.get("num_layers"), hf.get("hidden_size")
    kinds = [k for pattern, times in hf.get("attention_types") or [[["global", "local"], n // 2]]
             for _ in range(times) for k in pattern]
    if len(kinds) != n or any(k not in KINDS for k in kinds):
        raise hf.refuse("attention_types", f"must give {n} layers (num_layers), each 'global' or 'local'")
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=hf.get("intermediate_size") or 4 * d,
                num_hidden_layers=n, num_attention_heads=hf.get("num_heads"),
                max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=hf.get("layer_norm_epsilon"),
                hidden_act=hf.get("activation_function"), mlp_type="plain", position_embedding="learned",
                norm_type="layernorm", attention_out_bias=True, mlp_bias=True, attention_multiplier=1.0,
                layer_types=tuple(KINDS[k] for k in kinds), sliding_window=hf.get("window_size"),
                tie_word_embeddings=hf.get("tie_word_embeddings"), initializer_range=hf.get("initializer_range"),
                **special_tokens(hf))


def to_hf(a) -> dict:
    names = {v: k for k, v in KINDS.items()}
    kinds = [names[t] for t in layer_types(a)]
    period = next(p for p in range(1, len(kinds) + 1) if len(kinds) % p == 0 and kinds == kinds[:p] * (len(kinds) // p))
    return dict(hidden_size=a.hidden_size, num_layers=a.num_hidden_layers, num_heads=a.num_attention_heads,
                intermediate_size=None if a.intermediate_size == 4 * a.hidden_size else a.intermediate_size,
                max_position_embeddings=a.max_position_embeddings,
                layer_norm_epsilon=a.rms_norm_eps, activation_function=a.hidden_act,
                attention_types=[[kinds[:period], len(kinds) // period]], window_size=a.sliding_window or 256)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "wte.weight"), Weight(("pos_embed", "embedding"), PREFIX + "wpe.weight")]
    out += phi._both(("final_norm",), PREFIX + "ln_f")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h = PREFIX + "h.{i}."
    out = phi._both(("attn_norm",), h + "ln_1") + phi._both(("mlp_norm",), h + "ln_2")
    out += [Weight(("attn", n, "kernel"), h + f"attn.attention.{n}_proj.weight", "linear") for n in "qkv"]
    out += [Weight(("attn", "o", "kernel"), h + "attn.attention.out_proj.weight", "linear", n_in=2),
            Weight(("attn", "o", "bias"), h + "attn.attention.out_proj.bias", "vec")]
    for leaf, name in (("up", "c_fc"), ("down", "c_proj")):
        out += [Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"),
                Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")]
    return out


def _alternating(n: int) -> tuple[str, ...]:
    return (FULL, SLIDING) * (n // 2)


BASE = dict(position_embedding="learned", norm_type="layernorm", mlp_type="plain", hidden_act="gelu_new",
            rms_norm_eps=1e-5, attention_out_bias=True, mlp_bias=True, attention_multiplier=1.0,
            tie_word_embeddings=True, vocab_size=50257, max_position_embeddings=2048, sliding_window=256,
            bos_token_id=50256, eos_token_id=50256)
GPT_NEO = Family(
    "gpt_neo", ("gpt_neo",), "GPTNeoForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # EleutherAI/gpt-neo-125M/config.json and EleutherAI/gpt-neo-1.3B/config.json
        "gpt-neo-125m": BASE | dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                    num_attention_heads=12, layer_types=_alternating(12)),
        "gpt-neo-1.3b": BASE | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                    num_attention_heads=16, layer_types=_alternating(24)),
        "gpt-neo-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256, sliding_window=4,
                                    layer_types=_alternating(2), bos_token_id=None, eos_token_id=None),
    })
