"""Rotary scalings YaRN, longrope and dynamic NTK: shardzoo's logits and greedy tokens equal transformers'.

Tiny random HF models (Llama for yarn and dynamic, Phi-3 for longrope) whose sequences of 16
pass the scaling's original length (8): logits on one device and under fsdp_tp on 8 devices,
greedy generation, export then ``from_pretrained``; inverse frequencies and attention factors
against ``ROPE_INIT_FUNCTIONS``; and the same weights without the scaling give other logits.
Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shardzoo.errors import UserError
from shardzoo.models import ModelError, get_config
from shardzoo.models.arch import TransformerArch
from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.models.rope import rope_attention_factor, rope_frequencies, rope_inv_freq
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import generate_text, load_hf
from shardzoo.train.program import Program

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, hf_logits, near_one, randomized, saved  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
PHI = dict(pad_token_id=2, bos_token_id=1, eos_token_id=2)
SHORT, LONG = [1.0, 1.3, 1.7, 2.5], [1.5, 3.0, 6.0, 12.0]  # head_dim 8: 4 rotated pairs
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)
CONFIGS = {
    "yarn": lambda: LlamaConfig(**DIMS, max_position_embeddings=32, rope_scaling=dict(YARN)),
    # head_dim 16, the correction range untruncated, the attention factor from mscale / mscale_all_dim
    "yarn_options": lambda: LlamaConfig(**DIMS, head_dim=16, max_position_embeddings=32, rope_theta=100.0,
                                        rope_scaling=dict(YARN, beta_fast=8.0, beta_slow=0.5, mscale=2.0,
                                                          mscale_all_dim=1.0, truncate=False)),
    # transformers recomputes inv_freq when a sequence passes max_position_embeddings (8 here)
    "dynamic": lambda: LlamaConfig(**DIMS, max_position_embeddings=8,
                                   rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    # Phi-3 128k's layout: original_max_position_embeddings at the top, longrope's factor lists
    "longrope": lambda: Phi3Config(**DIMS, **PHI, max_position_embeddings=64, original_max_position_embeddings=8,
                                   rope_scaling=dict(rope_type="longrope", short_factor=SHORT, long_factor=LONG)),
}


def fresh(path):
    """A newly loaded HF model: dynamic NTK keeps the longest sequence's frequencies between calls."""
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits of TOKENS): every weight random, norm scales near 1."""
    model = randomized(CONFIGS[request.param](), 0, near_one(lambda name, p: p.ndim == 1 and "norm" in name))
    return saved(model, tmp_path_factory.mktemp(request.param), reference=fresh)


def test_logits_match_on_one_device(built):
    path, _, ref = built
    module, _, params = load_hf(path)
    out = apply(module, params, make_mesh("", devices=jax.devices()[:1]))
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["yarn"], indirect=True)
def test_logits_match_under_fsdp_tp_on_8_devices(built):
    """A scaling changes the rotary tables, computed from positions fsdp_tp never splits: one
    scaling's sharded check stands for all (the others: one device above)."""
    path, _, ref = built
    mesh, rules = make_mesh("data=2,fsdp=2,tensor=2"), get_rules("fsdp_tp")
    module, _, params = load_hf(path, mesh=mesh, rules=rules)
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


def test_within_the_original_length_too(built):
    """8 tokens: longrope's short factors, dynamic's plain frequencies (transformers' fresh model)."""
    path, _, _ = built
    module, _, params = load_hf(path)
    out = apply(module, params, make_mesh("", devices=jax.devices()[:1]), TOKENS[:, :8])
    np.testing.assert_allclose(out, hf_logits(fresh(path), TOKENS[:, :8]), atol=TOL, rtol=0)


def test_the_scaling_matters(built):
    """The same weights with plain rotary embeddings give other logits."""
    path, _, ref = built
    module, config, params = load_hf(path)
    out = apply(type(module)(config.replace(rope_scaling=None)), params, make_mesh("", devices=jax.devices()[:1]))
    assert np.abs(out - ref).max() > 1e-2


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    export_hf(config, params, str(tmp_path), family=model.config.model_type)
    back = fresh(tmp_path)
    assert type(back) is type(model)
    assert back.config.rope_parameters == model.config.rope_parameters
    np.testing.assert_allclose(hf_logits(back, TOKENS), ref, atol=TOL, rtol=0)


def _greedy(path, prompt, new):
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("fsdp")
    _, config, params = load_hf(path, mesh=mesh, rules=rules)
    return Program(config, rules, mesh).decoding.generate(params, prompt, max_new_tokens=new)


def test_greedy_generate_matches_transformers(built):
    """16 new tokens past the original length of 8. Longrope: a prompt of 9, all in the long
    regime (transformers recomputes its cache with the long factors when a generation crosses;
    shardzoo refuses that crossing, tested below). Dynamic: a prompt of 8, every step rescaled."""
    path, model, _ = built
    prompt = TOKENS[:1, :9] if model.config.model_type == "phi3" else TOKENS[:1, :8]
    with torch.no_grad():
        want = fresh(path).generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=16, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, min_new_tokens=16).numpy()
    got = _greedy(path, prompt, 16)
    assert len(set(want[0, prompt.shape[1]:].tolist())) > 2  # a varied continuation (random models repeat)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("built", ["longrope"], indirect=True)
def test_longrope_generation_within_short_factors_and_a_crossing_refused(built):
    path, _, _ = built
    prompt = TOKENS[:1, :4]
    with torch.no_grad():
        want = fresh(path).generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=5, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, min_new_tokens=5).numpy()
    np.testing.assert_array_equal(_greedy(path, prompt, 5), want)  # positions 0..8: short factors
    with pytest.raises(ModelError, match="cross original_max_position_embeddings=8"):
        _greedy(path, prompt, 16)


def _hf_config(name):
    config = CONFIGS[name]()
    config.standardize_rope_params()
    return config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inv_freq_and_attention_factor_are_transformers(name, tmp_path):
    hf = _hf_config(name)
    kind = hf.rope_parameters["rope_type"]
    (tmp_path / "config.json").write_text(hf.to_json_string())
    arch = load_hf_config(str(tmp_path)).arch
    want, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    np.testing.assert_allclose(rope_inv_freq(arch), want.numpy(), atol=1e-6, rtol=0)
    assert abs(rope_attention_factor(arch) - factor) < 1e-6
    assert (factor != 1.0) == (kind != "dynamic")  # yarn's and longrope's act
    # beyond the original length: longrope's long factors, dynamic's grown base at 16 positions
    beyond, _ = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=torch.tensor(16))
    got, _ = rope_frequencies(arch, jnp.arange(16)[None])
    np.testing.assert_allclose(np.asarray(got), beyond.numpy(), atol=1e-6, rtol=0)
    if kind != "yarn":
        assert not np.allclose(np.asarray(got), want.numpy())


def test_phi35_mini_preset_is_longrope_from_4096():
    arch = get_config("phi-3.5-mini").arch
    scaling = arch.rope_scaling_dict
    assert scaling["rope_type"] == "longrope" and arch.max_position_embeddings == 131072
    assert scaling["original_max_position_embeddings"] == 4096
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == 48  # head_dim 96
    assert (scaling["short_factor"][0], scaling["long_factor"][-1]) == (1.0, 64.83999633789062)  # the published lists
    assert abs(rope_attention_factor(arch) - (1 + np.log(32) / np.log(4096)) ** 0.5) < 1e-12


@pytest.mark.parametrize("scaling, match", [
    (dict(rope_type="yarn", factor=4.0), "needs original_max_position_embeddings > 0"),
    (dict(YARN, beta_fast=-1.0), "beta_fast=-1.0 must be a number > 0"),
    (dict(YARN, truncate="yes"), "truncate='yes' must be true or false"),
    (dict(rope_type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 4,
          original_max_position_embeddings=8), "needs short_factor: a list of 4 numbers > 0"),
    (dict(rope_type="longrope", short_factor=[1.0] * 4, long_factor=[1.0, 0.0, 1.0, 1.0],
          original_max_position_embeddings=8), "needs long_factor"),
    (dict(rope_type="dynamic"), "needs factor > 0"),
])
def test_each_type_checks_its_keys_in_one_line(scaling, match):
    with pytest.raises(ModelError, match=match) as e:
        TransformerArch(**DIMS, rope_scaling=scaling)
    assert "\n" not in str(e.value)


class _Ids:
    """A tokenizer over written ids ("5 17 3"), so generated text reads back as token ids."""

    bos_id = eos_id = pad_id = 0

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f" {int(i)}" for i in ids)


@pytest.mark.parametrize("built", ["dynamic"], indirect=True)
def test_generate_goes_past_max_positions_on_rotary_models_as_transformers(built):
    """``shardzoo generate``'s path: 4 prompt tokens + 16 new ones past max_position_embeddings=8
    of a dynamic-NTK Llama (its purpose); greedy tokens equal transformers'."""
    path, _, _ = built
    prompt = TOKENS[:1, :4]
    with torch.no_grad():
        want = fresh(path).generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=16, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, min_new_tokens=16).numpy()
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("fsdp")
    _, config, params = load_hf(path, mesh=mesh, rules=rules)
    config = config.replace(eos_token_id=None)  # as transformers' eos_token_id=None: all 16 tokens
    text = " ".join(map(str, prompt[0]))
    got = generate_text(config, params, _Ids(), text, mesh, rules, max_new_tokens=16)
    assert got.split() == [str(t) for t in want[0]]


def test_generate_past_learned_positions_is_refused(tmp_path):
    """GPT-2's position table has 8 rows: 4 + 5 tokens is one line naming --max-new-tokens."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=128, n_embd=16, n_layer=1, n_head=2, n_positions=8).save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    with pytest.raises(UserError, match="4 prompt tokens \\+ --max-new-tokens 5 exceed the model's 8 positions"):
        generate_text(config, None, _Ids(), "1 2 3 4", None, None, max_new_tokens=5)
    assert config.arch.position_embedding == "learned"
