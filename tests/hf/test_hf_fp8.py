"""Block-wise FP8 checkpoints (DeepSeek-V3's and MiMo-V2-Flash's published weights:
``quantization_config`` ``quant_method: fp8``, float8 e4m3 projections each with a
``weight_scale_inv`` per [128, 128] block): import dequantizes them, and the logits equal
transformers' model holding the dequantized weights (1e-4, float32); export writes them
dequantized without the quantization_config; a quantization shardzoo does not read is one line."""

import json
import os
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from shardzoo.models.hf import HFError, export_hf
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOL, apply, hf_logits, one_device, tiny_llama  # noqa: E402

BLOCK = (8, 16)  # [out, in]; the tiny model's 32-, 64- and 16-wide projections: whole and ragged tiles
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized(weight: torch.Tensor):
    """(float8 weight, scale_inv per BLOCK tile, the dequantized float32 weight): DeepSeek's
    recipe, each tile scaled so its largest magnitude is float8 e4m3's 448."""
    rows, cols = weight.shape
    tiles = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scale = torch.empty(tiles)
    for i in range(tiles[0]):
        for j in range(tiles[1]):
            tile = weight[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = tile.abs().max() / 448.0
    full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:rows, :cols]
    fp8 = (weight / full).to(torch.float8_e4m3fn)
    return fp8, scale, fp8.float() * full


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """(the FP8 directory, transformers' model with the dequantized weights, its logits)."""
    model = tiny_llama()
    path = tmp_path_factory.mktemp("fp8")
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    moved = 0.0
    for name in [n for n in tensors if n.split(".")[-2] in PROJECTIONS]:
        fp8, scale, dequantized = _quantized(tensors[name])
        moved = max(moved, (dequantized - tensors[name]).abs().max().item())
        tensors[name], tensors[f"{name}_scale_inv"] = fp8, scale
        model.get_parameter(name).data.copy_(dequantized)
    assert moved > 1e-3  # float8 rounding moved the weights: reading them raw would not pass
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path), model, hf_logits(model)


def test_fp8_weights_import_dequantized_and_equal_transformers(fp8_dir):
    path, _, ref = fp8_dir
    module, _, params = load_hf(path, mesh=one_device())
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)


def test_the_export_is_dequantized_and_loads_in_transformers(fp8_dir, tmp_path):
    path, model, ref = fp8_dir
    _, config, params = load_hf(path)
    with open(os.path.join(path, "config.json")) as f:
        base = json.load(f)  # as the CLI's export-hf passes the imported config.json
    export_hf(config, params, str(tmp_path), family="llama", base=base)
    with open(tmp_path / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    written = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert not any(n.endswith("_scale_inv") for n in written)
    assert {t.dtype for t in written.values()} == {torch.float32}
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_a_quantization_shardzoo_does_not_read_is_one_line(fp8_dir, tmp_path, method):
    path, _, _ = fp8_dir
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    os.symlink(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(HFError, match=f"quant_method='{method}'.*unquantized checkpoint") as e:
        load_hf(str(tmp_path))
    assert "\n" not in str(e.value)


def test_a_truncated_fp8_file_is_one_line_naming_it(fp8_dir, tmp_path):
    """An FP8 checkpoint whose file was cut short: one line naming the file, no traceback."""
    path, _, _ = fp8_dir
    for name in ("config.json", "model.safetensors"):
        data = open(os.path.join(path, name), "rb").read()
        with open(tmp_path / name, "wb") as f:
            f.write(data if name == "config.json" else data[: len(data) - 4096])
    with pytest.raises(HFError, match=r"model.safetensors: .*\(truncated or damaged\?\)") as e:
        load_hf(str(tmp_path))
    assert "\n" not in str(e.value)
