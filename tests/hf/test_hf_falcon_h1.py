"""Falcon-H1: every layer attention and a Mamba2 mixer side by side on one norm (the layer kind
"attention+mamba"), then a SwiGLU MLP, with muP multipliers everywhere.

One tiny random HF model: 2 layers of width 32, 4 attention heads of 12 (2 kv heads; head_dim
not hidden / heads), 6 mamba heads of 8 in 2 groups (groups < heads; mamba_d_ssm 48, not
mamba_expand x hidden_size), state 8, chunks of 4 under sequences of 11, the norm before the gate,
every multiplier a distinct value other than 1. Logits equal transformers' (eager attention, its
reference PyTorch scan) on one device and under fsdp_tp on 8 devices, and move when any multiplier
or either branch changes; decoding from the cache equals the full forward; greedy tokens equal over
16; export then ``from_pretrained`` equal; parameter counts equal transformers'. Tolerance: 1e-4 on
float32 logits against transformers, 1e-5 shardzoo against itself.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn
from transformers import AutoModelForCausalLM, FalconH1Config

from shardzoo.models.costs import decode_cache_bytes
from shardzoo.models.decode import cache_init_fn
from shardzoo.models.hf import HFError, export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import activate
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOL, apply, decoded, edit, hf_logits, mamba_draw, one_device, randomized, saved  # noqa: E402

MULTIPLIERS = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, key_multiplier=0.8, attention_in_multiplier=1.3,
                   attention_out_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                   ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.6], mlp_multipliers=[1.4, 0.8])
CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, max_position_embeddings=64, mamba_d_ssm=48, mamba_n_heads=6,
              mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4,
              mamba_rms_norm=True, mamba_norm_before_gate=True, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
              pad_token_id=0) | MULTIPLIERS
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random as the mamba families draw them."""
    model = randomized(FalconH1Config(**CONFIG), seed=1, draw=mamba_draw)
    return saved(model, tmp_path_factory.mktemp("falcon_h1"), TOKENS)


def _apply(module, params, mesh=None):
    return apply(module, params, mesh or one_device(), TOKENS)


def test_config_reads_every_layer_as_attention_and_mamba(built):
    path, _, _ = built
    config = load_hf_config(path)
    assert [(s.mixer, s.mlp) for s in config.layer_specs()] == [("attention+mamba", "dense")] * 2
    a = config.arch
    assert (a.head_size, a.mamba.num_heads, a.mamba.head_dim, a.mamba.n_groups, a.mamba.norm) == (
        12, 6, 8, 2, "before_gate")
    m = a.multipliers
    assert (a.embedding_multiplier, a.logit_scale, m.key, m.ssm, m.mlp) == (
        1.7, 0.6, 0.8, (0.5, 1.5, 0.75, 1.25, 0.6), (1.4, 0.8))


def test_logits_match_on_one_device_and_under_fsdp_tp_and_each_multiplier_matters(built):
    """The parity, and the logits moving away from transformers' (> 1e-2) with any multiplier
    back at 1, without either branch of the layers (the mamba mixer's or attention's output
    zeroed), or with the gate after the norm: the parity could fail."""
    path, _, ref = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    got = _apply(module, params)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    changes = {k: 1.0 for k in ("embedding_multiplier", "logit_scale", "key_multiplier", "attention_in_multiplier",
                                "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")}
    changes.update({f"ssm_multipliers[{j}]": tuple(1.0 if i == j else m for i, m in enumerate(config.multipliers.ssm))
                    for j in range(5)})
    changes.update({f"mlp_multipliers[{j}]": tuple(1.0 if i == j else m for i, m in enumerate(config.multipliers.mlp))
                    for j in range(2)})
    changes["mamba_norm"] = "gated"
    variants = [(config.replace(**{name.split("[")[0]: value}).build(), params) for name, value in changes.items()]
    branches = ("['mamba']['out']['kernel']", "['attn']['o']['kernel']")
    variants += [(module, edit(params, branch, lambda x: 0 * x)) for branch in branches]
    with activate(one_device()):  # one compile for them all
        moved = jax.jit(lambda ps, t: [jnp.abs(m.apply({"params": p}, t) - ref).max()
                                       for (m, _), p in zip(variants, ps, strict=True)])([p for _, p in variants],
                                                                                        TOKENS)
    for name, diff in zip([*changes, *branches], moved, strict=True):
        assert diff > 1e-2, name
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    sharded = _apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"falcon_h1: max |logit diff| one device {np.abs(got - ref).max():.2e}, "
          f"fsdp_tp {np.abs(sharded - ref).max():.2e}")


@pytest.mark.parametrize("rms_norm,before_gate", [(False, False), (True, False)])
def test_the_other_mamba_norms_match_transformers(tmp_path, rms_norm, before_gate, parity):
    """mamba_rms_norm false (Falcon-H1-0.5B's: y * silu(z), no norm weight) and the gated norm
    after the gate (the larger models'): logits equal transformers' on one device; the export
    loads as the same model (without a norm weight where transformers has none)."""
    model = randomized(FalconH1Config(**CONFIG | dict(mamba_rms_norm=rms_norm, mamba_norm_before_gate=before_gate)),
                       seed=2, draw=mamba_draw)
    model.save_pretrained(tmp_path / "hf")
    module, config, params = load_hf(str(tmp_path / "hf"), mesh=one_device(), rules=get_rules("fsdp"))
    assert config.mamba.norm == ("gated" if rms_norm else "none")
    assert ("norm" in params["layers"]["mamba"]) == rms_norm
    ref = hf_logits(model, TOKENS)
    np.testing.assert_allclose(_apply(module, params), ref, atol=TOL, rtol=0)
    export_hf(config, params, str(tmp_path / "out"))
    parity.export_matches(tmp_path / "out", model, TOKENS, ref, TOL)


def test_parameter_count_equals_transformers(built):
    path, model, _ = built
    assert load_hf_config(path).num_params() == sum(p.numel() for p in model.parameters())


def test_decoding_from_the_cache_equals_the_full_forward(built):
    """A prefill of 6 tokens then 5 single steps give the full forward's logits (1e-5): every
    layer carries attention's K/V and the mamba mixer's conv inputs and state; the cache's bytes
    are what costs.py counts."""
    path, _, _ = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"), scan_layers=False)
    full = _apply(module, params)
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    for i in range(2):
        assert cache[f"layers_{i}"]["mamba"]["ssm_state"].value.shape == (4, 6, 8, 8)
        assert cache[f"layers_{i}"]["attn"]["cached_key"].value.shape == (4, 2, 12, 11)  # transposed on a CPU
        assert cache[f"layers_{i}"]["attn"]["cached_value"].value.shape == (4, 2, 11, 12)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(nn.meta.unbox(cache)))
    assert decode_cache_bytes(config.arch, 4, 11, 4) == {"attention+mamba": nbytes}
    got = decoded(module, params, cache, TOKENS, prefill=6)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
    print(f"falcon_h1: max |decode - forward| {np.abs(got - full).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "falcon_h1" and hf["mamba_d_ssm"] == 48 and hf["head_dim"] == 12
    assert {k: hf[k] for k in MULTIPLIERS} == MULTIPLIERS
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_what_shardzoo_does_not_compute_is_refused_in_one_line(tmp_path):
    FalconH1Config(**CONFIG).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key, value, why in (("projectors_bias", True, r"projectors_bias=True: the mamba out_proj's bias must be"),
                            ("mamba_use_mlp", False, r"mamba_use_mlp=False changes the model"),
                            ("ssm_multipliers", [1.0, 2.0], r"ssm_multipliers=\[1.0, 2.0\]: must be a list of 5"),
                            ("mamba_d_ssm", 64, r"mamba_n_heads x mamba_d_head = 48 must be mamba_d_ssm = 64")):
        (tmp_path / "config.json").write_text(json.dumps(raw | {key: value}))
        with pytest.raises(HFError, match=why):
            load_hf_config(str(tmp_path))


def test_the_presets_count_as_transformers_counts(tmp_path):
    """``falcon-h1-0.5b``: tiiuae/Falcon-H1-0.5B-Base's config.json reads as the preset, whose
    parameter count is transformers' count of that config; ``falcon-h1-tiny`` likewise."""
    from shardzoo.models import get_config

    raw = dict(architectures=["FalconH1ForCausalLM"], attention_bias=False, attention_dropout=0.0,
               attention_in_multiplier=1.0, attention_out_multiplier=0.9375, attn_layer_indices=None,
               embedding_multiplier=5.656854249492381, head_dim=64, hidden_act="silu", hidden_size=1024,
               initializer_range=0.02, intermediate_size=2048, key_multiplier=0.39062499999999994,
               lm_head_multiplier=0.0390625, mamba_chunk_size=128, mamba_conv_bias=True, mamba_d_conv=4,
               mamba_d_head=64, mamba_d_ssm=1536, mamba_d_state=128, mamba_expand=2, mamba_n_groups=1,
               mamba_n_heads=24, mamba_norm_before_gate=False, mamba_proj_bias=False, mamba_rms_norm=False,
               mamba_use_mlp=True, max_position_embeddings=16384, mlp_bias=False,
               mlp_multipliers=[0.8838834764831844, 0.5859375], model_type="falcon_h1", num_attention_heads=8,
               num_hidden_layers=36, num_key_value_heads=2, projectors_bias=False, rms_norm_eps=1e-5,
               rope_scaling=None, rope_theta=100000000000.0, ssm_in_multiplier=1.25,
               ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
               ssm_out_multiplier=0.23570226039551587, tie_word_embeddings=False, vocab_size=32784)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    preset = get_config("falcon-h1-0.5b")
    assert load_hf_config(str(tmp_path)).arch == preset.arch
    tiny = FalconH1Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=8,
                          mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_rms_norm=True,
                          mamba_norm_before_gate=False)
    for name, hf in (("falcon-h1-0.5b", FalconH1Config.from_pretrained(tmp_path)), ("falcon-h1-tiny", tiny)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        count = sum(p.numel() for p in model.parameters())
        assert get_config(name).num_params() == count, name
        print(f"{name}: {count:,} parameters")


def test_plan_counts_the_attention_and_mamba_layers_within_15_percent_of_the_compiled_step():
    """falcon-h1-tiny, 16 x 64 under fsdp=8: the plan's total and temporaries against XLA's
    (measured 0.95 / 0.95); every layer attends, so its FLOPs per token grow with the sequence by
    attention's q.k and probs.v, and the mamba scan's and projections' FLOPs are counted too."""
    from shardzoo.models import get_config
    from shardzoo.models.arch import ATTENTION_MAMBA
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.tasks.registry import run_program

    config = get_config("falcon-h1-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules("fsdp"), make_mesh("fsdp=8"))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
    terms = config.activation_estimate(16, 64, lambda names: 1).terms
    assert terms["ssm_decay"] > 0 and terms["query"] > 0 and terms["mamba_context"] > 0
    a = config.arch
    grown = a.num_hidden_layers * 6 * a.num_attention_heads * 2 * a.head_size * (8192 - 512) / 2
    assert config.flops_per_token(8192) - config.flops_per_token(512) == pytest.approx(grown)
    attention_only = config.replace(layer_types=None, mamba_num_heads=0)
    assert ATTENTION_MAMBA not in [s.mixer for s in attention_only.layer_specs()]
    assert config.num_params() > attention_only.num_params()
    assert config.flops_per_token(512) > attention_only.flops_per_token(512)
