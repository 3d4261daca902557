"""The classic decoder families whose mechanisms are about positions and attention biases: BLOOM
(ALiBi, a LayerNorm of the embeddings, q|k|v fused per head), MPT (ALiBi, clipped q/k/v, its own
attention scale, LayerNorms without bias), OPT (a learned table read at position + 2), GPT-Neo
(global and local layers, unscaled logits), GPTBigCode (StarCoder 1: multi-query, q|k|v fused),
CodeGen (GPT-J with q, v, k fused across 4 shards), XGLM (sinusoids at position + 2, scaled
embeddings) and BioGPT (OPT's table and layers, scaled embeddings).

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal; each new mechanism switched off
moves the logits; ALiBi (its component's sharded check) on BLOOM under fsdp_tp and in a
left-padded batch; splash attention refused for ALiBi. Presets read as the published
config.json and count as transformers on the meta device. Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BioGptConfig,
    BloomConfig,
    CodeGenConfig,
    GPTBigCodeConfig,
    GPTNeoConfig,
    MptConfig,
    OPTConfig,
    XGLMConfig,
)

import shardzoo.models.attention as attn
from shardzoo.models import ModelError, get_model
from shardzoo.models.alibi import slopes
from shardzoo.models.attention import attention_kernel
from shardzoo.models.hf import HFError
from shardzoo.models.hf.registry import PRESETS
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.program import Program

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    config_of,
    fsdp_tp_parity,
    left_padded_generates_alone,
    near_one,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    # ALiBi over 6 heads (slopes of a non-power of two), the embeddings' LayerNorm, q|k|v per head
    "bloom": lambda: BloomConfig(vocab_size=128, hidden_size=48, n_layer=2, n_head=6, tie_word_embeddings=False,
                                 **NO_IDS),
    # ALiBi, q/k/v clamped to 0.5 (the draw's projections pass it), the logits scaled by 0.3
    "mpt": lambda: MptConfig(vocab_size=128, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                             attn_config=dict(clip_qkv=0.5, softmax_scale=0.3), **NO_IDS),
    # the table at position + 2, relu
    "opt": lambda: OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=64, tie_word_embeddings=False, **NO_IDS),
    # a global then a local layer (a window of 4 in a text of 16), unscaled logits
    "gpt_neo": lambda: GPTNeoConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                    attention_types=[[["global", "local"], 1]], max_position_embeddings=64, **NO_IDS),
    # multi-query: [q of 4 heads | k | v] in c_attn
    "gpt_bigcode": lambda: GPTBigCodeConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, **NO_IDS),
    # GPT-J's block, q|v|k fused across 4 shards, rotary on 8 of 16 features
    "codegen": lambda: CodeGenConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
                                     **NO_IDS),
    # sinusoids at position + 2, embeddings x sqrt(32)
    "xglm": lambda: XGLMConfig(vocab_size=128, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4,
                               max_position_embeddings=64, tie_word_embeddings=False, **NO_IDS),
    "biogpt": lambda: BioGptConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
                                   **NO_IDS),
}
# else 0; each with a varied greedy continuation (a tied head over large embeddings repeats the
# last token: BLOOM, OPT, XGLM and BioGPT untie theirs here; MPT, GPT-Neo and GPTBigCode tie)
SEEDS = {"mpt": 1, "gpt_bigcode": 1, "codegen": 1, "opt": 1}
# LayerNorm scales near 1 whatever their name (ln_1, norm_1, word_embeddings_layernorm, layer_norm)
DRAW = near_one(lambda name, p: ("norm" in name or "ln_" in name) and name.endswith("weight"))


_BUILT = {}


def tiny(family, tmp_path_factory):
    """(HF dir, HF model, reference logits) of ``family``, built once for the module: every
    weight random, LayerNorm scales near 1."""
    if family not in _BUILT:
        model = randomized(CONFIGS[family](), SEEDS.get(family, 0), DRAW)
        _BUILT[family] = saved(model, tmp_path_factory.mktemp(family))
    return _BUILT[family]


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    return tiny(request.param, tmp_path_factory)


# each family's new mechanism off: (the fields replaced, what it was)
SWITCHED_OFF = {
    "bloom": [dict(position_embedding="rope", rope_layers=(False, False)),  # ALiBi -> no positions
              dict(embedding_norm=False)],
    "mpt": [dict(position_embedding="rope", rope_layers=(False, False)), dict(clip_qkv=None)],
    # the offset one less (a table of as many rows): each token reads the row before its own
    "opt": [dict(position_offset=1, max_position_embeddings=65)],
    "gpt_neo": [dict(attention_multiplier=None), dict(sliding_window=64)],  # the local layer global
    "xglm": [dict(position_offset=0), dict(position_embedding="rope", rope_layers=(False, False))],
}


@pytest.mark.parametrize("family", list(SWITCHED_OFF))
def test_each_new_mechanism_moves_the_logits(family, tmp_path_factory):
    """With the mechanism off (the same weights) the logits move by more than 1e-2, where with it
    on they are transformers' (test_logits_match_on_one_device)."""
    path, _, ref = tiny(family, tmp_path_factory)
    _, config, params = load_hf(path, mesh=one_device())
    for fields in SWITCHED_OFF[family]:
        got = apply(config.replace(**fields).build(), params, one_device())
        assert np.abs(got - ref).max() > 1e-2, fields


# ------------------------------------------------------------------------------------- ALiBi
def test_alibi_slopes_are_bloom_and_mpt_slopes():
    """BLOOM's and MPT's formulas give the same slopes (MPT's bias maximum 8), for any head count."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for heads in range(1, 41):
        np.testing.assert_allclose(slopes(heads), _get_alibi_slopes(heads, "cpu").numpy(), rtol=1e-6, atol=0)
        mpt = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0].numpy()  # the bias one key back: -slope
        np.testing.assert_allclose(slopes(heads), mpt, rtol=1e-6, atol=0)


def test_alibi_under_fsdp_tp_and_in_a_left_padded_batch(tmp_path_factory):
    """ALiBi's sharded check (on BLOOM): logits equal transformers' on one device and on 8 under
    fsdp_tp (heads split over tensor: each shard's slopes are its heads'); a left-padded row decodes
    as it does alone (the bias by cache slot, the same offset for a row's query and keys)."""
    path, _, ref = tiny("bloom", tmp_path_factory)
    fsdp_tp_parity(path, ref)
    _, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    left_padded_generates_alone(Program(config, get_rules("fsdp"), one_device()), params)


def test_alibi_in_a_packed_row_is_each_segment_alone(tmp_path_factory):
    """Two texts of 8 packed in one row (segment ids 1, 2; positions restarting) give each text's
    logits alone: the bias is relative to the query's own position."""
    path, _, _ = tiny("bloom", tmp_path_factory)
    module, _, params = load_hf(path, mesh=one_device())
    fn = jax.jit(lambda p, t, pos, seg: module.apply({"params": p}, t, pos, seg))
    texts = TOKENS[:2, :8]
    alone = np.asarray(fn(params, texts, np.broadcast_to(np.arange(8), (2, 8)), None))
    packed = texts.reshape(1, 16)
    positions, segments = np.tile(np.arange(8), 2)[None], np.repeat([1, 2], 8)[None]
    got = np.asarray(fn(params, packed, positions, segments)).reshape(2, 8, -1)
    np.testing.assert_allclose(got, alone, atol=1e-5, rtol=0)


def test_alibi_runs_in_xla_attention_and_splash_or_cudnn_are_refused(monkeypatch):
    """splash attention has no input for a bias: ``auto`` takes XLA for ALiBi on a TPU, where it
    takes splash for GPT-2; an explicit splash or cuDNN is a one-line ModelError."""
    f32 = jnp.dtype("float32")
    monkeypatch.setattr(attn.jax, "default_backend", lambda: "tpu")
    assert attention_kernel(PRESETS["gpt2-tiny"], f32, 256) == "splash"
    assert attention_kernel(PRESETS["bloom-tiny"], f32, 256) == "xla"
    for impl in ("splash", "cudnn"):
        with pytest.raises(ModelError, match=r"position_embedding='alibi'.* use 'auto' or 'xla'") as e:
            get_model("bloom-tiny", attention_impl=impl)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------- config.json and presets
PUBLISHED = {  # the published config.json files (their fields that say something)
    # bigscience/bloom-560m, its first release's spelling (n_embed, num_attention_heads)
    "bloom-560m": dict(model_type="bloom", vocab_size=250880, n_embed=1024, n_layer=24, num_attention_heads=16,
                       layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3, offset_alibi=100,
                       apply_residual_connection_post_layernorm=False, skip_bias_add=True, pretraining_tp=1),
    "mpt-7b": dict(model_type="mpt", d_model=4096, n_heads=32, n_layers=32, expansion_ratio=4, max_seq_len=2048,
                   vocab_size=50432, learned_pos_emb=True, no_bias=True, norm_type="low_precision_layernorm",
                   embedding_fraction=1.0, init_device="cpu", logit_scale=None, use_cache=False,
                   attn_config=dict(alibi=True, alibi_bias_max=8, attn_impl="torch", attn_pdrop=0,
                                    attn_type="multihead_attention", attn_uses_sequence_id=False, clip_qkv=None,
                                    prefix_lm=False, qk_ln=False, softmax_scale=None)),
    "opt-125m": dict(model_type="opt", vocab_size=50272, hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
                     num_attention_heads=12, word_embed_proj_dim=768, do_layer_norm_before=True, pad_token_id=1,
                     bos_token_id=2, eos_token_id=2, max_position_embeddings=2048),
    "opt-1.3b": dict(model_type="opt", vocab_size=50272, hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                     num_attention_heads=32, word_embed_proj_dim=2048, do_layer_norm_before=True, pad_token_id=1,
                     bos_token_id=2, eos_token_id=2, max_position_embeddings=2048, enable_bias=True),
    "gpt-neo-125m": dict(model_type="gpt_neo", vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                         attention_types=[[["global", "local"], 6]], attention_layers=["global", "local"] * 6,
                         window_size=256, max_position_embeddings=2048, intermediate_size=None),
    "gpt-neo-1.3b": dict(model_type="gpt_neo", vocab_size=50257, hidden_size=2048, num_layers=24, num_heads=16,
                         attention_types=[[["global", "local"], 12]], window_size=256, max_position_embeddings=2048),
    "starcoderbase-1b": dict(model_type="gpt_bigcode", vocab_size=49152, n_embd=2048, n_head=16, n_inner=8192,
                             n_layer=24, n_positions=8192, multi_query=True, activation_function="gelu_pytorch_tanh",
                             bos_token_id=0, eos_token_id=0, attention_softmax_in_fp32=True),
    "codegen-350m": dict(model_type="codegen", vocab_size=51200, n_embd=1024, n_head=16, n_layer=20, n_ctx=2048,
                         n_positions=2048, rotary_dim=32, bos_token_id=1, eos_token_id=50256, tie_word_embeddings=False),
    "xglm-564m": dict(model_type="xglm", vocab_size=256008, d_model=1024, ffn_dim=4096, num_layers=24,
                      attention_heads=16, max_position_embeddings=2048, pad_token_id=1, bos_token_id=0,
                      eos_token_id=2, decoder_start_token_id=2, scale_embedding=True),
    "biogpt": dict(model_type="biogpt", vocab_size=42384, hidden_size=1024, intermediate_size=4096,
                   num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=1024, layer_norm_eps=1e-12,
                   pad_token_id=1, bos_token_id=0, eos_token_id=2, scale_embedding=True),
}
COUNTS = {"bloom-560m": 559_214_592, "mpt-7b": 6_649_286_656, "opt-125m": 125_239_296, "opt-1.3b": 1_315_758_080,
          "gpt-neo-125m": 125_198_592, "codegen-350m": 356_712_448, "xglm-564m": 564_463_616}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_read_as_published_and_count_as_transformers_on_the_meta_device(name):
    """A preset is its published config.json as the import reads it, and has as many parameters
    as transformers builds from that config.json on the meta device."""
    config = PRESETS[name]
    assert config_of(PUBLISHED[name]).arch == config.arch
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PUBLISHED[name]))
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert config.num_params() == COUNTS.get(name, config.num_params())


REFUSED = [  # (config.json, what the one-line refusal names)
    (PUBLISHED["mpt-7b"] | dict(attn_config=dict(qk_ln=True)), r"attn_config=.*qk_ln=True"),
    (PUBLISHED["mpt-7b"] | dict(attn_config=dict(alibi_bias_max=16)), r"alibi_bias_max=16"),
    (PUBLISHED["mpt-7b"] | dict(expansion_ratio=2), r"expansion_ratio=2"),
    (PUBLISHED["opt-125m"] | dict(do_layer_norm_before=False), r"do_layer_norm_before=False"),
    (PUBLISHED["opt-125m"] | dict(word_embed_proj_dim=512), r"word_embed_proj_dim=512"),
    (PUBLISHED["bloom-560m"] | dict(apply_residual_connection_post_layernorm=True),
     r"apply_residual_connection_post_layernorm=True"),
    (PUBLISHED["xglm-564m"] | dict(pad_token_id=5), r"pad_token_id=5"),
    (PUBLISHED["gpt-neo-125m"] | dict(attention_types=[[["global", "sparse"], 6]]), r"attention_types="),
]


@pytest.mark.parametrize("hf, match", REFUSED)
def test_what_the_families_cannot_compute_is_refused_naming_the_field(hf, match):
    with pytest.raises(HFError, match=match) as e:
        config_of(hf)
    assert "\n" not in str(e.value)
