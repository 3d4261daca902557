"""OpenAI GPT (GPT-1, ``model_type`` openai-gpt): GPT-2's tensors (``Conv1D`` weights (in, out),
q|k|v fused in ``c_attn``) in post-LN blocks: ``h = ln_1(x + attn(x))``, then ``ln_2(h + mlp(h))``
(block form ``post_residual``), no final norm, learned positions, the head tied to the embeddings;
the MLP 4 x n_embd wide. ``afn`` "gelu" is transformers' tanh GELU (``gelu_new``).
"""

from __future__ import annotations

from shardzoo.models.hf.base import INERT, Family, HFConfig, HFError, Weight, special_tokens
from shardzoo.models.hf.gpt2 import layer_weights as gpt2_layer_weights

PREFIX = "transformer."
# OpenAIGPTConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=40478, n_positions=512, n_embd=768, n_layer=12, n_head=12, afn="gelu", resid_pdrop=0.1,
              embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5, initializer_range=0.02,
              summary_type="cls_index", summary_use_proj=True, summary_activation=None, summary_proj_to_labels=True,
              summary_first_dropout=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
              tie_word_embeddings=True)
FEATURES = frozenset({"learned_positions", "layernorm", "pre_norms", "post_residual_norms", "plain_mlp", "attention_bias",
                      "attention_out_bias", "mlp_bias"})  # pre_norms: norm_position "pre", which post_residual asks
ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}  # modeling_openai's ACT_FNS


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    afn = hf.get("afn")
    if afn not in ACTIVATIONS:
        raise hf.refuse("afn", f"not one of {', '.join(ACTIVATIONS)}")
    if not hf.get("tie_word_embeddings"):
        raise hf.refuse("tie_word_embeddings", "OpenAIGPTLMHeadModel ties its head to the embeddings")
    d = hf.get("n_embd")
    return dict(
        vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=4 * d, num_hidden_layers=hf.get("n_layer"),
        num_attention_heads=hf.get("n_head"), max_position_embeddings=hf.get("n_positions"),
        rms_norm_eps=hf.get("layer_norm_epsilon"), hidden_act=ACTIVATIONS[afn], mlp_type="plain",
        position_embedding="learned", norm_type="layernorm", block_form="post_residual", attention_bias=True,
        attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True,
        initializer_range=hf.get("initializer_range"), **special_tokens(hf))


def to_hf(a) -> dict:
    if a.intermediate_size != 4 * a.hidden_size:
        raise HFError(f"openai-gpt's MLP is 4 x n_embd wide: intermediate_size={a.intermediate_size} is not "
                      f"4 x hidden_size={a.hidden_size}")
    afn = {v: k for k, v in reversed(ACTIVATIONS.items())}.get(a.hidden_act)
    if afn is None:
        raise HFError(f"openai-gpt has no activation hidden_act={a.hidden_act!r}; it has {', '.join(ACTIVATIONS)}")
    return dict(n_embd=a.hidden_size, n_layer=a.num_hidden_layers, n_head=a.num_attention_heads,
                n_positions=a.max_position_embeddings, layer_norm_epsilon=a.rms_norm_eps, afn=afn)


def global_weights(a) -> list[Weight]:
    return [Weight(("embed", "embedding"), PREFIX + "tokens_embed.weight"),
            Weight(("pos_embed", "embedding"), PREFIX + "positions_embed.weight")]


def layer_weights(a, spec) -> list[Weight]:
    return gpt2_layer_weights(a, spec)  # the same names: h.{i}.ln_1, ln_2, attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj


BASE = dict(mlp_type="plain", position_embedding="learned", norm_type="layernorm", block_form="post_residual",
            attention_bias=True, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True,
            hidden_act="gelu_new", rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)
OPENAI_GPT = Family(
    "openai-gpt", ("openai-gpt",), "OpenAIGPTLMHeadModel", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
    layer_weights,
    presets={
        # openai-community/openai-gpt: OpenAIGPTConfig's defaults (its docstring: "a similar configuration to that of
        # the openai-community/openai-gpt architecture"; the config.json of the Hub sets no other size)
        "openai-gpt": BASE | dict(vocab_size=40478, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                  num_attention_heads=12, max_position_embeddings=512),
    })
