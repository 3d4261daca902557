"""``train/io/sources.py``: one opener recognises a run, a checkpoint step, an HF model dir and a
PEFT adapter dir, and says in one line what a wrong path is. Uses copies of the run directories
kept under tests/fixtures/legacy_runs."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from shardzoo.train.io.sources import SourceError, classify, load_model_and_params, open_source

LEGACY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "legacy_runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    for name in ("llama_run", "lora_run"):
        shutil.copytree(os.path.join(LEGACY, name), root / name)
    adapter = root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
         "base_model_name_or_path": "base"}))
    return root


def test_each_kind_is_recognised(runs):
    run = runs / "llama_run"
    assert classify(str(run)) == "run" and classify(str(run / "checkpoints")) == "run"
    assert classify(str(run / "checkpoints" / "2")) == "step"
    assert classify(str(runs / "adapter")) == "adapter" and classify(str(run / "tokenizer")) is None
    source = open_source(run)
    assert (source.kind, source.family, source.model, source.steps) == ("run", "llama", "llama-tiny", [2])
    assert source.tokenizer == str(run / "tokenizer") and source.meta["seq_len"] == 16
    assert open_source(run / "checkpoints" / "2").steps == [2]
    lora = open_source(runs / "lora_run")
    assert lora.lora_base.endswith("llama_run") and lora.config.lora_rank == 2
    adapter = open_source(runs / "adapter", what="--lora-from", accept=("adapter",))
    assert adapter.config["r"] == 2 and adapter.lora_base == "base"


def test_a_step_and_a_whole_run_load_the_same_params(runs):
    _, _, whole, tokenizer = load_model_and_params(str(runs / "llama_run"))
    _, _, step, _ = load_model_and_params(str(runs / "llama_run" / "checkpoints" / "2"))
    assert tokenizer == str(runs / "llama_run" / "tokenizer")
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(step), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("layout", [dict(scan_layers=False), dict(scan_layout=(1, 1, 1))])
def test_a_run_loads_into_another_layer_layout_with_its_logits(runs, layout):
    """A run of scanned layers loads into a model that unrolls them (or scans fewer): each
    layer's params moved out of the stack, the logits those of the run's own layout (1e-6)."""
    from shardzoo.sharding import get_rules, make_mesh
    from shardzoo.train.program import Program

    module, config, params, _ = load_model_and_params(str(runs / "llama_run"))
    assert config.layout().repeats == 2  # the run scanned its two layers
    other = config.replace(**layout)
    program = Program(other, get_rules("fsdp"), make_mesh("fsdp=2", devices=jax.devices()[:2]))
    moved = open_source(runs / "llama_run").load_params(program.params_target(), other)
    expected = "layers_0" if layout.get("scan_layers") is False else "layers"
    assert expected in moved and set(moved) != set(params)
    tokens = np.arange(1, 33, dtype=np.int32).reshape(2, 16) % config.vocab_size
    want = jax.jit(module.apply)({"params": params}, tokens)  # jitted: cheaper than the ops one by one
    got = jax.jit(program.module.apply)({"params": moved}, tokens)
    assert np.max(np.abs(np.asarray(want) - np.asarray(got))) < 1e-6


@pytest.mark.parametrize("path, kwargs, expected", [
    ("nope", {}, "--init-from {root}/nope: no such directory"),
    ("llama_run/run.json", {}, "is a file, not a directory"),
    ("llama_run/tokenizer", {}, "is a directory but not a Hugging Face model directory (no config.json"),
    ("adapter", {}, "is a PEFT adapter directory, not a Hugging Face model directory, a shardzoo run or a "
                    "checkpoint step; give its base model to --init-from and the adapter to --lora-from"),
    ("llama_run", {"what": "--hf", "accept": ("hf",)}, "--hf {root}/llama_run is a shardzoo run, not a "
                                                       "Hugging Face model directory"),
    ("llama_run", {"step": 7}, "has no checkpoint of --step 7 (it has steps 2)"),
    ("llama_run/checkpoints/2", {"step": 1}, "is the checkpoint of step 2, not --step 1"),
])
def test_a_wrong_path_is_one_line_naming_the_flag_and_what_it_is(runs, path, kwargs, expected):
    with pytest.raises(SourceError) as e:
        open_source(runs / path, **kwargs)
    assert expected.format(root=runs) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["llama_run", "lora_run", "gemma3_import", "qwen3_moe_import"])
def test_runs_written_before_the_family_layer_load_with_their_logits(name, tmp_path):
    """Checkpoints of the flat 56-field config (commit c2e18f3) load through today's records:
    the same layout (Gemma 3's period of 6 and its unrolled rest, the unscanned Qwen3-MoE with
    a dense layer, LoRA adapters) and the logits that version computed (float32, 1e-5)."""
    shutil.copytree(os.path.join(LEGACY, name), tmp_path / name)
    if name == "lora_run":  # its base, where the run recorded it, is not needed to load it
        shutil.copytree(os.path.join(LEGACY, "llama_run"), tmp_path / "llama_run")
    expected = np.load(os.path.join(LEGACY, "expected_logits.npz"))
    module, config, params, _ = load_model_and_params(str(tmp_path / name))
    assert config.arch.vocab_size == 260
    logits = np.asarray(jax.jit(lambda p, t: module.apply({"params": p}, t))(params, expected["tokens"]))
    np.testing.assert_allclose(logits, expected[name], atol=1e-5, rtol=0)
    if name == "gemma3_import":
        assert set(params["layers"]) == {f"sub_{j}" for j in range(6)} and "layers_7" in params
        assert config.layer_types[5] == "full_attention" and config.layer_types.count("full_attention") == 1
    if name == "qwen3_moe_import":
        assert config.mlp_layer_types == ("moe", "dense", "moe")
