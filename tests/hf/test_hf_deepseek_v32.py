"""DeepSeek-V3.2 and GLM-5: DeepSeek Sparse Attention (models/sparse_attention.py), a lightning
indexer beside latent attention keeping each query's ``index_topk`` keys (V3.2 rotating the
indexer's halves, GLM-5 its interleaved pairs), over DeepSeek-V3's MoE.

Tiny random HF models (16 indexer heads, so that no two keys tie at a row's k-th score; keeping
5 of up to 16 keys): logits equal transformers' on one device (both), under fsdp_tp, ep and cp on
8 devices (V3.2: the mechanism's sharded checks, once); decoding from the latent and indexer caches
equals the full forward; greedy tokens over 16 equal transformers'; export then
``from_pretrained`` equal; with every key selected transformers and shardzoo both give other
logits. The plan within 15% of the compiled step. Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import jax
import numpy as np
import pytest
from transformers import DeepseekV32Config, GlmMoeDsaConfig

from shardzoo.models import ModelError, get_config
from shardzoo.models.decode import cache_init_fn
from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.models.hf.base import HFError
from shardzoo.models.hf.registry import config_to_hf
from shardzoo.models.sparse_attention import top_k_mask
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    config_of,
    correction_bias,
    decoded,
    hf_logits,
    load_ep,
    one_device,
    randomized,
    rewritten,
    saved,
)

E, K, TOPK = 8, 2, 5
DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=16,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            index_n_heads=16, index_head_dim=16)
CONFIGS = {"deepseek_v32": DeepseekV32Config, "glm_moe_dsa": GlmMoeDsaConfig}


def build(family, path, **kw):
    """(HF dir, HF model, reference logits)."""
    return saved(randomized(CONFIGS[family](**DIMS | kw), 1, buffers=correction_bias), path)


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(family, HF dir, HF model, reference logits), the indexer keeping TOPK keys."""
    return request.param, *build(request.param, tmp_path_factory.mktemp(request.param), index_topk=TOPK)


def test_top_k_mask_keeps_each_rows_k_best_allowed_keys():
    """Against numpy's sort: the k best allowed keys of each row; all allowed ones where fewer."""
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, 7, 20)).astype(np.float32)
    allowed = np.tril(np.ones((7, 20), bool), k=10)[None] & (rng.random((3, 7, 20)) > 0.2)
    got = np.asarray(top_k_mask(scores, allowed, 6))
    for b in range(3):
        for i in range(7):
            ok = np.flatnonzero(allowed[b, i])
            best = ok[np.argsort(-scores[b, i, ok])[:6]]
            assert sorted(np.flatnonzero(got[b, i])) == sorted(best)
    assert got.sum(-1).max() == 6 and (got.sum(-1) == np.minimum(allowed.sum(-1), 6)).all()


def test_the_config_reads_the_indexer(built):
    family, path, model, _ = built
    config = load_hf_config(path)
    indexer = config.indexer  # the mixer's sub-record
    assert (indexer.topk, indexer.n_heads, indexer.head_dim) == (TOPK, 16, 16)
    assert indexer.rope_interleaved == (family == "glm_moe_dsa")
    assert config.rope_interleaved and config.moe.router_kind == "sigmoid_groups"
    assert [s.mlp for s in config.layer_specs()] == ["dense", "moe", "moe"]
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_logits_match_on_one_device(built):
    family, path, _, ref = built
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    indexer = params["layers"]["attn"]["indexer"]
    assert indexer["wq_b"]["kernel"].shape == (2, 24, 16, 16)  # [layers, q_lora, heads, head_dim]
    assert indexer["k_norm"]["bias"].shape == (2, 16)
    got = apply(module, params, one)
    print(f"{family} one device max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["deepseek_v32"], indirect=True)
def test_logits_match_under_fsdp_tp_ep_and_cp_on_8_devices(built):
    """The indexer's heads split over tensor (its scores summed across them), its projections over
    fsdp; the experts over expert=4; the row over context=4 (its tokens in the ring's zig-zag
    order, which neither the mask by position nor the selection depends on)."""
    _, path, _, ref = built
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    wq = params["layers"]["attn"]["indexer"]["wq_b"]["kernel"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    got = apply(module, params, mesh)
    print(f"fsdp_tp max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=E / K)
    got, _ = apply_mutable(module, params, mesh, ["metrics"])
    print(f"ep max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,context=4")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("cp"))
    got = apply(module, params, mesh)
    print(f"cp max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["deepseek_v32"], indirect=True)
def test_the_indexer_moves_the_logits(built, tmp_path):
    """The same weights keeping every key (index_topk 16, the row's length): transformers' logits
    move by more than 1e-2, and shardzoo's (its config overridden) are those."""
    _, path, model, ref = built
    dense = rewritten(path, tmp_path / "dense", index_topk=16)
    model.config.index_topk = 16
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = 16
    want = hf_logits(model)
    model.config.index_topk = TOPK
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = TOPK
    assert np.abs(want - ref).max() > 1e-2
    one = one_device()
    module, _, params = load_hf(dense, mesh=one, rules=get_rules("fsdp"))
    np.testing.assert_allclose(apply(module, params, one), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["glm_moe_dsa"], indirect=True)
def test_glm5s_indexer_rotates_pairs_and_that_moves_the_logits(built):
    """GLM-5's checkpoint read with the indexer's rotary on halves (V3.2's): other keys selected,
    logits off transformers' by more than 1e-3 (so the parity above tells the two apart)."""
    _, path, _, ref = built
    one = one_device()
    module, config, params = load_hf(path, mesh=one, rules=get_rules("fsdp"),
                                     overrides={"indexer_rope_interleaved": False})
    assert not config.indexer.rope_interleaved
    assert np.abs(apply(module, params, one) - ref).max() > 1e-3


@pytest.mark.parametrize("built", ["deepseek_v32"], indirect=True)
def test_decoding_from_the_latent_and_indexer_caches_equals_the_full_forward(built):
    """A prefill of 7 tokens then 9 single steps through the scanned layers' stacked cache give
    the full forward's logits (1e-5): the indexer's keys are cached beside the latent."""
    _, path, _, _ = built
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    full = apply(module, params, one)
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    attn = cache["layers"]["attn"]
    assert sorted(attn) == ["cache_index", "cached_index_key", "cached_latent", "cached_rope_key",
                            "cached_segment_ids"]
    assert attn["cached_index_key"].value.shape == (2, 4, 16, 16)  # [layers, batch, cache_length, head_dim]
    got = decoded(module, params, cache, TOKENS, prefill=7)
    print(f"max |decode - forward| {np.abs(got - full).max():.2e}")
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)


def test_greedy_generate_matches_transformers(built, parity):
    _, path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    family, path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["model_type"], hf["index_topk"], hf["index_n_heads"]) == (family, TOPK, 16)
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_glm5_index_sharing_is_refused():
    """GLM-5.2's IndexShare (layers reusing another layer's top-k) is not implemented: refused,
    naming indexer_types, whether config.json lists the types or gives their frequency."""
    base = GlmMoeDsaConfig(**DIMS).to_dict()
    for changes in (dict(indexer_types=["full", "shared", "full"]),
                    dict(indexer_types=None, index_topk_freq=2, index_skip_topk_offset=1)):
        with pytest.raises(HFError, match="indexer_types"):
            config_of(base | changes)


@pytest.mark.parametrize("change, named", [(dict(q_lora_rank=None), "q_lora_rank"),
                                           (dict(index_head_dim=4), "index_head_dim=4"),
                                           (dict(index_n_heads=0), "index_n_heads=0")])
def test_an_indexer_it_cannot_build_is_refused_naming_the_field(change, named):
    """The indexer reads the query latent and rotates its first qk_rope_head_dim (8) features."""
    with pytest.raises(ModelError, match=named):
        get_config("deepseek-v3.2-tiny").replace(**change)


@pytest.mark.parametrize("name,count", [("deepseek-v3.2", 671_877_929_216), ("glm-5", 743_911_199_232)])
def test_the_presets_count_as_transformers_does(name, count):
    """deepseek-v3.2 (DeepSeek-V3's published sizes and the indexer's: "671B", 685B with the
    multi-token-prediction layer transformers does not build) and glm-5 ("744B"): transformers'
    count of the exported config on the meta device, which the config reads back as."""
    config = get_config(name)
    assert config.num_params() == count
    assert config_of(config_to_hf(config)).arch == config.arch


def test_plan_counts_the_sparse_attention_layers_within_15_percent_of_the_compiled_step():
    """deepseek-v3.2-tiny (an indexer keeping 6 of 64 keys), 16 x 64 under fsdp=8: the plan's
    total and temporaries against XLA's."""
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.tasks.registry import run_program

    config = get_config("deepseek-v3.2-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules("fsdp"), make_mesh("fsdp=8"))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    print(totals, memory)
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
