"""Bamba and Nemotron-H: Mamba2 layers (the shared ``mamba2`` feature, models/ssm.py) beside
attention, as layer patterns.

Bamba: 4 layers (mamba, attention, mamba, mamba; ``attn_layer_indices`` [1]), each with a SwiGLU
MLP, rotary on half of each head. Nemotron-H: 5 layers M - * M - (mamba, MLP, attention without
positions, mamba, MLP), each layer one norm and one of them. Both: 8 mamba heads of 8 in 2 groups,
state 8, chunks of 4 under sequences of 11. Logits equal transformers' on one device and under
fsdp_tp on 8 devices, greedy tokens equal over 16, decoding from the cache equals the full
forward, export then ``from_pretrained`` equal, parameter counts equal transformers'. Tolerance:
1e-4 on float32 logits against transformers, 1e-5 shardzoo against itself.
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, BambaConfig, NemotronHConfig

from shardzoo.models.decode import cache_init_fn
from shardzoo.models.hf import HFError, export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOL, apply, decoded, edit, mamba_draw, one_device, randomized, rewritten, saved  # noqa: E402

MAMBA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "bamba": lambda **kw: BambaConfig(**(MAMBA | dict(
        num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=4, max_position_embeddings=64) | kw)),
    "nemotron_h": lambda **kw: NemotronHConfig(**(MAMBA | dict(
        head_dim=8, layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
        mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=4) | kw)),
}
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 11)).astype(np.int32)


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(family, HF dir, HF model, reference logits): every weight random, A = -exp(A_log) in
    [-2.5, -0.5], dt_bias around 0, norm scales near 1, the rest 0.2 x normal."""
    family = request.param
    return family, *saved(randomized(CONFIGS[family](), seed=1, draw=mamba_draw), tmp_path_factory.mktemp(family),
                          TOKENS)


def _apply(module, params, mesh):
    return apply(module, params, mesh, TOKENS)


def test_config_reads_the_layer_pattern(built):
    family, path, _, _ = built
    config = load_hf_config(path)
    specs = [(s.mixer, s.mlp) for s in config.layer_specs()]
    if family == "bamba":
        assert specs == [("mamba", "dense"), ("attention", "dense"), ("mamba", "dense"), ("mamba", "dense")]
        assert config.partial_rotary_factor == 0.5 and config.mamba.chunk_size == 4
    else:
        assert specs == [("mamba", "none"), ("none", "dense"), ("attention", "none"), ("mamba", "none"),
                         ("none", "dense")]
        assert config.rope_layers == (False,) * 5 and config.mlp_type == "plain" and config.hidden_act == "relu2"
    assert (config.mamba.num_heads, config.mamba.head_dim, config.mamba.n_groups, config.mamba.state_size) == (8, 8, 2, 8)


def test_logits_match_on_one_device_and_under_fsdp_tp_and_each_mechanism_matters(built):
    """The parity, and the logits moving away from transformers' without the mamba layers'
    convolution, with other decays, or (Bamba) with whole-head rotary / (Nemotron-H) rotary at
    all: the parity could fail."""
    family, path, _, ref = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    got = _apply(module, params, one_device())
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    for suffix, fn in (("['conv_x']", lambda x: 0 * x), ("['A_log']", lambda x: x + 1.0)):
        assert np.abs(_apply(module, edit(params, suffix, fn), one_device()) - ref).max() > 1e-2, suffix
    other = config.replace(partial_rotary_factor=1.0) if family == "bamba" else config.replace(rope_layers=None)
    assert np.abs(_apply(other.build(), params, one_device()) - ref).max() > 1e-2
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    sharded = _apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"{family}: max |logit diff| one device {np.abs(got - ref).max():.2e}, "
          f"fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_parameter_count_equals_transformers(built):
    _, path, model, _ = built
    assert load_hf_config(path).num_params() == sum(p.numel() for p in model.parameters())


def test_decoding_from_the_cache_equals_the_full_forward(built):
    """A prefill of 6 tokens then 5 single steps give the full forward's logits (1e-5): mamba
    layers carry conv inputs and state, attention layers K/V."""
    family, path, _, _ = built
    module, _, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"), scan_layers=False)
    full = _apply(module, params, one_device())
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    assert cache["layers_0"]["mamba"]["ssm_state"].value.shape == (4, 8, 8, 8)
    assert "cached_key" in cache[f"layers_{1 if family == 'bamba' else 2}"]["attn"]
    got = decoded(module, params, cache, TOKENS, prefill=6)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
    print(f"{family}: max |decode - forward| {np.abs(got - full).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    _, path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    family, path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == family
    if family == "bamba":
        assert hf["attn_layer_indices"] == [1]
    else:
        assert hf["layers_block_type"] == ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_nemotron_h_older_keys_read_as_the_same_model(tmp_path):
    """``hybrid_override_pattern`` and the ``mamba_``-prefixed keys of the published configs."""
    CONFIGS["nemotron_h"]().save_pretrained(tmp_path)
    want = load_hf_config(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layers_block_type"]
    raw.update(hybrid_override_pattern="M-*M-", mamba_n_groups=raw.pop("n_groups"),
               mamba_chunk_size=raw.pop("chunk_size"), num_hidden_layers=5)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(str(tmp_path)).arch == want.arch


def test_nemotron_h_latent_moe_layers_and_bad_indices_are_refused_in_one_line(tmp_path):
    CONFIGS["nemotron_h"](layers_block_type=["linear_attention", "moe"], moe_latent_size=16).save_pretrained(
        tmp_path / "moe")
    with pytest.raises(HFError, match=r"moe_latent_size=16: .*hidden_size"):
        load_hf_config(str(tmp_path / "moe"))
    path = rewritten(CONFIGS["bamba"](), tmp_path / "bamba", attn_layer_indices=[7])
    with pytest.raises(HFError, match=r"attn_layer_indices=\[7\]: each must be a layer index in 0..3"):
        load_hf_config(path)


def test_the_presets_count_as_transformers_counts():
    from shardzoo.models import get_config

    for name, hf in (("bamba-tiny", BambaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                 attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
                                                 mamba_n_groups=2, mamba_d_state=16)),
                     ("nemotron-h-tiny", NemotronHConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                         hybrid_override_pattern="M-M*-", mamba_num_heads=8,
                                                         mamba_head_dim=16, n_groups=2, ssm_state_size=16))):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        assert get_config(name).num_params() == sum(p.numel() for p in model.parameters()), name


def test_the_published_nemotron_h_8b_config_reads_as_the_preset(tmp_path):
    """nvidia/Nemotron-H-8B-Base-8K's config.json (its older keys: hybrid_override_pattern,
    attention_head_dim) reads as the ``nemotron-h-8b`` preset, whose parameter count is
    transformers' count of that config."""
    from shardzoo.models import get_config

    raw = dict(architectures=["NemotronHForCausalLM"], attention_bias=False, attention_dropout=0.0,
               attention_head_dim=128, bos_token_id=1, chunk_size=128, conv_kernel=4, eos_token_id=2, expand=2,
               hidden_act="relu2", hidden_dropout=0.0, hidden_size=4096,
               hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", initializer_range=0.02,
               intermediate_size=21504, layer_norm_epsilon=1e-05, mamba_head_dim=64, mamba_hidden_act="silu",
               mamba_num_heads=128, mamba_proj_bias=False, max_position_embeddings=8192, mlp_bias=False,
               mlp_hidden_act="relu2", model_type="nemotron_h", n_groups=8, num_attention_heads=32,
               num_hidden_layers=52, num_key_value_heads=8, num_logits_to_keep=1, pad_token_id=0,
               rescale_prenorm_residual=True, residual_in_fp32=False, rms_norm_eps=1e-05, ssm_state_size=128,
               tie_word_embeddings=False, use_bias=False, use_cache=True, use_conv_bias=True, vocab_size=131072)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    preset = get_config("nemotron-h-8b")
    assert load_hf_config(str(tmp_path)).arch == preset.arch
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(NemotronHConfig.from_pretrained(tmp_path))
    count = sum(p.numel() for p in model.parameters())
    assert preset.num_params() == count
    print(f"nemotron-h-8b: {count:,} parameters")


def test_training_from_a_tiny_nemotron_h_lowers_the_loss_and_exports(tmp_path, parity):
    """``train --init-from`` a random Nemotron-H (mamba, MLP and attention layers) under fsdp on
    8 devices, sequences of 16 in chunks of 4: the loss falls, the export loads in transformers
    and computes what the run computes (1e-4)."""
    model = randomized(CONFIGS["nemotron_h"](), seed=3, draw=mamba_draw)
    parity.trains_from_hf_dir(tmp_path, model, TOKENS[:2], False, TOL)
