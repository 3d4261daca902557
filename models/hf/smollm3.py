"""SmolLM3: Llama's tensors and config.json with NoPE layers: ``no_rope_layers`` gives each
layer 1 (rotary embeddings) or 0 (none; transformers' default: every
``no_rope_layer_interval``-th layer), shardzoo's ``rope_layers``. A window, behind
``use_sliding_window``, on the layers ``layer_types`` names (transformers' default: the NoPE
layers)."""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import llama
from shardzoo.models.hf.base import Family, HFConfig, layer_types

SCHEMA = ({k: v for k, v in llama.SCHEMA.items() if k not in ("pretraining_tp", "head_dim")}
          | dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768,
                 pad_token_id=128004, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=True,
                 use_sliding_window=False, sliding_window=None, no_rope_layers=None,
                 no_rope_layer_interval=4, layer_types=None))
FEATURES = llama.LLAMA_FEATURES | {"nope_layers", "sliding_window", "layer_pattern"}
THETA = 2000000.0  # SmolLM3Config's default base


def _every(interval: int, n: int) -> list[int]:
    return [int((i + 1) % interval != 0) for i in range(n)]


def from_hf(hf: HFConfig) -> dict:
    n = hf.get("num_hidden_layers")
    rotates = hf.get("no_rope_layers")  # at least n entries; 1: rotary, 0: NoPE
    if rotates is None:
        interval = hf.get("no_rope_layer_interval")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise hf.refuse("no_rope_layer_interval", "must be an integer >= 1")
        rotates = _every(interval, n)
    hf.ignore("no_rope_layer_interval")  # only what the list defaults to
    if len(rotates) < n or any(v not in (0, 1) for v in rotates):
        raise hf.refuse("no_rope_layers", f"must give each of the {n} layers 1 (rotary) or 0 (NoPE)")
    types = hf.get("layer_types")
    window, use = hf.get("sliding_window"), hf.get("use_sliding_window")
    if types is None:
        types = [SLIDING if use and window is not None and not r else FULL for r in rotates[:n]]
    if SLIDING in types and window is not None and not use:
        raise hf.refuse("use_sliding_window", f"{SLIDING} layers without use_sliding_window: transformers' "
                        "attention implementations disagree (the eager and sdpa masks slide, flash does not)")
    pattern = (dict(sliding_window=window, layer_types=tuple(types)) if window and SLIDING in types
               else dict(sliding_window=None, layer_types=None))
    bias = hf.get("attention_bias")  # one flag for q/k/v and o biases, as Llama's
    return llama.rotary_fields(hf, theta=THETA) | pattern | dict(
        attention_bias=bias, attention_out_bias=bias, mlp_bias=hf.get("mlp_bias"),
        rope_layers=tuple(bool(r) for r in rotates[:n]))


def to_hf(a) -> dict:
    rotates = [int(r) for r in (a.rope_layers or (True,) * a.num_hidden_layers)]
    n = a.num_hidden_layers
    default = SCHEMA["no_rope_layer_interval"]
    interval = next((k for k in (default, *range(1, n + 2)) if _every(k, n) == rotates),
                    None)  # the interval that gives this list (transformers' default first), if any
    types = layer_types(a)
    pad = SCHEMA["pad_token_id"]  # transformers' default pad id, where it fits the vocabulary
    return llama.llama_to_hf(a) | dict(
        pad_token_id=pad if pad < a.vocab_size else None,
        no_rope_layers=rotates, use_sliding_window=SLIDING in types, sliding_window=a.sliding_window,
        layer_types=types) | ({} if interval is None else dict(no_rope_layer_interval=interval))


# HuggingFaceTB/SmolLM3-3B: every 4th layer NoPE, no window, a tied head (bos/eos: SmolLM3Config's).
_NOPE_EVERY_4TH = tuple(bool(r) for r in _every(4, 36))
SMOLLM3 = Family(
    "smollm3", ("smollm3",), "SmolLM3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, llama.layer_weights,
    presets={
        "smollm3-3b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536,
                           rope_theta=5000000.0, tie_word_embeddings=True, bos_token_id=128000,
                           eos_token_id=128001, rope_layers=_NOPE_EVERY_4TH),
        # NoPE on layers 1 and 3, a window shorter than a test's text on layer 1 (one of them)
        "smollm3-tiny": llama.TINY | dict(num_hidden_layers=4, tie_word_embeddings=True, rope_theta=THETA,
                                          rope_layers=(True, False, True, False), sliding_window=8,
                                          layer_types=(FULL, SLIDING, FULL, FULL)),
    })
