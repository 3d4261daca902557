"""Families that brought a norm kind or a block form (models/norms.py, models/blocks.py):
Nemotron (LayerNorm1P: scale 1 + w, with bias; relu2 plain MLP, partial rotary), OLMo 1 (LayerNorm
without weight or bias; clip_qkv), GPT-NeoX / Pythia (attention and MLP side by side from two
LayerNorms, or sequential; q|k|v fused per head, partial rotary) and Falcon (q|k|v fused by kv
group: multi-query, classic MHA, or the new decoder architecture's GQA; one-norm parallel,
two-norm parallel or sequential blocks).

Tiny random HF models with each mechanism on: logits equal transformers' on one device, greedy
tokens equal over 16, export then ``from_pretrained`` equal; each new mechanism moves the logits;
each new component (the two norm kinds, the two-norm block, clip_qkv) once under fsdp_tp on 8
devices; the presets count as published. Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import numpy as np
import pytest
from transformers import FalconConfig, GPTNeoXConfig, NemotronConfig, OlmoConfig

from shardzoo.models.hf import export_hf
from shardzoo.models.hf.registry import PRESETS
from shardzoo.models.transformer import Transformer
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, fsdp_tp_parity, near_one, one_device, randomized, saved  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
NEOX = dict(DIMS, rope_parameters=ROTARY, attention_bias=True)
FALCON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=64,
              bos_token_id=None, eos_token_id=None, bias=True)
CONFIGS = {
    # LayerNorm1P, relu2, rotary on half of each head, q/k/v/o and MLP biases, GQA
    "nemotron": lambda: NemotronConfig(**DIMS, num_key_value_heads=2, rope_parameters=ROTARY, attention_bias=True,
                                       mlp_bias=True),
    # weightless LayerNorms, q/k/v clipped at 0.5 (most of them: the projections' outputs spread ~0.8), biases
    "olmo": lambda: OlmoConfig(**DIMS, num_key_value_heads=2, clip_qkv=0.5, attention_bias=True),
    "gpt_neox": lambda: GPTNeoXConfig(**NEOX, use_parallel_residual=True),
    "gpt_neox_sequential": lambda: GPTNeoXConfig(**NEOX, use_parallel_residual=False),
    # Falcon-7B's layout: one kv head, attention and MLP from one LayerNorm
    "falcon": lambda: FalconConfig(**FALCON, multi_query=True, parallel_attn=True),
    # Falcon-40B's: the new decoder architecture, 2 kv heads, two LayerNorms
    "falcon_new": lambda: FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2),
    # the classic MHA layout (q, k, v per head) in a sequential block
    "falcon_sequential": lambda: FalconConfig(**FALCON, multi_query=False, parallel_attn=False),
}
# the LayerNorms' scales near 1 (LayerNorm1P's weight too: its scale 1 + w near 2, as drawn, still moves)
DRAW = near_one(lambda name, p: ("layernorm" in name or "ln_" in name) and name.endswith("weight"))
SEEDS = {"gpt_neox": 5, "falcon": 2, "falcon_new": 3}  # else 0; each with a varied greedy continuation


_BUILT = {}


def _build(name, tmp_path_factory):
    """(name, HF dir, HF model, reference logits): every weight random, LayerNorm scales near 1;
    made once per family in this file."""
    if name not in _BUILT:
        model = randomized(CONFIGS[name](), SEEDS.get(name, 0), DRAW)
        _BUILT[name] = (name, *saved(model, tmp_path_factory.mktemp(name)))
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``name -> _build(name)``: the one family a mechanism's test needs."""
    return lambda name: _build(name, tmp_path_factory)


def test_logits_match_on_one_device(built, parity):
    _, path, model, ref = built
    _, module, _, params = parity.load(path)
    got = apply(module, params, one_device())
    print(f"{model.config.model_type}: max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    _, path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    _, path, model, ref = built
    _, _, config, params = parity.load(path)
    kind = model.config.model_type
    assert export_hf(config, params, str(tmp_path), family=kind)["model_type"] == kind
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


# ------------------------------------------------------------------------ the new mechanisms
def _loaded(built):
    """A family's import on one device: (module, config, params, reference logits)."""
    module, config, params = load_hf(built[1], mesh=one_device())
    np.testing.assert_allclose(apply(module, params, one_device()), built[3], atol=TOL, rtol=0)
    return module, config, params, built[3]


def _moved(config, params, ref, **change) -> float:
    """The largest logit difference to ``ref`` once ``config`` takes ``change`` (a mechanism
    that matters moves it past 1e-2)."""
    return np.abs(apply(Transformer(config.replace(**change)), params, one_device()) - ref).max()


def test_layernorm_1p_scales_by_one_plus_its_weight(family):
    """Nemotron's norms read as plain LayerNorms (scale w, not 1 + w) give other logits."""
    _, config, params, ref = _loaded(family("nemotron"))
    assert _moved(config, params, ref, norm_type="layernorm") > 1e-2


def test_weightless_layernorm_and_clip_qkv_matter(family):
    """OLMo's norms have no parameters; as RMSNorms (weights 1: the mean not subtracted), or with
    q/k/v unclipped, the logits move."""
    _, config, params, ref = _loaded(family("olmo"))
    assert "final_norm" not in params and not {"attn_norm", "mlp_norm"} & set(params["layers"])
    ones = {"scale": np.ones((2, 32), np.float32)}  # the two scanned layers' weights
    rms = dict(params, layers=dict(params["layers"], attn_norm=ones, mlp_norm=ones),
               final_norm={"scale": np.ones(32, np.float32)})
    assert _moved(config, rms, ref, norm_type="rmsnorm") > 1e-2
    assert _moved(config, params, ref, clip_qkv=None) > 1e-2


def test_the_two_norm_parallel_block_matters(family):
    """GPT-NeoX's two-norm parallel block run sequentially, or from its first norm alone, gives
    other logits."""
    _, config, params, ref = _loaded(family("gpt_neox"))
    assert config.block_form == "parallel_two_norms"
    assert _moved(config, params, ref, block_form="sequential") > 1e-2
    one_norm = dict(params, layers={k: v for k, v in params["layers"].items() if k != "mlp_norm"})
    assert _moved(config, one_norm, ref, block_form="parallel") > 1e-2


@pytest.mark.parametrize("name", ["nemotron", "olmo", "gpt_neox"])
def test_new_components_under_fsdp_tp(family, name):
    """LayerNorm1P (Nemotron), the weightless LayerNorm and clip_qkv (OLMo), the two-norm parallel
    block (GPT-NeoX): logits equal transformers' on 8 devices under fsdp_tp."""
    _, path, _, ref = family(name)
    fsdp_tp_parity(path, ref)


# ---------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name, count", [
    ("pythia-70m", 70_426_624), ("gpt-neox-20b", 20_554_567_680),  # the Pythia and GPT-NeoX-20B papers' counts
    ("falcon-7b", 6.92e9), ("olmo-1b", 1.18e9), ("minitron-4b", 4.19e9)])  # model cards' 6.92B, 1.18B, 4.19B
def test_presets_have_their_published_parameter_counts(name, count):
    """Each preset's count as published (its transformers model's on the meta device:
    test_hf_families' test_each_preset_has_the_parameter_count_of_its_transformers_model)."""
    got = PRESETS[name].num_params()
    assert got == count if isinstance(count, int) else round(got / 1e7) == round(count / 1e7)
