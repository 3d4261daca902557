"""The command line: import-hf (sharded safetensors), generate (--checkpoint and --hf), export-hf
with the tokenizer carried over, and clear exit-2 errors for unsupported or incomplete inputs."""

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardzoo import cli
from shardzoo.models.hf import is_hf_dir
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.program import Program

sys.path.insert(0, os.path.dirname(__file__))
from harness import bpe_tokenizer, tiny_llama  # noqa: E402

TEXT = ["the quick brown fox jumps over the lazy dog.", "a tiny corpus for a tiny tokenizer, hello world!"]
PROMPT = "the lazy fox"
SHARDED = ["--rules", "fsdp_tp", "--mesh", "fsdp=4,tensor=2"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(sharded HF dir with tokenizer, single-file HF dir without, model, tokenizer)."""
    model = tiny_llama()
    sharded, single = tmp_path_factory.mktemp("sharded"), tmp_path_factory.mktemp("single")
    model.save_pretrained(sharded, max_shard_size="20KB")
    model.save_pretrained(single)
    return str(sharded), str(single), model, bpe_tokenizer(sharded, TEXT)


def test_import_generate_export_round_trip(llama, tmp_path, capsys):
    hf_dir, _, model, tokenizer = llama
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1  # really sharded
    run, out = str(tmp_path / "run"), str(tmp_path / "exported")

    assert cli.main(["import-hf", hf_dir, run]) == 0  # default: fsdp over all 8 devices
    assert os.path.isfile(os.path.join(run, "tokenizer", "tokenizer.json"))
    assert is_hf_dir(hf_dir) and not is_hf_dir(run)

    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():  # greedy, stopping at eos (id 2) like shardzoo
        want = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = tokenizer.decode(want[0], skip_special_tokens=True)
    assert expected.startswith(PROMPT) and len(expected) > len(PROMPT) + 8
    capsys.readouterr()
    for source in (["--checkpoint", run], ["--hf", hf_dir]):
        assert cli.main(["generate", *source, "--prompt", PROMPT, "--max-new-tokens", "16",
                         "--temperature", "0", *SHARDED]) == 0
        assert capsys.readouterr().out == expected + "\n"

    assert cli.main(["export-hf", run, out]) == 0
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert AutoTokenizer.from_pretrained(out)(PROMPT)["input_ids"] == ids


def test_sampling_is_seeded(llama, capsys):
    hf_dir = llama[0]
    flags = ["generate", "--hf", hf_dir, "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "1.5",
             "--top-k", "20", "--top-p", "0.9", *SHARDED]
    texts = []
    for seed in ("1", "1", "2"):
        capsys.readouterr()
        assert cli.main([*flags, "--seed", seed]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith(PROMPT)
    assert texts[0] != texts[2]

    def generate(*extra):
        capsys.readouterr()
        assert cli.main(["generate", "--hf", hf_dir, "--prompt", PROMPT, "--max-new-tokens", "8",
                         "--seed", "2", *extra, *SHARDED]) == 0
        return capsys.readouterr().out

    greedy = generate("--temperature", "0")
    assert greedy != texts[2]  # the sampled continuation is not the greedy one ...
    assert generate("--temperature", "1.5", "--top-k", "1") == greedy  # ... unless top-k keeps one
    assert generate("--temperature", "1.5", "--top-p", "0.001") == greedy  # or top-p does

    # With top_k=3 at a high temperature, each new token is among the 3 most likely of the
    # logits a full forward pass gives at its step (ranks within 1e-4, the cache's rounding).
    mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("fsdp")
    module, config, params = load_hf(llama[1], mesh=mesh, rules=rules)
    prompt = np.random.default_rng(0).integers(3, 128, (8, 4))
    out = Program(config, rules, mesh).decoding.generate(params, prompt, max_new_tokens=12, temperature=5.0,
                                                top_k=3, seed=0)
    logits = np.asarray(module.apply({"params": params}, out))[:, 3:-1]  # [batch, new, vocab]
    rank = (logits > np.take_along_axis(logits, out[:, 4:, None], -1) + 1e-4).sum(-1)
    assert rank.max() <= 2 and (rank > 0).mean() > 0.3  # not greedy either


def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    edit(str(dst))
    return str(dst)


def test_unknown_model_type_exits_2_naming_it(llama, tmp_path, capsys):
    def set_type(d):
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**config, "model_type": "rwkv"}, f)

    bad = _broken_copy(llama[1], tmp_path / "rwkv", set_type)
    assert cli.main(["import-hf", bad, str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "unsupported model_type 'rwkv'" in err and len(err.strip().splitlines()) == 1


def test_missing_tensor_exits_2_naming_it(llama, tmp_path, capsys):
    name = "model.layers.1.mlp.up_proj.weight"

    def drop(d):
        path = os.path.join(d, "model.safetensors")
        tensors = load_file(path)
        del tensors[name]
        save_file(tensors, path, metadata={"format": "pt"})

    bad = _broken_copy(llama[1], tmp_path / "missing", drop)
    assert cli.main(["import-hf", bad, str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"missing tensor {name!r}" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    assert cli.main(["generate", "--hf", bad, "--prompt", "x"]) == 2


def test_wrong_tensor_shape_exits_2(llama, tmp_path, capsys):
    def widen(d):
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**config, "intermediate_size": 96}, f)

    bad = _broken_copy(llama[1], tmp_path / "shape", widen)
    assert cli.main(["import-hf", bad, str(tmp_path / "run")]) == 2
    # gate/up projections are (out, in) = (intermediate, hidden) in the file
    assert "has shape [64, 32], config.json implies [96, 32]" in capsys.readouterr().err


def test_train_settings_rebuild_the_hf_model(llama, tmp_path):
    """``with_init_model`` (the trainer's --init-from HF_DIR wiring) gives the HF config itself,
    the user's overrides on top, and the tokenizer; no zoo preset is claimed."""
    from shardzoo.models.hf import load_hf_config
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.launch import with_init_model

    hf_dir = llama[0]
    cfg, config, meta = with_init_model(TrainConfig(out=str(tmp_path), init_from=hf_dir,
                                                    override=("remat_policy=full",)))
    assert cfg.tokenizer == hf_dir and not cfg.add_bos  # this BPE has no bos post-processor
    assert config == load_hf_config(hf_dir).replace(remat_policy="full")
    # config.json whole: an export writes back its fields beyond the architecture
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    assert meta == {"model": None, "family": "llama", "hf_config": hf_config} and cfg.model is None
    plain = TrainConfig(out=str(tmp_path))
    assert with_init_model(plain) == (plain, None, {})  # no --init-from: --model builds it
