"""OLMo 3, SmolLM3 and Ministral: layer patterns as data. OLMo 3 mixes sliding and full layers
(OLMo 2's post-norms and projection qk-norm, the rope scaling on the full layers only), SmolLM3
mixes NoPE and rotary layers (``no_rope_layers``: shardzoo's ``rope_layers``, a feature written
once in the shared layers) with windows on its NoPE layers, Ministral mixes Mistral's sliding
layers with full ones by ``layer_types``.

Tiny random HF models with every mechanism on (windows of 4 in a text of 16, patterns that are
not uniform, so the layouts scan a period, or a run between an unrolled prefix and rest): logits
equal transformers' on one device and under fsdp_tp on 8 devices, greedy tokens equal, export
then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, MinistralConfig, Olmo3Config, SmolLM3Config

from shardzoo.models import ModelError
from shardzoo.models.arch import FULL, SLIDING, TransformerArch
from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    config_of,
    fsdp_tp_parity,
    hf_logits,
    one_device,
    randomized,
    saved,
    stacked_q,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
S, F = SLIDING, FULL
CONFIGS = {
    # 3 sliding : 1 full, twice (a scanned period of 4); linear scaling of the full layers' rotary
    "olmo3": lambda: Olmo3Config(**DIMS, num_hidden_layers=8, sliding_window=4,
                                 rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # NoPE on every other layer, windows on the NoPE layers (SmolLM3's default): a period of 2
    "smollm3": lambda: SmolLM3Config(**DIMS, num_hidden_layers=6, no_rope_layers=[1, 0] * 3,
                                     use_sliding_window=True, sliding_window=4, pad_token_id=None),
    # full, 4 sliding, full: a scanned run between an unrolled first and last layer
    "ministral": lambda: MinistralConfig(**DIMS, head_dim=8, num_hidden_layers=6, sliding_window=4,
                                         layer_types=[F, S, S, S, S, F]),
}
# What the same weights compute without each family's mechanism (transformers' config edits).
WITHOUT = {
    "olmo3": dict(layer_types=[F] * 8),
    "smollm3": dict(no_rope_layers=[1] * 6),
    "ministral": dict(layer_types=[F] * 6),
}
SEEDS = {"olmo3": 0, "smollm3": 2, "ministral": 0}  # each with a varied greedy continuation
LAYOUTS = {"olmo3": (0, 4, 2), "smollm3": (0, 2, 3), "ministral": (1, 1, 4)}  # (prefix, period, repeats)


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(CONFIGS[request.param](), SEEDS[request.param])
    return saved(model, tmp_path_factory.mktemp(request.param))


def test_the_mechanism_matters(built):
    """The same weights without the family's mechanism (every layer full, every layer rotary)
    give other logits in transformers: parity below cannot pass by accident."""
    path, model, ref = built
    kind = model.config.model_type
    other_config = type(model.config)(**(model.config.to_dict() | WITHOUT[kind]))
    other = AutoModelForCausalLM.from_config(other_config, attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-2
    config = load_hf_config(path)
    assert config.layout().as_tuple() == LAYOUTS[kind]
    if kind == "smollm3":
        assert config.rope_layers == (True, False) * 3
        assert [s.rope for s in config.layer_specs()] == ["global", "none"] * 3
        assert [s.window for s in config.layer_specs()] == [None, 4] * 3
    if kind == "olmo3":  # the sliding layers rotate unscaled, by their own base
        assert config.rope_local_base_freq == 500000.0 and config.rope_scaling_dict["factor"] == 4.0
        assert [s.rope for s in config.layer_specs()] == ["local"] * 3 + ["global"] + ["local"] * 3 + ["global"]


@pytest.mark.parametrize("built", ["olmo3"], indirect=True)
def test_logits_match_on_one_device(built, parity):
    """OLMo 3 only recombines components sharded elsewhere (post-norms and projection qk-norm:
    test_hf_models' olmo2; a scanned period of sliding and full layers: test_hf_gemma's gemma3)."""
    path, _, ref = built
    _, module, _, params = parity.load(path)
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["smollm3", "ministral"], indirect=True)
def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, model, ref = built
    single, got = fsdp_tp_parity(path, ref, q=stacked_q)
    print(f"{model.config.model_type}: max |logit diff| on one device {np.abs(single - ref).max():.2e}, "
          f"under fsdp_tp {np.abs(got - ref).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == model.config.model_type
    assert hf["layer_types"] == model.config.layer_types
    back = parity.export_matches(tmp_path, model, TOKENS, ref, TOL)
    if model.config.model_type == "smollm3":
        assert back.config.no_rope_layers == model.config.no_rope_layers


def test_nope_layers_are_a_feature_llama_does_not_express():
    """Every layer rotary is spelled None (as Llama's); NoPE layers export as SmolLM3 only."""
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, bos_token_id=None, eos_token_id=None)
    assert TransformerArch(**base, rope_layers=[1, 1]) == TransformerArch(**base)
    assert TransformerArch(**base, rope_layers=[1, 0]).rope_layers == (True, False)
    with pytest.raises(ModelError, match="rope_layers must give 2 layers"):
        TransformerArch(**base, rope_layers=[True])
    config = config_of(CONFIGS["smollm3"]())
    with pytest.raises(HFError, match=r"llama cannot express feature nope_layers \(rope_layers="):
        config_to_hf(config, family="llama")
    assert config_to_hf(config)["model_type"] == "smollm3"
    assert config_to_hf(config.replace(rope_layers=None, layer_types=None, sliding_window=None))[
        "model_type"] == "llama"


def test_smollm3_window_without_use_sliding_window_is_refused(tmp_path):
    """Sliding layers while use_sliding_window is false: transformers' eager and sdpa masks slide,
    flash attention does not; shardzoo refuses rather than pick one."""
    hf = SmolLM3Config(**DIMS, num_hidden_layers=2, sliding_window=4, layer_types=[S, F], pad_token_id=None)
    with pytest.raises(HFError, match="use_sliding_window=False"):
        config_of(hf)
