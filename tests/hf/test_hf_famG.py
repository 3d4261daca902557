"""Families famG brought: OpenAI GPT (GPT-1's post-LN blocks, block form ``post_residual``),
GPT-NeoX-Japanese (an attention output bias on the last layer only: ``attention_out_bias_layers``),
DiffLlama (differential attention: ``diff_attention``, models/differential.py), BitNet (sub-norms before
the o and down projections: ``sub_norms``; BitLinear's quantization refused), RecurrentGemma (the RG-LRU's
recurrent blocks, models/rglru.py, beside local attention).

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal; each new mechanism moves the logits,
and runs under fsdp_tp on 8 devices once. Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import (
    AutoModelForCausalLM,
    BitNetConfig,
    DiffLlamaConfig,
    GPTNeoXJapaneseConfig,
    OpenAIGPTConfig,
    RecurrentGemmaConfig,
)

from shardzoo.models.hf import config_to_hf, load_hf_config
from shardzoo.models.hf.base import HFError
from shardzoo.models.transformer import Transformer
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    config_of,
    edit,
    fsdp_tp_parity,
    hf_logits,
    near_one,
    one_device,
    randomized,
    rewritten,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

CONFIGS = {
    # post-LN blocks, learned positions, the tanh GELU, biases everywhere, the head tied
    "openai-gpt": lambda: OpenAIGPTConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    # three layers (two scanned, the last with its output bias unrolled), rotary on half of each head, an
    # MLP twice as wide, an untied head
    "gpt_neox_japanese": lambda: GPTNeoXJapaneseConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_multiple_size=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None),
    # differential attention over 8 query heads and 4 kv heads (two pairs of value heads), q/k/v/o biases;
    # three layers, each its own lambda_init
    "diffllama": lambda: DiffLlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=4, attention_bias=True, bos_token_id=None, eos_token_id=None),
    # sub-norms before o_proj and down_proj, a gated relu2 MLP, GQA, q/k/v/o biases
    "bitnet": lambda: BitNetConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                   bos_token_id=None, eos_token_id=None),
    # recurrent, recurrent, local attention (a window of 6, two kv heads, rotary on half of each head)
    # layers; the RG-LRU 48 wide in 4 blocks; the embeddings scaled by sqrt(32) in bfloat16
    "recurrent_gemma": lambda: RecurrentGemmaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, lru_width=48, attention_window_size=6, logits_soft_cap=5.0,
        bos_token_id=None, eos_token_id=None),
}
SEEDS = {"openai-gpt": 2, "gpt_neox_japanese": 4}  # else 0; each with a varied greedy continuation
# LayerNorm scales near 1 (GPT-1's ln_1, ln_2); its post-LN layers want large weights (0.5 x normal) to
# continue a prompt with more than a repeated token
DRAWS = {"openai-gpt": near_one(lambda name, p: ".ln_" in name and name.endswith("weight"), std=0.5, scale_std=0.3),
         "gpt_neox_japanese": near_one(lambda name, p: "layernorm" in name and name.endswith("weight")),
         # the lambdas 0.3 x normal: lambda_q . lambda_k spreads over about 0.4
         "diffllama": lambda name, p: (1 + 0.1 * torch.randn_like(p) if "norm" in name
                                       else 0.3 * torch.randn_like(p) if "lambda" in name
                                       else 0.15 * torch.randn_like(p)),
         # Gemma's (1 + w) norms: w near 0; the rest 0.3 x normal (a varied greedy continuation)
         "recurrent_gemma": lambda name, p: 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p)}
_BUILT = {}


def _build(name, tmp_path_factory):
    """(HF dir, HF model, reference logits), made once per config in this file."""
    if name not in _BUILT:
        model = randomized(CONFIGS[name](), SEEDS.get(name, 0), DRAWS.get(name, near_one()))
        _BUILT[name] = saved(model, tmp_path_factory.mktemp(name))
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``name -> _build(name)``: the one config a mechanism's test needs."""
    return lambda name: _build(name, tmp_path_factory)




# ------------------------------------------------------------------------ the new mechanisms
def _moved(config, params, ref, **change) -> float:
    """The largest logit difference to ``ref`` once ``config`` takes ``change``."""
    return np.abs(apply(Transformer(config.replace(**change)), params, one_device()) - ref).max()


def test_the_post_residual_block_matters(family):
    """GPT-1's norm(x + attn(x)) blocks with no final norm: its norms placed before attention and
    MLP instead (with a final norm of scale 1, bias 0) give other logits; the model has no final norm."""
    path, _, ref = family("openai-gpt")
    _, config, params = load_hf(path, mesh=one_device())
    assert config.block_form == "post_residual" and "final_norm" not in params
    final = {"scale": np.ones(32, np.float32), "bias": np.zeros(32, np.float32)}
    assert _moved(config, dict(params, final_norm=final), ref, block_form="sequential") > 1e-2


def test_the_post_residual_block_under_fsdp_tp(family):
    """GPT-1's post-LN block: logits equal transformers' on 8 devices under fsdp_tp."""
    path, _, ref = family("openai-gpt")
    fsdp_tp_parity(path, ref)


def test_the_last_layers_own_output_bias_matters(family):
    """GPT-NeoX-Japanese's layers have no output bias but the last: it is unrolled beside the scanned
    others, and zeroing it moves the logits."""
    path, _, ref = family("gpt_neox_japanese")
    module, config, params = load_hf(path, mesh=one_device())
    assert config.arch.attention_out_bias_layers == (False, False, True)
    assert "bias" in params["layers_2"]["attn"]["o"] and "bias" not in params["layers"]["attn"]["o"]
    zeroed = edit(params, "['layers_2']['attn']['o']['bias']", np.zeros_like)
    assert np.abs(apply(module, zeroed, one_device()) - ref).max() > 1e-2


def test_the_per_layer_output_bias_under_fsdp_tp(family):
    """The last layer's own output bias: logits equal transformers' on 8 devices under fsdp_tp."""
    path, _, ref = family("gpt_neox_japanese")
    fsdp_tp_parity(path, ref)


def test_differential_attention_matters(family):
    """DiffLlama's layers each with their own lambda_init; the second softmax's share (the lambdas)
    moves the logits, and so does lambda_init."""
    path, _, ref = family("diffllama")
    module, config, params = load_hf(path, mesh=one_device())
    inits = [s.lambda_init for s in config.arch.layer_specs()]
    assert len(set(inits)) == 3 and inits[0] == 0.8 - 0.6
    shifted = edit(params, "['lambda_q2']", lambda x: x + 0.5)
    assert np.abs(apply(module, shifted, one_device()) - ref).max() > 1e-2


def test_differential_attention_under_fsdp_tp(family):
    """Differential attention: logits equal transformers' on 8 devices under fsdp_tp (its layers unrolled:
    each has its own lambda_init)."""
    path, _, ref = family("diffllama")
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    assert params["layers_0"]["attn"]["q"]["kernel"].sharding.spec == P("fsdp", "tensor", None)
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


def test_the_sub_norms_matter(family):
    """BitNet's norms of attention's output and of the MLP's hidden features: their weights scaled
    (attention's, then the MLP's) move the logits."""
    path, _, ref = family("bitnet")
    module, _, params = load_hf(path, mesh=one_device())
    for sub in ("['attn']['sub_norm']['scale']", "['mlp']['sub_norm']['scale']"):
        assert np.abs(apply(module, edit(params, sub, lambda x: 2 * x), one_device()) - ref).max() > 1e-2


def test_the_sub_norms_under_fsdp_tp(family):
    """BitNet's sub-norms (attention's over heads split by tensor): logits equal transformers' on 8
    devices under fsdp_tp."""
    path, _, ref = family("bitnet")
    fsdp_tp_parity(path, ref)


def test_bitlinear_online_quantization(family, tmp_path):
    """BitNet's config.json with BitLinear's online quantization (ternary weights, 8-bit inputs per
    token): logits equal transformers' (its AutoBitLinear) on one device and on 8 under fsdp_tp,
    and differ from the unquantized model's; the export writes the quantization_config back."""
    path, _, plain = family("bitnet")
    online = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}
    quantized = rewritten(path, tmp_path / "q", quantization_config=online)
    torch._dynamo.config.disable = True  # transformers' quantizers are torch.compile'd: run them eagerly
    try:
        model = AutoModelForCausalLM.from_pretrained(quantized, attn_implementation="eager").eval()
        ref = hf_logits(model)
    finally:
        torch._dynamo.config.disable = False
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "AutoBitLinear"
    assert np.abs(ref - plain).max() > 1e-2
    module, config, params = load_hf(quantized, mesh=one_device())
    assert config.arch.bitlinear
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    fsdp_tp_parity(quantized, ref)
    assert config_to_hf(config, family="bitnet")["quantization_config"] == online


def test_a_packed_bitnet_checkpoint_is_refused(family, tmp_path):
    """Weights packed four to a byte (the published deployment checkpoint's quantization_config): one line naming it."""
    path, _, _ = family("bitnet")
    packed = rewritten(path, tmp_path / "q", quantization_config={
        "quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"})
    with pytest.raises(HFError, match="quantization_config") as e:
        load_hf_config(packed)
    assert len(str(e.value).splitlines()) == 1


def test_the_recurrent_blocks_matter(family):
    """RecurrentGemma's RG-LRU: its decays (recurrent_param) and its input gate move the logits; the
    two recurrent layers scanned, the attention layer unrolled."""
    path, _, ref = family("recurrent_gemma")
    module, config, params = load_hf(path, mesh=one_device())
    assert config.arch.rglru.lru_width == 48 and "recurrent" in params["layers"] and "attn" in params["layers_2"]
    for leaf in ("['recurrent_param']", "['input_gate_bias']"):
        moved = apply(module, edit(params, leaf, lambda x: x + 1.0), one_device())
        assert np.abs(moved - ref).max() > 1e-2, leaf


def test_the_recurrent_blocks_under_fsdp_tp(family):
    """The recurrent block (its blocks over tensor) and local attention: logits equal transformers' on 8
    devices under fsdp_tp."""
    path, _, ref = family("recurrent_gemma")

    def q(config, params):
        return params["layers_2"]["attn"]["q"]["kernel"]

    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    assert q(None, params).sharding.spec == P("fsdp", "tensor", None)
    assert params["layers"]["recurrent"]["linear_x"]["kernel"].sharding.spec == P(None, "fsdp", "tensor", None)
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


# published config.json files (google/recurrentgemma-2b, -9b as their mirrors hold them)
RG = dict(model_type="recurrent_gemma", architectures=["RecurrentGemmaForCausalLM"], attention_bias=False,
          attention_window_size=2048, block_types=["recurrent", "recurrent", "attention"], bos_token_id=2,
          conv1d_width=4, eos_token_id=1, hidden_activation="gelu_pytorch_tanh", logits_soft_cap=30.0,
          num_key_value_heads=1, pad_token_id=0, partial_rotary_factor=0.5, rms_norm_eps=1e-6, rope_theta=10000.0,
          vocab_size=256000, embeddings_scale_by_sqrt_dim=True, w_init_variance_scale=0.01)
PUBLISHED = {
    "recurrentgemma-2b": RG | dict(hidden_size=2560, intermediate_size=15360, lru_width=2560, num_attention_heads=10,
                                   num_hidden_layers=26, head_dim=256),
    "recurrentgemma-9b": RG | dict(hidden_size=4096, intermediate_size=24576, lru_width=4096, num_attention_heads=16,
                                   num_hidden_layers=38, head_dim=256),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_read_as_published_and_count_as_transformers_on_the_meta_device(name):
    """A preset is its published config.json as the import reads it, with as many parameters as
    transformers builds from that config.json on the meta device."""
    from transformers import AutoConfig

    from shardzoo.models.hf.registry import PRESETS

    assert config_of(PUBLISHED[name]).arch == PRESETS[name].arch
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PUBLISHED[name]))
    assert PRESETS[name].num_params() == sum(p.numel() for p in model.parameters())
