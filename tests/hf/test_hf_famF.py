"""Families of helper famF. New components, each with its own checks here (it moves the logits;
sharded equals one device): Ministral 3's query temperature on every layer (models/query_scaling.py
``Llama4Scaling``), nanochat's weightless RMSNorm (norm kind ``rmsnorm_no_weight``) and its reversed
rotary read as q/k heads with their halves swapped (``Weight.halves_swapped``), Kolibri's router
(``router_kind`` "logit_bias", under ep), LFM3's gate per attention head (``attn_head_gate``) and
proportional rotary (``rope_scaling`` type "proportional"). Mellum, Apertus 1.5's text model and
Lara Mini only combine existing components.

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits,
as for every family; 1e-5 between shardzoo's own sharded and one-device logits.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import (
    Apertus1p5TextConfig,
    Kolibri1Config,
    LaraMiniConfig,
    Lfm3Config,
    MellumConfig,
    Ministral3Config,
    NanoChatConfig,
)

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    edit,
    fsdp_tp_parity,
    load_ep,
    mamba_draw,
    one_device,
    randomize,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)
from test_hf_combined_families2 import router_bias  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# YaRN x2 over 8 positions; queries from position 8 on scaled by 1 + 0.3 log 2
MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=8,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.3,
                       max_position_embeddings=16)

CONFIGS = {
    "ministral3": lambda: Ministral3Config(**DIMS, head_dim=8, max_position_embeddings=16,
                                           rope_parameters=MINISTRAL3_ROPE),
    # sliding (a window of 4, its own rotary base) with a dense MLP, then full (YaRN x2) and sliding
    # layers of 4 experts top-2 (renormalised); qk-norm, q/k/v/o biases
    "mellum": lambda: MellumConfig(
        **(DIMS | dict(num_hidden_layers=3)), head_dim=8, max_position_embeddings=16, sliding_window=4,
        attention_bias=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, rope_parameters={
            "full_attention": dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=8),
            "sliding_attention": dict(rope_type="default", rope_theta=100.0)}),
    # Apertus under its own model_type: qk-norm, xIELU's learned scalars, llama3-scaled rotary
    "apertus1p5_text": lambda: Apertus1p5TextConfig(**(DIMS | dict(pad_token_id=3)), rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8)),
    # weightless norms (the embeddings' too), the reversed rotary, the weightless qk-norm after it,
    # relu2 MLP, soft-capped logits; q/k/v/o biases
    "nanochat": lambda: NanoChatConfig(**DIMS, attention_bias=True, final_logit_softcapping=3.0),
    # EXAONE 4's attention (qk-norm; sliding, full (NoPE), sliding layers, a window of 4) in sandwich
    # norms; 4 experts top-2 by logits plus the correction bias, sigmoid weights renormalised, a shared expert
    "kolibri1": lambda: Kolibri1Config(
        **{k: v for k, v in (DIMS | dict(num_hidden_layers=3)).items() if k != "intermediate_size"}, head_dim=8,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=True),
    # a Gated DeltaNet (two key heads, each serving two value heads), sliding (rotary, a window of 4)
    # and full (NoPE) layers with qk-norm; 4 experts top-2 and an ungated shared expert; plain norms
    "lara_mini": lambda: LaraMiniConfig(
        **{k: v for k, v in (DIMS | dict(num_hidden_layers=3)).items() if k != "intermediate_size"}, head_dim=8,
        sliding_window=4, layer_types=["linear_attention", "sliding_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24),
    # conv, sliding (a window of 4, its own base), full (proportional rotary on half the angles) layers;
    # qk-norm, a sigmoid gate per head, sandwich norms, q/k/v/o biases
    "lfm3": lambda: Lfm3Config(**(DIMS | dict(num_hidden_layers=3)), head_dim=8, sliding_window=4, attention_bias=True,
                               layer_types=["conv", "sliding_attention", "full_attention"], conv_L_cache=3),
}
SEEDS = {}  # else 0; each with a varied greedy continuation
DRAWS = {"lara_mini": mamba_draw}  # A = -exp(A_log) in [-2.5, -0.5], dt_bias near 0, norm scales near 1
FORWARD = {"lara_mini": dict(use_cache=False)}


BUFFERS = {"kolibri1": router_bias}


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    kind = request.param
    kw = {k: v for k, v in (("draw", DRAWS.get(kind)), ("buffers", BUFFERS.get(kind))) if v is not None}
    model = randomized(CONFIGS[kind](), SEEDS.get(kind, 0), **kw)
    return saved(model, tmp_path_factory.mktemp(kind), **FORWARD.get(kind, {}))




# ------------------------------------------------------------ Ministral 3's query temperature
@pytest.fixture(scope="module")
def ministral3(tmp_path_factory):
    return saved(randomized(CONFIGS["ministral3"](), 0), tmp_path_factory.mktemp("ministral3_q"))


def test_ministral3_query_temperature_moves_the_logits_from_its_length_on(ministral3):
    """Without the temperature (beta 0) the logits of positions 0-7 stay (their scale is 1 either
    way) and those from position 8 on move; under fsdp_tp on 8 devices the logits equal one
    device's within 1e-5 and transformers' within 1e-4."""
    path, _, ref = ministral3
    one, sharded = fsdp_tp_parity(path, ref)
    np.testing.assert_allclose(sharded, one, atol=1e-5, rtol=0)
    module, config, params = load_hf(path, mesh=one_device(), overrides={"llama_4_scaling_beta": 0.0})
    assert config.arch.llama_4_scaling is None
    off = apply(module, params, one_device())
    np.testing.assert_allclose(off[:, :8], ref[:, :8], atol=TOL, rtol=0)
    assert np.abs(off[:, 8:] - ref[:, 8:]).max() > 1e-2


def test_ministral3_needs_the_scaling_beta(tmp_path):
    """A rope_parameters without llama_4_scaling_beta is refused naming it (transformers fails on it)."""
    from harness import rewritten

    from shardzoo.models.hf.base import HFError

    rope = {k: v for k, v in MINISTRAL3_ROPE.items() if k != "llama_4_scaling_beta"}
    path = rewritten(CONFIGS["ministral3"](), tmp_path / "m", rope_parameters=rope)
    with pytest.raises(HFError, match="llama_4_scaling_beta"):
        load_hf(path)


def test_apertus1p5_text_with_a_pruned_head_is_refused_naming_the_field(tmp_path):
    """An LM head narrower than the embeddings (output_vocab_size < vocab_size) is refused naming
    output_vocab_size; one as wide (transformers' canonical None) reads as Apertus."""
    from harness import config_of

    from shardzoo.models.hf.base import HFError

    hf = CONFIGS["apertus1p5_text"]().to_dict()
    with pytest.raises(HFError, match="output_vocab_size=100"):
        config_of(hf | dict(output_vocab_size=100))
    assert config_of(hf | dict(output_vocab_size=128)).arch == config_of(hf).arch


# --------------------------------------------- nanochat's weightless norms and reversed rotary
@pytest.fixture(scope="module")
def nanochat(tmp_path_factory):
    return saved(randomized(CONFIGS["nanochat"](), 0), tmp_path_factory.mktemp("nanochat_rope"))


def test_nanochat_reversed_rotary_is_its_heads_halves_swapped(nanochat):
    """Under fsdp_tp on 8 devices the logits (weightless norms, q/k halves swapped) equal one
    device's within 1e-5 and transformers' within 1e-4; q and k read without the swap (shardzoo's
    rotary turning nanochat's way round the other way) move them."""
    path, _, ref = nanochat
    one, sharded = fsdp_tp_parity(path, ref)
    np.testing.assert_allclose(sharded, one, atol=1e-5, rtol=0)
    module, _, params = load_hf(path, mesh=one_device())
    swap = lambda x: np.roll(np.asarray(x), x.shape[-1] // 2, axis=-1)  # noqa: E731
    for leaf in ("['q']['kernel']", "['k']['kernel']", "['q']['bias']", "['k']['bias']"):
        params = edit(params, leaf, swap)
    assert np.abs(apply(module, params, one_device()) - ref).max() > 1e-2


# ------------------------------------------------------------- Kolibri's router (logit_bias)
@pytest.fixture(scope="module")
def kolibri1(tmp_path_factory):
    model = randomized(CONFIGS["kolibri1"](), 0, buffers=router_bias)
    return saved(model, tmp_path_factory.mktemp("kolibri1_router"))


def test_kolibri1_router_chooses_by_logits_plus_its_bias_and_runs_under_ep(kolibri1):
    """Experts, router and correction bias split 4 ways (the indexed dispatch with a slot for every
    token): the logits equal one device's within 1e-5 and transformers' within 1e-4. Choosing by
    the sigmoid scores plus the bias (DeepSeek-V3's sigmoid_groups, the same weights) moves them."""
    path, _, ref = kolibri1
    module, _, params = load_hf(path, mesh=one_device())
    one = apply(module, params, one_device())
    np.testing.assert_allclose(one, ref, atol=TOL, rtol=0)
    module, config, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=4 / 2)
    assert config.arch.moe.router_kind == "logit_bias"
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for suffix, axis in (("['wi_up']", -3), ("['router_bias']", -1)):  # [.., expert, embed, mlp], [.., expert]
        leaf = next(x for p, x in leaves if jax.tree_util.keystr(p).endswith(suffix))
        assert leaf.shape[axis] == 4 and leaf.addressable_shards[0].data.shape[axis] == 1, suffix
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, one, atol=1e-5, rtol=0)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    module, _, params = load_hf(path, mesh=one_device(), overrides={"router_kind": "sigmoid_groups"})
    assert np.abs(apply(module, params, one_device()) - ref).max() > 1e-3


def test_the_text_model_of_a_multimodal_mistral3_checkpoint_is_ministral3(tmp_path, capfd):
    """Mistral's published Ministral 3 checkpoints are ``mistral3`` (a vision tower around a
    ``ministral3`` text model): the import reads the text model, saying the vision tower is left
    out, with the conditional-generation model's logits on text within 1e-4."""
    from transformers import AutoModelForImageTextToText, Mistral3Config

    text = CONFIGS["ministral3"]().to_dict()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  image_size=16, head_dim=8)
    config = Mistral3Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = randomize(AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval())
    path, _, ref = saved(model, tmp_path / "mistral3")
    module, loaded, params = load_hf(path, mesh=one_device())
    assert "left out" in capfd.readouterr().err and loaded.arch.llama_4_scaling.beta == 0.3
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)


# --------------------------------------- LFM3's gate per attention head and proportional rotary
@pytest.fixture(scope="module")
def lfm3(tmp_path_factory):
    return saved(randomized(CONFIGS["lfm3"](), 0), tmp_path_factory.mktemp("lfm3_gate"))


def test_lfm3_head_gate_and_proportional_rotary(lfm3):
    """The full layers' proportional frequencies are transformers' (half the angles turn, the rest
    0); under fsdp_tp on 8 devices (the gate's kernel split over heads) the logits equal one
    device's within 1e-5 and transformers' within 1e-4; plain rotary on the full layers, or the
    gate's kernel zeroed (every head halved), moves them."""
    from shardzoo.models.rope import rope_inv_freq

    path, model, ref = lfm3
    module, config, params = load_hf(path, mesh=one_device())
    want = model.model.rotary_emb.full_attention_inv_freq.numpy()
    np.testing.assert_allclose(rope_inv_freq(config.arch), want, rtol=1e-6, atol=0)
    assert (want[2:] == 0).all() and (want[:2] > 0).all()
    zeroed = edit(params, "['head_gate']['kernel']", np.zeros_like)
    assert np.abs(apply(module, zeroed, one_device()) - ref).max() > 1e-2
    one = apply(module, params, one_device())
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    gate = next(x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                if jax.tree_util.keystr(p).endswith("['head_gate']['kernel']"))
    assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")  # [embed, heads]
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, one, atol=1e-5, rtol=0)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    # (base 1e6: plain rotary's two other angles turn slowly, so the move is small, though 80 x TOL)
    module, _, params = load_hf(path, mesh=one_device(), overrides={"rope_scaling": None})
    assert np.abs(apply(module, params, one_device()) - ref).max() > 2e-3
