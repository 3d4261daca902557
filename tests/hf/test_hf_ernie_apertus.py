"""Ernie 4.5 (dense and MoE) and Apertus against transformers.

Ernie 4.5: Llama's layout with rotary embeddings on interleaved pairs (a feature of the shared
layers, as Cohere's), one ``use_bias`` flag for q/k/v, o and the MLP's projections, head_dim 128
when config.json has none; Ernie 4.5 MoE adds MoE layers from ``moe_layer_start_index`` (a
softmax router whose top-k is chosen with a correction bias added, weighted by the unbiased
probabilities; shared experts; the output head's bias with ``use_bias``). Apertus: xIELU (``hidden_act="xielu"``, a feature of the shared
layers: four scalars per layer's MLP, alpha_p and alpha_n learned through softplus), the norm of
each query and key head, an ungated MLP, llama3 rotary scaling by default.

Per family a tiny random HF model with its mechanisms on (Ernie: biases, head_dim 16 != hidden /
heads; Ernie MoE: a dense layer then two MoE layers of 4 experts top-2 with a shared expert, the
correction bias random, biases everywhere; Apertus: q/k/v/o biases, and every layer's xIELU
scalars drawn away from their init, eps -0.05 so that it acts): logits equal transformers' on
one device (Apertus's under fsdp_tp on 8 devices too, Ernie MoE's under ep), greedy tokens equal over 16, export then
``from_pretrained`` equal; each mechanism changes transformers' logits; ``shardzoo train``
moves alpha_p and alpha_n in every layer (not beta and eps: buffers in transformers). Presets
count as transformers' on the meta device. Tolerance: 1e-4 on float32 logits.
"""

import copy
import json
import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import ApertusConfig, AutoModelForCausalLM, Ernie4_5_MoeConfig, Ernie4_5Config

from shardzoo.models import ModelError, get_config
from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config
from shardzoo.models.hf.registry import PRESETS
from shardzoo.models.transformer import Transformer
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    bpe_tokenizer,
    fsdp_tp_parity,
    hf_logits,
    load_ep,
    one_device,
    randomized,
    rewritten,
    saved,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
ERNIE = dict(DIMS, head_dim=16, use_bias=True, rope_theta=10000.0)
ERNIE_MOE = dict(DIMS, num_hidden_layers=3, use_bias=True, moe_intermediate_size=16, moe_k=2, moe_num_experts=4,
                 moe_num_shared_experts=1)  # layer 0 dense (moe_layer_start_index 1)
APERTUS = dict(DIMS, attention_bias=True)  # llama3 rotary: ApertusConfig's default
SEED_MOE = 9  # a seed whose greedy continuation varies


def _draw(name, p):
    """Every weight random (biases and xIELU's alpha_p and alpha_n too), norm scales near 1."""
    return (1 + 0.1 * torch.randn_like(p) if "norm" in name
            else 0.5 * torch.randn_like(p) if "act_fn" in name else 0.15 * torch.randn_like(p))


def _xielu_buffers(name, b):
    """xIELU's buffers beta and eps drawn per layer (eps big enough to act: expm1(min(x, eps))
    differs from expm1(x) for x in (eps, 0])."""
    if name.endswith("act_fn.beta"):
        return 0.5 + 0.2 * torch.randn_like(b)
    if name.endswith("act_fn.eps"):
        return -0.05 * (1 + torch.rand_like(b))
    return None


def _build(tmp_path_factory, name, hf_config, seed):
    model = randomized(hf_config, seed, _draw, _xielu_buffers)
    return saved(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    return _build(tmp_path_factory, "ernie4_5", Ernie4_5Config(**ERNIE), seed=11)  # a seed whose greedy continuation varies


@pytest.fixture(scope="module")
def ernie_moe(tmp_path_factory):
    return _build(tmp_path_factory, "ernie4_5_moe", Ernie4_5_MoeConfig(**ERNIE_MOE), seed=SEED_MOE)


@pytest.fixture(scope="module")
def apertus(tmp_path_factory):
    return _build(tmp_path_factory, "apertus", ApertusConfig(**APERTUS), seed=7)


# ---------------------------------------------------------------------------------- configs
def test_the_configs_read_as_their_mechanisms(ernie, ernie_moe, apertus):
    e = load_hf_config(ernie[0])
    assert e.rope_interleaved and e.attention_bias and e.attention_out_bias and e.mlp_bias
    assert (e.head_size, e.kv_heads, e.mlp_type, e.tie_word_embeddings) == (16, 2, "gated", True)
    a = load_hf_config(apertus[0])
    assert (a.hidden_act, a.mlp_type, a.qk_norm) == ("xielu", "plain", "head")
    assert a.attention_bias and a.attention_out_bias and not a.mlp_bias and not a.tie_word_embeddings
    assert a.rope_theta == 12000000.0 and a.rope_scaling_dict["rope_type"] == "llama3"
    m = load_hf_config(ernie_moe[0])
    assert m.mlp_layer_types == ("dense", "moe", "moe") and m.moe.router_kind == "softmax_bias" and m.moe.norm_topk_prob
    assert (m.moe.num_local_experts, m.moe.num_experts_per_tok, m.expert_size, m.moe.shared_expert_intermediate_size) == (4, 2, 16, 16)
    assert m.lm_head_bias and m.mlp_bias and m.rope_interleaved and m.moe_dispatch == "dropless"
    for config, model in ((e, ernie[1]), (m, ernie_moe[1]), (a, apertus[1])):
        assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_transformers_defaults_where_config_json_is_silent(ernie, apertus, tmp_path):
    """Ernie: no head_dim means 128, no num_key_value_heads 2 (Ernie4_5Config's defaults, not
    hidden_size / heads and heads); Apertus: no rope_parameters nor rope_scaling means
    ApertusConfig's llama3 rotary at 12e6, whatever rope_theta says."""
    path = rewritten(ernie[0], tmp_path / "e", ["head_dim", "num_key_value_heads"])
    hf = json.loads((tmp_path / "e" / "config.json").read_text())
    assert "head_dim" not in hf and "rope_parameters" in hf
    config = load_hf_config(path)
    want = AutoModelForCausalLM.from_config(Ernie4_5Config(**{k: v for k, v in ERNIE.items()
                                                               if k not in ("head_dim", "num_key_value_heads")}))
    assert (config.head_size, config.kv_heads) == (want.config.head_dim, want.config.num_key_value_heads) == (128, 2)
    path = rewritten(apertus[0], tmp_path / "a", ["rope_parameters"], rope_theta=10000.0)
    config = load_hf_config(path)
    assert config.rope_theta == 12000000.0 and config.rope_scaling_dict["factor"] == 8.0


def test_ernie_moe_layer_range_and_a_norm_floor_it_cannot_compute(ernie_moe, tmp_path):
    """moe_layer_end_index -1 (or null) runs to the last layer; a moe_norm_min floor that
    would change the weights (shardzoo divides by their sum) is refused naming the field."""
    path = rewritten(ernie_moe[0], tmp_path / "a", moe_layer_end_index=-1, moe_layer_interval=2)
    assert load_hf_config(path).mlp_layer_types == ("dense", "moe", "dense")
    path = rewritten(ernie_moe[0], tmp_path / "b", moe_norm_min=0.5)
    with pytest.raises(HFError, match="moe_norm_min=0.5"):
        load_hf_config(path)


def test_xielu_with_experts_is_refused_naming_the_field():
    with pytest.raises(ModelError, match="hidden_act='xielu'.*num_local_experts=4"):
        get_config("mixtral-tiny", hidden_act="xielu")


# ------------------------------------------------------------------------------- mechanisms
def test_ernies_interleaved_rotary_and_biases_change_the_logits(ernie):
    """The same weights with rotate-half rotary (zoo), or without biases (transformers), give
    other logits: a family that dropped either could not pass the parity tests below."""
    path, model, ref = ernie
    module, config, params = load_hf(path, mesh=one_device())
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    got = apply(Transformer(config.replace(rope_interleaved=False)), params, one_device())
    assert np.abs(got - ref).max() > 1e-2
    other = AutoModelForCausalLM.from_config(Ernie4_5Config(**(ERNIE | dict(use_bias=False))),
                                             attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict(), strict=False)
    assert np.abs(hf_logits(other) - ref).max() > 1e-2


def test_ernie_moes_correction_bias_and_shared_expert_change_the_logits(ernie_moe):
    """Zeroing the correction bias (so the choice is the plain top-k) or the shared experts
    moves transformers' logits."""
    _, model, ref = ernie_moe
    for part in ("moe_statics", "shared_experts.down_proj"):
        other = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in other.named_parameters():
                if part in name:
                    p.zero_()
        assert np.abs(hf_logits(other) - ref).max() > 1e-3, part


def test_apertus_xielu_scalars_qk_norm_and_llama3_rope_change_the_logits(apertus):
    """In transformers: each xIELU scalar (alpha_p, alpha_n, beta, eps), xIELU itself (vs GELU
    on the same weights), the q/k norms and the llama3 scaling each move the logits."""
    _, model, ref = apertus
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        other = copy.deepcopy(model)
        with torch.no_grad():
            for layer in other.model.layers:
                t = getattr(layer.mlp.act_fn, name)
                t.copy_(t - 0.3 if name != "eps" else t * 0 - 1e-6)
        assert np.abs(hf_logits(other) - ref).max() > 1e-3, name
    other = AutoModelForCausalLM.from_config(ApertusConfig(**(APERTUS | dict(hidden_act="gelu"))),
                                             attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict(), strict=False)
    assert np.abs(hf_logits(other) - ref).max() > 1e-2
    other = copy.deepcopy(model)
    for layer in other.model.layers:
        layer.self_attn.q_norm, layer.self_attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    assert np.abs(hf_logits(other) - ref).max() > 1e-2
    other = AutoModelForCausalLM.from_config(
        ApertusConfig(**APERTUS, rope_parameters=dict(rope_type="default", rope_theta=12000000.0)),
        attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    assert np.abs(hf_logits(other) - ref).max() > 1e-3


# ----------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("family", ["ernie", "ernie_moe"])
def test_logits_match_on_one_device(family, request, parity):
    """Ernie 4.5 recombines components sharded elsewhere (interleaved rotary: test_hf_cohere; biases:
    test_hf_models' qwen2_window_layers and test_hf_dense_variants' arcee; the head's bias:
    test_hf_phi; its MoE: under ep below, under fsdp_tp with test_hf_models' mixtral)."""
    path, _, ref = request.getfixturevalue(family)
    _, module, _, params = parity.load(path)
    got = apply(module, params, one_device())
    print(f"{family}: max |logit diff| one device {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["apertus"])
def test_logits_match_on_one_device_and_under_fsdp_tp(family, request):
    """Apertus's xIELU scalars and head qk-norm under fsdp_tp."""
    path, model, ref = request.getfixturevalue(family)
    got, sharded = fsdp_tp_parity(path, ref)
    print(f"{family}: max |logit diff| one device {np.abs(got - ref).max():.2e}, "
          f"fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_ernie_moe_logits_match_under_ep_with_the_indexed_dispatch(ernie_moe):
    """Experts, router and correction bias split 4 ways; a slot for every token (capacity
    factor experts / k), so nothing is dropped, as in transformers."""
    path, _, ref = ernie_moe
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=4 / 2)
    bias = params["layers"]["moe"]["router_bias"]
    assert bias.shape == (2, 4) and bias.addressable_shards[0].data.shape == (2, 1)
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["ernie", "ernie_moe", "apertus"])
def test_greedy_generate_matches_transformers(family, request, parity):
    path, model, _ = request.getfixturevalue(family)
    parity.greedy_matches(path, model, TOKENS[:1, :8])


@pytest.mark.parametrize("family, model_type", [("ernie", "ernie4_5"), ("ernie_moe", "ernie4_5_moe"),
                                                    ("apertus", "apertus")])
def test_export_round_trip_loads_the_same_model(family, model_type, request, tmp_path, parity):
    path, model, ref = request.getfixturevalue(family)
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == model_type
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_apertus_exports_its_rotary_as_rope_parameters(apertus):
    """transformers reads an Apertus config.json without rope_parameters as llama3 at 12e6:
    a plain rotary exports explicitly."""
    config = load_hf_config(apertus[0]).replace(rope_scaling=None, rope_theta=10000.0)
    hf = config_to_hf(config)
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0} and "rope_scaling" not in hf
    assert ApertusConfig.from_dict(hf).rope_parameters == hf["rope_parameters"]


def test_families_without_xielu_or_interleaved_rotary_refuse_to_export_them(ernie, apertus):
    with pytest.raises(HFError, match=r"arcee cannot express feature xielu \(hidden_act='xielu'\)"):
        config_to_hf(load_hf_config(apertus[0]), family="arcee")
    with pytest.raises(HFError, match=r"llama cannot express feature rope_interleaved"):
        config_to_hf(load_hf_config(ernie[0]), family="llama")


# --------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", ["ernie-4.5-0.3b", "ernie4.5-tiny", "ernie-4.5-21b-a3b", "ernie4.5-moe-tiny",
                                  "apertus-8b", "apertus-tiny"])
def test_presets_count_as_transformers_on_the_meta_device(name):
    config = PRESETS[name]
    hf_config = config_to_hf(config)
    cls = {"ernie4_5": Ernie4_5Config, "ernie4_5_moe": Ernie4_5_MoeConfig,
           "apertus": ApertusConfig}[hf_config["model_type"]]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cls.from_dict(hf_config))
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    published = {"ernie-4.5-0.3b": 360_748_032, "ernie-4.5-21b-a3b": 21_825_437_888,  # "0.36B", "21.8B"
                 "apertus-8b": 8_053_338_176}
    if name in published:
        assert config.num_params() == published[name]


def test_apertus_trains_from_the_hf_dir_and_exports_its_moved_alphas(apertus, tmp_path):
    """``shardzoo train --init-from`` the tiny Apertus (a 128-id BPE tokenizer beside it) under
    fsdp on 8 devices: the loss falls, every layer's alpha_p and alpha_n move, beta and eps do
    not (transformers' buffers: no gradient, and the trainer decays no scalar); ``export-hf``
    loads in transformers and computes what the run's checkpoint computes (1e-4)."""
    import shutil

    from shardzoo import cli
    from shardzoo.train.io.sources import load_model_and_params
    from shardzoo.train.metrics import read_metrics

    hf_dir, run, out = str(tmp_path / "hf"), str(tmp_path / "run"), str(tmp_path / "export")
    shutil.copytree(apertus[0], hf_dir)
    text = [f"the {w} sat on the mat and the dog ran to the {w}." for w in ("cat", "bird", "fox", "cow")]
    bpe_tokenizer(hf_dir, text)
    data = str(tmp_path / "data.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in text * 20)
    assert cli.main(["train", "--init-from", hf_dir, "--data", data, "--out", run, "--steps", "8", "--batch-size", "8",
                     "--seq-len", "16", "--lr", "3e-3", "--warmup-steps", "0", "--save-every", "8",
                     "--eval-every", "0", "--log-every", "1", "--rules", "fsdp", "--mesh", "fsdp=8"]) == 0
    losses = [r["loss"] for r in read_metrics(os.path.join(run, "metrics.jsonl")) if "loss" in r]
    assert len(losses) == 8 and np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.2, losses
    assert cli.main(["export-hf", run, out]) == 0
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    for before, after in zip(apertus[1].model.layers, back.model.layers, strict=True):
        for name in ("alpha_p", "alpha_n"):
            assert not torch.allclose(getattr(after.mlp.act_fn, name), getattr(before.mlp.act_fn, name)), name
        for name in ("beta", "eps"):
            torch.testing.assert_close(getattr(after.mlp.act_fn, name), getattr(before.mlp.act_fn, name),
                                       rtol=0, atol=0)
    module, _, params, _ = load_model_and_params(run)
    got = np.asarray(jax.jit(lambda p, x: module.apply({"params": p}, x))(params, TOKENS[:2]))
    np.testing.assert_allclose(hf_logits(back, TOKENS[:2]), got, atol=TOL, rtol=0)
