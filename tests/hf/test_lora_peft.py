"""LoRA on a Hugging Face model, end to end through the command line: train adapters on a tiny
random Llama (fsdp over 8 devices), export them merged (transformers) and as a PEFT adapter dir
(peft), and import that dir back to continue training."""

import json
import os
import sys

import jax
import numpy as np
import pytest
import torch
from flax import traverse_util
from peft import PeftModel
from transformers import AutoModelForCausalLM, LlamaConfig

from shardzoo import cli
from shardzoo.models.lora import is_adapter
from shardzoo.train.io.sources import load_model_and_params

sys.path.insert(0, os.path.dirname(__file__))
from harness import LLAMA, bpe_tokenizer  # noqa: E402

TEXT = ["the quick brown fox jumps over the lazy dog.", "a tiny corpus for a tiny tokenizer, hello world!"]
TRAIN = ["--data", "DATA", "--batch-size", "8", "--seq-len", "16", "--warmup-steps", "0",
         "--save-every", "0", "--eval-every", "0", "--log-every", "1", "--rules", "fsdp", "--mesh", "fsdp=8"]
MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF dir of a tiny random Llama with a BPE tokenizer, a jsonl of text, ids to score)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), attn_implementation="eager")
    hf_dir = str(root / "hf")
    model.save_pretrained(hf_dir)
    tok = bpe_tokenizer(hf_dir, TEXT).backend_tokenizer
    data = str(root / "data.jsonl")
    with open(data, "w") as f:
        for line in TEXT * 20:
            f.write(json.dumps({"text": line}) + "\n")
    ids = np.asarray([tok.encode(TEXT[0]).ids[:12]], np.int32)
    return hf_dir, data, ids


def _train(extra, data):
    return cli.main(["train", *[data if a == "DATA" else a for a in TRAIN], *extra])


def _ours(run, ids):
    module, config, params, _ = load_model_and_params(run)
    return config, params, np.asarray(jax.jit(lambda p: module.apply({"params": p}, ids))(params))


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


def test_lora_run_exports_merged_and_peft_and_imports_back(base, tmp_path, capsys):
    hf_dir, data, ids = base
    run = str(tmp_path / "run")
    assert _train(["--init-from", hf_dir, "--out", run, "--lora-rank", "4", "--lora-alpha", "8",
                   "--steps", "6", "--lr", "3e-2"], data) == 0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    assert losses[-1] < losses[0], losses
    config, params, ours = _ours(run, ids)
    assert config.lora_rank == 4
    base_model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    assert np.max(np.abs(ours - _torch_logits(base_model, ids))) > 1e-3  # the adapters did something

    merged = str(tmp_path / "merged")
    capsys.readouterr()
    assert cli.main(["export-hf", run, merged]) == 2  # adapters are never dropped silently
    assert "--merge-lora" in capsys.readouterr().err
    assert cli.main(["export-hf", run, merged, "--merge-lora"]) == 0
    model = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    np.testing.assert_allclose(_torch_logits(model, ids), ours, rtol=0, atol=1e-4)

    adapter = str(tmp_path / "adapter")
    assert cli.main(["export-lora", run, adapter]) == 0
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        conf = json.load(f)
    assert (conf["r"], conf["lora_alpha"], set(conf["target_modules"])) == (4, 8.0, MODULES)
    assert conf["base_model_name_or_path"] == os.path.abspath(hf_dir)
    peft_model = PeftModel.from_pretrained(base_model, adapter).eval()
    np.testing.assert_allclose(_torch_logits(peft_model, ids), ours, rtol=0, atol=1e-4)

    # imported back (one step at lr 0 leaves it as loaded): the same adapters, the same logits
    again = str(tmp_path / "again")
    assert _train(["--init-from", hf_dir, "--out", again, "--lora-from", adapter, "--steps", "1",
                   "--lr", "0"], data) == 0
    config2, params2, logits2 = _ours(again, ids)
    assert (config2.lora_rank, config2.lora_alpha) == (4, 8.0)
    flat, flat2 = traverse_util.flatten_dict(params), traverse_util.flatten_dict(params2)
    for key in flat:
        if is_adapter(key):  # a transpose and reshape each way: exact
            np.testing.assert_array_equal(np.asarray(flat2[key]), np.asarray(flat[key]), err_msg=str(key))
    np.testing.assert_allclose(logits2, ours, rtol=0, atol=1e-5)


def test_peft_module_names_follow_a_layer_pattern_layout():
    """Gemma 3's period stacks (layers/sub_j) and unrolled remainder (layers_6, layers_7): each
    model layer's adapters get exactly one PEFT module name, with its own layer number."""
    from shardzoo.models import get_config
    from shardzoo.train.io.peft import adapted_modules

    for layout, want in ((None, {("layers", True), ("layers_5", False), ("layers_6", False), ("layers_7", False)}),
                         ((0, 6, 1), {("layers", True), ("layers_6", False), ("layers_7", False)})):
        # auto: layers 0-4 (local) scanned, 5 (global), 6, 7 unrolled; or one period of 6 (sub_j)
        config = get_config("gemma3-tiny").replace(lora_rank=4, lora_targets=("q", "down"), scan_layout=layout)
        mods = adapted_modules(config, "gemma3_text")
        for target, hf_name in (("q", "self_attn.q_proj"), ("down", "mlp.down_proj")):
            found = sorted(j for _, layers, _, t, name, _ in mods if t == target for j in layers)
            assert found == list(range(config.num_hidden_layers))
            assert all(name == f"model.layers.{{i}}.{hf_name}" for _, _, _, t, name, _ in mods if t == target)
        assert {(path[0], stacked) for path, _, stacked, _, _, _ in mods} == want
        subs = {path[1] for path, _, stacked, _, _, _ in mods if stacked}
        assert subs == ({"attn", "mlp"} if layout is None else {f"sub_{j}" for j in range(6)})


MLA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
           q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=False)  # a dense layer, then MoE ones
LATENT = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}


@pytest.fixture(scope="module")
def deepseek(base, tmp_path_factory):
    """A tiny random DeepSeek-V3 (latent attention, a dense layer then MoE ones) with the BPE tokenizer."""
    from transformers import DeepseekV3Config

    hf_dir = str(tmp_path_factory.mktemp("deepseek") / "hf")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(DeepseekV3Config(**MLA), attn_implementation="eager").save_pretrained(hf_dir)
    bpe_tokenizer(hf_dir, TEXT)
    return hf_dir


def test_default_targets_are_every_projection_deepseek_has_and_the_run_says_so(deepseek):
    """PEFT's all-linear: q_a, q_b, kv_a (with k_rope: HF's one kv_a_proj_with_mqa), kv_b, o and the
    dense and shared-expert MLPs; the lines a run prints first name them and what is left."""
    from shardzoo.models.hf import load_hf_config
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.io.lora_io import lora_lines, with_lora

    config = with_lora(TrainConfig(out="x", lora_rank=4), load_hf_config(deepseek))
    assert config.lora_targets == ("o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b")
    adapts, left = lora_lines(config)
    for target in ("q_a (attn)", "q_b (attn)", "kv_a (attn)", "kv_b (attn)", "o (attn)", "gate (mlp/shared_expert)"):
        assert target in adapts, adapts
    assert adapts.startswith("LoRA rank 4: adapts ") and "q (" not in adapts
    assert left == "LoRA: not adapted: routed experts and routers, embeddings and lm head, norms"


def test_latent_attention_adapters_export_and_peft_gives_the_same_logits(base, deepseek, tmp_path, capsys):
    """q_a, q_b, kv_a, kv_b and o trained, listed before training, written by ``export-lora``
    (kv_a_proj_with_mqa as one adapter of rank 2r), every one loaded by peft: logits 1e-4."""
    _, data, ids = base
    run, adapter = str(tmp_path / "run"), str(tmp_path / "adapter")
    capsys.readouterr()
    assert _train(["--init-from", deepseek, "--out", run, "--lora-rank", "4", "--lora-targets", "q_a,q_b,kv_a,kv_b,o",
                   "--steps", "3", "--lr", "3e-2"], data) == 0
    first = capsys.readouterr().out
    assert "LoRA rank 4: adapts q_a (attn), q_b (attn), kv_a (attn), kv_b (attn), o (attn)\nLoRA: not adapted: gate, up, down," in first
    _, _, ours = _ours(run, ids)
    assert cli.main(["export-lora", run, adapter]) == 0
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        conf = json.load(f)
    assert set(conf["target_modules"]) == LATENT and conf["rank_pattern"] == {"kv_a_proj_with_mqa": 8}
    base_model = AutoModelForCausalLM.from_pretrained(deepseek, attn_implementation="eager").eval()
    assert np.max(np.abs(ours - _torch_logits(base_model, ids))) > 1e-3  # the adapters did something
    peft_model = PeftModel.from_pretrained(base_model, adapter).eval()
    loaded = {n.split("layers.")[1].split(".lora_A")[0] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert loaded == {f"{i}.self_attn.{m}" for i in range(3) for m in LATENT}
    np.testing.assert_allclose(_torch_logits(peft_model, ids), ours, rtol=0, atol=1e-4)


def test_named_targets_the_family_lacks_are_refused_before_training(base, tmp_path, capsys):
    hf_dir, data, _ = base
    capsys.readouterr()
    assert _train(["--init-from", hf_dir, "--out", str(tmp_path / "run"), "--lora-rank", "4",
                   "--lora-targets", "q,kv_a", "--steps", "1"], data) == 2
    err = capsys.readouterr().err
    assert "--lora-targets kv_a: llama has no such projection" in err, err
    assert not (tmp_path / "run").exists()
