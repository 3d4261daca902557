"""Gemma 3n (``gemma3n_text``, and the text model of the multimodal ``gemma3n``): the components of
models/per_layer.py on a tiny random HF model with every mechanism on.

Four layers (sliding, full, sliding, full; a window of 6 in texts of 16), the last two attending
the keys and values of the first two (KV sharing of both kinds), three AltUp streams, per-layer
inputs (a table of 100 rows: ids past it read row 0), a Laurel branch of rank 4, activation
sparsity on the first two layers. Proofs: logits equal transformers' on one device (1e-4,
float32), greedy tokens equal over 16, export then ``from_pretrained`` equal; each mechanism moves
the logits; under fsdp_tp on 8 devices equal one device (1e-5) and transformers (1e-4).
Gemma 4's small models read the first two through the same components: a tiny ``gemma4_text``
with per-layer inputs, KV sharing and double-wide sharing MLPs has the three proofs too.
"""

import dataclasses
import json
import os
import sys

import jax
import numpy as np
import pytest
from safetensors.torch import save_file
from transformers import Gemma3nTextConfig, Gemma4TextConfig

from shardzoo.models.hf import load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    edit,
    near_one,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)
from test_hf_famE import DIMS as GEMMA4_DIMS  # noqa: E402
from test_hf_famE import GEMMA4, layer_scalars  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    # every mechanism on: KV sharing of both kinds, 3 streams, per-layer inputs (100 table rows),
    # Laurel, sparsity on layers 0 and 1
    "gemma3n_text": lambda: Gemma3nTextConfig(
        **DIMS, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=100, altup_num_inputs=3, num_kv_shared_layers=2,
        laurel_rank=4, activation_sparsity_pattern=[0.9, 0.5, 0.0, 0.0], altup_coef_clip=0.05),
}


# Gemma 4's global layers (their own heads, keys as values), per-layer inputs, the last two layers
# sharing keys and values with MLPs twice as wide
GEMMA4_SMALL = GEMMA4 | dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
                             use_double_wide_mlp=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, the model, its logits of TOKENS): every weight random, norms near 1."""
    return saved(randomized(CONFIGS["gemma3n_text"](), 0), tmp_path_factory.mktemp("gemma3n"))


@pytest.fixture(scope="module")
def loaded(built):
    """(module, config, params) of the HF directory on one device, and the logits of TOKENS for a
    config and params (``logits(config, params, train)``), op by op: quicker than compiling each
    variant of a tiny model."""
    module, config, params = load_hf(built[0], mesh=one_device())

    def logits(cfg=config, p=params, train=False):
        with jax.disable_jit():
            return np.asarray(cfg.build().apply({"params": p}, TOKENS, deterministic=not train,
                                                rngs={"dropout": jax.random.PRNGKey(0)} if train else None))
    return module, config, params, logits


def _without(config, **fields):
    """``config`` with fields of its per_layer record replaced."""
    return dataclasses.replace(config, arch=dataclasses.replace(
        config.arch, per_layer=dataclasses.replace(config.arch.per_layer, **fields)))


def _moved(a, b) -> float:
    return float(np.abs(a - b).max())


def test_the_config_reads_every_mechanism_and_the_layers_unrolled(built):
    p = load_hf_config(built[0]).arch.per_layer
    assert (p.input_size, p.vocab_size, p.kv_shared_layers, p.altup_inputs, p.laurel_rank) == (8, 100, 2, 3, 4)
    assert p.activation_sparsity == (0.9, 0.5, 0.0, 0.0) and p.altup_correct_scale
    config = load_hf_config(built[0])
    assert [s.shares_kv for s in config.layer_specs()] == [False, False, True, True]
    assert config.layout().repeats == 0  # nothing scanned
    assert config.num_params() == sum(t.numel() for t in built[1].parameters())


@pytest.mark.parametrize("field", ["activation_sparsity", "laurel_rank", "altup_inputs"])
def test_each_switchable_mechanism_moves_the_logits(loaded, field):
    """Off (its parameters left unused), the logits move by more than 100x the tolerance."""
    _, config, params, logits = loaded
    off = {"activation_sparsity": None, "laurel_rank": 0, "altup_inputs": 1}[field]
    assert _moved(logits(_without(config, **{field: off})), logits()) > 100 * TOL


def test_per_layer_inputs_move_the_logits(loaded):
    """The per-layer table and projection zeroed: each layer adds nothing of them."""
    _, _, params, logits = loaded
    zeroed = edit(edit(params, "['per_layer_embed']['embedding']", np.zeros_like),
                  "['per_layer_projection']['kernel']", np.zeros_like)
    assert _moved(logits(p=zeroed), logits()) > 100 * TOL


def test_kv_sharing_moves_the_logits(loaded):
    """Shared layers given copies of their source's k and v projections, computed from their own
    inputs, attend other keys."""
    _, config, params, logits = loaded
    own = dict(params)
    for i, source in ((2, 0), (3, 1)):
        attn = dict(own[f"layers_{i}"]["attn"]) | {n: params[f"layers_{source}"]["attn"][n] for n in ("k", "v", "k_norm")}
        own[f"layers_{i}"] = dict(own[f"layers_{i}"]) | {"attn": attn}
    assert _moved(logits(_without(config, kv_shared_layers=0), own), logits()) > 100 * TOL


def test_altup_coef_clip_moves_training_logits_only(loaded):
    """Training clips AltUp's coefficient weights to +-altup_coef_clip (0.05 here); without a clip
    a training forward (no dropout in the model) computes the eval logits."""
    _, config, _, logits = loaded
    np.testing.assert_allclose(logits(_without(config, altup_coef_clip=None), train=True), logits(), atol=1e-6)
    assert _moved(logits(train=True), logits()) > 100 * TOL


def test_fsdp_tp_equals_one_device_and_transformers(built, loaded):
    """The new parameters split over fsdp and tensor on 8 devices (data=2, fsdp=2, tensor=2): the
    logits equal one device's (1e-5) and transformers' (1e-4)."""
    path, _, ref = built
    one = loaded[3]()
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    spec = jax.sharding.PartitionSpec
    assert params["per_layer_projection"]["kernel"].sharding.spec == spec("fsdp", None)
    assert params["altup_in_1"]["kernel"].sharding.spec == spec("fsdp", "tensor")
    assert params["layers_0"]["attn"]["q"]["kernel"].sharding.spec == spec("fsdp", "tensor", None)
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, one, atol=1e-5, rtol=0)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)


def test_the_multimodal_checkpoint_reads_its_text_model(built, tmp_path, loaded):
    """A ``gemma3n`` config.json (the text model's as its text_config) with the tensors where
    Gemma3nForConditionalGeneration keeps them (``model.language_model.``; its vision and audio
    towers need timm, which is not installed: left out here) imports as the text model."""
    path, model, ref = built
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3n", "text_config": text,
                                                     "tie_word_embeddings": True}))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
               for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    module, _, params = load_hf(str(tmp_path), mesh=one_device())
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)


def test_a_layer_width_per_layer_is_refused_naming_the_field(built, tmp_path):
    with open(os.path.join(built[0], "config.json")) as f:
        hf = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(hf | {"intermediate_size": [64, 64, 32, 32]}))
    with pytest.raises(Exception, match="intermediate_size") as e:
        load_hf_config(str(tmp_path))
    assert len(str(e.value).splitlines()) == 1



def test_gemma4_per_layer_inputs_and_kv_sharing_match_transformers(tmp_path_factory, tmp_path, parity):
    """Gemma 4's E2B/E4B mechanisms (per-layer inputs, KV sharing, double-wide sharing MLPs): logits
    on one device, greedy tokens and the export round trip equal transformers'."""
    model = randomized(Gemma4TextConfig(**GEMMA4_DIMS, **GEMMA4_SMALL), 7, near_one(), layer_scalars)  # 7: a varied greedy text
    built4 = saved(model, tmp_path_factory.mktemp("gemma4_small"))
    config = load_hf_config(built4[0])
    assert config.arch.per_layer.double_wide_mlp and [s.shares_kv for s in config.layer_specs()] == [0, 0, 1, 1]
    assert config.num_params() == sum(t.numel() for t in model.parameters())
    test_logits_match_on_one_device(built4, parity)
    test_greedy_generate_matches_transformers(built4, parity)
    test_export_round_trip_loads_the_same_model(built4, tmp_path, parity)
