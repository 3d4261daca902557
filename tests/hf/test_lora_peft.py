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
from shardzoo.train.checkpoint import load_model_and_params

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
    from shardzoo.train.lora_io import _modules

    for layout, want in ((None, {("layers", True), ("layers_5", False), ("layers_6", False), ("layers_7", False)}),
                         ((0, 6, 1), {("layers", True), ("layers_6", False), ("layers_7", False)})):
        # auto: layers 0-4 (local) scanned, 5 (global), 6, 7 unrolled; or one period of 6 (sub_j)
        config = get_config("gemma3-tiny").replace(lora_rank=4, lora_targets=("q", "down"), scan_layout=layout)
        mods = _modules(config, "gemma3_text")
        for target, hf_name in (("q", "self_attn.q_proj"), ("down", "mlp.down_proj")):
            found = sorted(j for _, layers, _, t, name in mods if t == target for j in layers)
            assert found == list(range(config.num_hidden_layers))
            assert all(name == f"model.layers.{{i}}.{hf_name}" for _, _, _, t, name in mods if t == target)
        assert {(path[0], stacked) for path, _, stacked, _, _ in mods} == want
        subs = {path[1] for path, _, stacked, _, _ in mods if stacked}
        assert subs == ({"attn", "mlp"} if layout is None else {f"sub_{j}" for j in range(6)})
