"""Hugging Face safetensors <-> the param tree, for every family (by the family's weight map).

Import reads one tensor at a time, lazily, from a single or an indexed (sharded) safetensors
checkpoint, and builds every parameter straight into its sharding under the given rules and
mesh (``jax.make_array_from_callback``), so each device receives only its slice and a model
larger than one device imports. Export writes what ``from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys

import jax
import numpy as np
from flax import traverse_util
from safetensors import safe_open

from shardzoo.models.hf import multimodal
from shardzoo.models.hf.base import HFError, Weight, read_hf_config
from shardzoo.models.hf.registry import (
    config_to_hf,
    family_of_config,
    family_of_model_type,
    load_hf_config,
    write_hf_config,
)
from shardzoo.models.transformer import VOCAB_PARAMS

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ------------------------------------------------------------------------------ weight names
def _names(w: Weight, i: int | None) -> list[str]:
    name = w.name.replace("{i}", str(i)) if i is not None else w.name
    if w.experts and not w.stacked_experts:
        return [name.replace("{e}", str(e)) for e in range(w.experts)]
    return [name]


def _widths(w: Weight) -> tuple[int, ...]:
    return w.widths or (1,) * w.part[1]


def _block(w: Weight, columns: int) -> slice:
    """The columns of a fused tensor (``columns`` wide) that make leaf ``w``."""
    widths, j = _widths(w), w.part[0]
    unit = columns // sum(widths)
    return slice(unit * sum(widths[:j]), unit * sum(widths[: j + 1]))


def _hf_shape(w: Weight, leaf_shape) -> tuple[int, ...]:
    """The HF tensor's shape for a per-layer leaf shape (per expert, or with the experts in
    front when HF stacks them)."""
    shape = tuple(leaf_shape[1:] if w.experts else leaf_shape)
    if w.merged_experts:  # [expert * rows, cols]
        rows, *cols = _hf_shape(dataclasses.replace(w, merged_experts=False), leaf_shape)[1:]
        return (w.experts * rows, *cols)
    lead = (w.experts,) if w.stacked_experts else ()
    widths = _widths(w)
    if w.op == "copy" and w.part[1] == 1:  # whole (a scalar too: xIELU's beta and eps)
        return lead + shape
    if w.op == "copy":  # a part: its columns among the fused tensor's
        return lead + shape[:-1] + (shape[-1] * sum(widths) // widths[w.part[0]],)
    if w.op == "vec":
        return lead + (w.hf_shape or (math.prod(shape) * sum(widths) // widths[w.part[0]],))
    if w.op == "depthwise":  # [width, channels...] here, torch's Conv1d [channels, 1, width] there
        return lead + (math.prod(shape[1:]) * sum(widths) // widths[w.part[0]], 1, shape[0])
    fan_in = math.prod(shape[: w.n_in])
    fan_out = math.prod(shape[w.n_in:]) * sum(widths) // widths[w.part[0]]
    return lead + ((fan_out, fan_in) if w.op == "linear" else (fan_in, fan_out))


def hf_to_leaf(w: Weight, tensors: list[np.ndarray], leaf_shape) -> np.ndarray:
    """HF tensor(s) -> one per-layer shardzoo leaf (transposed, split, stacked, reshaped)."""
    out = []
    for t in tensors:
        t = t.reshape(w.experts, -1, t.shape[-1]) if w.merged_experts else t
        t = np.swapaxes(t, -1, -2) if w.op == "linear" else t  # per expert when HF stacks them
        t = t[:, 0, :].T if w.op == "depthwise" else t
        if w.part[1] > 1 and w.groups > 1:  # the part of every group
            t = t.reshape(t.shape[:-1] + (w.groups, -1))
            t = t[..., _block(w, t.shape[-1])]
            t = t.reshape(t.shape[:-2] + (-1,))
        elif w.part[1] > 1:
            t = t[..., w.part[0]::w.part[1]] if w.interleaved else t[..., _block(w, t.shape[-1])]
        out.append(t)
    arr = np.stack(out) if w.experts and not w.stacked_experts else out[0]
    arr = arr.reshape(leaf_shape)
    return np.roll(arr, arr.shape[-1] // 2, axis=-1) if w.halves_swapped else arr


def leaf_to_hf(w: Weight, leaf: np.ndarray) -> list[np.ndarray]:
    """The inverse of ``hf_to_leaf`` (before joining ``part`` blocks): HF tensor(s) of a leaf."""
    out = []
    stacked = w.experts and w.stacked_experts
    for a in (list(leaf) if w.experts and not stacked else [leaf]):
        a = np.roll(a, a.shape[-1] // 2, axis=-1) if w.halves_swapped else a  # its own inverse
        lead = a.shape[:1] if stacked else ()
        body = a.shape[len(lead):]
        if w.op == "vec":
            a = a.reshape(lead + (w.hf_shape or (-1,)))
        elif w.op in ("linear", "conv1d"):
            a = a.reshape(lead + (math.prod(body[: w.n_in]), -1))
        elif w.op == "depthwise":
            a = np.ascontiguousarray(a.reshape(a.shape[0], -1).T[:, None, :])
        out.append(a)
    return out


# ----------------------------------------------------------------------------------- reading
class SafetensorsReader:
    """Lazy, tensor-at-a-time access to an HF directory's safetensors (one file or an index)."""

    def __init__(self, hf_dir: str):
        self.hf_dir, self._handles = hf_dir, {}
        self._fp8_block = fp8_block(hf_dir)
        index = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self._where = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFError(f"{index}: cannot read its weight_map: {e}") from None
        else:
            files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
            if not files:
                raise HFError(f"{hf_dir}: no {SINGLE_FILE} nor {INDEX_FILE}")
            self._where = {name: file for file in files for name in self._handle(file).keys()}

    def _handle(self, file: str):
        if file not in self._handles:
            path = os.path.join(self.hf_dir, file)
            if not os.path.isfile(path):
                raise HFError(f"{self.hf_dir}: shard {file} named in {INDEX_FILE} does not exist")
            try:
                self._handles[file] = safe_open(path, framework="np")
            except Exception as e:  # noqa: BLE001 - safetensors' own error type: a bad file
                raise HFError(f"{path}: not a readable safetensors file (truncated or damaged?): "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return self._handles[file]

    def resolve(self, name: str) -> str | None:
        """The stored name (GPT-2 files from the Hub lack the ``transformer.`` prefix; a
        ``llama4`` directory that transformers' AutoModelForCausalLM saved, ``language_model.``; an
        MXFP4 tensor is stored as ``{name}_blocks`` and ``{name}_scales``; a multimodal checkpoint's text
        model, ``multimodal.stored_names``)."""
        if name in self._where or self._mxfp4(name):
            return name
        bare = name.removeprefix("transformer.").removeprefix("language_model.")
        if bare in self._where:
            return bare
        return next((n for n in multimodal.stored_names(name) if n in self._where), None)  # gemma3's text

    def _mxfp4(self, name: str) -> bool:
        return name not in self._where and f"{name}_blocks" in self._where and f"{name}_scales" in self._where

    def _raw_shape(self, stored: str) -> tuple[int, ...]:
        return tuple(self._handle(self._where[stored]).get_slice(stored).get_shape())

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self.resolve(name)
        if self._mxfp4(stored):  # blocks [..., out, groups, 16] -> [..., in = groups * 32, out]
            *lead, out, groups, _ = self._raw_shape(f"{stored}_blocks")
            return (*lead, groups * 32, out)
        return self._raw_shape(stored)

    def get(self, name: str) -> np.ndarray:
        stored = self.resolve(name)
        if self._mxfp4(stored):
            blocks, scales = self._get(f"{stored}_blocks"), self._get(f"{stored}_scales")
            return dequantize_mxfp4(blocks, scales, f"{self.hf_dir}: {stored}")
        if self._fp8_block and f"{stored}_scale_inv" in self._where:
            return dequantize_fp8(self._get(stored), self._get(f"{stored}_scale_inv"), self._fp8_block,
                                  f"{self.hf_dir}: {stored}")
        return self._get(stored)

    def _get(self, stored: str) -> np.ndarray:
        file = self._where[stored]
        try:
            if self._handle(file).get_slice(stored).get_dtype() in FP8_DTYPES:  # numpy has no float8: ml_dtypes'
                return _raw_fp8(os.path.join(self.hf_dir, file), stored)
            return self._handle(file).get_tensor(stored)
        except HFError:
            raise
        except Exception as e:  # noqa: BLE001 - a tensor past the end of a truncated file
            raise HFError(f"{os.path.join(self.hf_dir, file)}: cannot read tensor {stored!r} (truncated "
                          f"or damaged?): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def fp8_block(hf_dir: str) -> tuple[int, int] | None:
    """The [out, in] block of a block-wise FP8 checkpoint's scales (DeepSeek-V3's
    ``quantization_config``: ``quant_method: fp8``, ``weight_block_size``); None for another."""
    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            q = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size") or (128, 128)
    if len(block) != 2 or q.get("fmt", "e4m3") != "e4m3":
        raise HFError(f"{hf_dir}/config.json: quantization_config={q!r}: shardzoo dequantizes fp8 e4m3 weights "
                      "with one scale per [out, in] block (weight_block_size of two sizes)")
    return int(block[0]), int(block[1])


# safetensors' float8 dtypes, read through ml_dtypes (jax's) since numpy has none
FP8_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _raw_fp8(path: str, name: str) -> np.ndarray:
    """A float8 tensor of a safetensors file, from its header's byte offsets."""
    import ml_dtypes

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(size))[name]
        start, stop = meta["data_offsets"]
        f.seek(8 + size + start)
        data = f.read(stop - start)
    return np.frombuffer(data, getattr(ml_dtypes, FP8_DTYPES[meta["dtype"]])).reshape(meta["shape"])


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                   where: str = "FP8 tensor") -> np.ndarray:
    """A block-wise FP8 weight [out, in] as float32: each [block] tile times its ``scale_inv``
    [ceil(out / block[0]), ceil(in / block[1])] (as transformers' FP8 dequantization)."""
    rows, cols = weight.shape[-2:]
    tiles = (-(-rows // block[0]), -(-cols // block[1]))
    if scale_inv.shape[-2:] != tiles or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise HFError(f"{where}: FP8 weight {list(weight.shape)} with blocks {list(block)} needs scales "
                      f"{list(weight.shape[:-2]) + list(tiles)}, found {list(scale_inv.shape)}")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], -2), block[1], -1)[..., :rows, :cols]
    return weight.astype(np.float32) * scale


# the 16 values of an FP4 (e2m1) nibble, as transformers.integrations.mxfp4's FP4_VALUES
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, where: str = "MXFP4 tensor") -> np.ndarray:
    """An MXFP4 tensor as float32, laid out as transformers' ``convert_moe_packed_tensors``
    gives it: ``blocks`` uint8 [..., out, groups, 16] (two FP4 values a byte, the low nibble
    first), ``scales`` uint8 [..., out, groups] (a power of two per group of 32, biased by 127)
    -> [..., groups * 32, out] (the input features first, as GPT-OSS's experts are stored)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise HFError(f"{where}: MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales "
                      f"{list(scales.shape)} {scales.dtype} must be uint8, the scales one per block")
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
    values[..., 0::2], values[..., 1::2] = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    values = values.reshape(scales.shape[:-1] + (-1,))  # [..., out, in]
    return np.ascontiguousarray(np.swapaxes(values, -1, -2))


def _index_key(index, shape) -> tuple:
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=True))


def put_leaf(shape, dtype, sharding, read, n_layers: int | None = None) -> jax.Array:
    """A global array built from host data, each device given only its slice.

    ``read()`` gives the whole leaf; with ``n_layers``, ``read(i)`` gives layer ``i`` of a
    leaf stacked on its first axis, and each layer is read once and copied into the slices
    of the devices that hold it.
    """
    device_indices = sharding.addressable_devices_indices_map(shape).values()
    indices = {_index_key(idx, shape): idx for idx in device_indices}  # one per distinct slice
    if n_layers is None:
        full = read()
        slices = {key: np.asarray(full[idx], dtype) for key, idx in indices.items()}
    else:
        slices = {key: np.empty(sharding.shard_shape(shape), dtype) for key in indices}
        for i in range(n_layers):
            layer = read(i)
            for key, idx in indices.items():
                start, stop, step = key[0]
                if i in range(start, stop, step):
                    slices[key][(i - start) // step] = layer[idx[1:]]
    return jax.make_array_from_callback(
        shape, sharding, lambda idx: slices[_index_key(idx, shape)], dtype
    )


def load_hf_params(hf_dir: str, target, config=None):
    """The HF directory's weights placed like ``target`` (a params tree of ShapeDtypeStructs
    with shardings, e.g. the trainer's): each leaf read, converted to its dtype, and sent slice
    by slice to the devices that hold it. ``config`` (default: from config.json) must be the
    model ``target`` was made from."""
    config = load_hf_config(hf_dir) if config is None else config
    where = os.path.join(hf_dir, "config.json")
    family = family_of_model_type(read_hf_config(hf_dir).get("model_type"), where)
    flat = traverse_util.flatten_dict(target)
    reader = SafetensorsReader(hf_dir)
    glob, groups = _layer_weights(config, family)
    plan = [(w.path, (None,), False, w) for w in glob]
    plan += [(prefix + w.path, layers, stacked, w) for prefix, layers, stacked, ws in groups for w in ws]
    hf_shapes = {path: jax.ShapeDtypeStruct(_unpadded(config, path, leaf.shape), leaf.dtype)
                 for path, leaf in flat.items()}  # the vocab rows HF has (vocab_pad_multiple)
    _check(plan, hf_shapes, reader, hf_dir)
    params = {}
    for path, layers, stacked, w in _bar(plan, "import"):
        leaf = flat[path]
        if stacked:  # scanned: per-layer reads stacked on the device
            read = functools.partial(_read_stacked, reader, w, leaf.shape[1:], layers)
            params[path] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding, read, leaf.shape[0])
        else:
            read = functools.partial(_read, reader, w, hf_shapes[path].shape, layers[0])
            if hf_shapes[path].shape != leaf.shape:  # padding rows: zeros
                read = functools.partial(_padded, read, leaf.shape)
            params[path] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding, read)
    return traverse_util.unflatten_dict(params)


def _unpadded(config, path, shape) -> tuple[int, ...]:
    """``shape`` of the parameter at ``path`` without the vocab rows ``vocab_pad_multiple`` adds."""
    axis = VOCAB_PARAMS.get(path)
    if axis is None or getattr(config, "padded_vocab", None) in (None, config.vocab_size):
        return tuple(shape)
    return tuple(config.vocab_size if k == axis else n for k, n in enumerate(shape))


def _padded(read, shape) -> np.ndarray:
    x = read()
    return np.pad(x, [(0, want - have) for have, want in zip(x.shape, shape, strict=True)])


def _bar(items: list, desc: str):
    """``items`` with a tqdm bar (an ETA) on stderr while a large checkpoint is read or written:
    only on a terminal (a log or a pipe gets none) and on process 0."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="leaf", file=sys.stderr, leave=False,
                disable=None if jax.process_index() == 0 else True)


def _pieces(w: Weight, i: int | None) -> list[str]:
    return [p.replace("{i}", str(i)) if i is not None else p for p in w.pieces]


def _get(reader, w: Weight, name: str, i: int | None) -> np.ndarray:
    """HF tensor ``name``, or the join of ``w.pieces``."""
    return np.concatenate([reader.get(p) for p in _pieces(w, i)]) if w.pieces else reader.get(name)


def _read(reader, w: Weight, shape, i: int | None) -> np.ndarray:
    """Leaf ``w`` (per-layer ``shape``) of layer ``i`` (None: a global leaf) from its HF tensors."""
    return hf_to_leaf(w, [_get(reader, w, n, i) for n in _names(w, i)], shape)


def _read_stacked(reader, w: Weight, shape, layers, k: int) -> np.ndarray:
    """Entry ``k`` of a stacked leaf: model layer ``layers[k]``."""
    return _read(reader, w, shape, layers[k])


def _layer_weights(config, family):
    """(global weights, [(path prefix, model layers, stacked, weights)]) by the config's
    ``param_layout`` (a stack, a stack per position of a scanned period, unrolled layers); the
    layers of one group are alike, so the first one's ``LayerSpec`` gives the group's tensors."""
    specs = config.layer_specs()
    groups = [(prefix, layers, stacked, family.layer_weights(config.arch, specs[layers[0]]))
              for prefix, layers, stacked in config.param_layout()]
    return score_weights(config.arch, family.global_weights(config.arch)), groups


def score_weights(arch, weights: list) -> list:
    """A reward model's global weights: HF's ``score.weight`` in place of the LM head."""
    if not getattr(arch, "score_head", False):
        return weights
    kept = [w for w in weights if w.path[0] not in ("lm_head", "lm_head_bias")]
    return kept + [Weight(("score", "kernel"), "score.weight", "linear")]


def _check(plan, shapes, reader, hf_dir) -> None:
    """Every parameter has a source; every source tensor exists, shaped as config.json implies."""
    unmapped = sorted("/".join(p) for p in set(shapes) - {p for p, _, _, _ in plan})
    if unmapped:
        raise HFError(f"{hf_dir}: no HF tensor maps to shardzoo parameter(s) {', '.join(unmapped)}")
    for path, layers, stacked, w in plan:
        if path not in shapes:
            raise HFError(f"{hf_dir}: HF tensor {w.name} has no shardzoo parameter "
                          f"{'/'.join(path)}")
        want = _hf_shape(w, shapes[path].shape[1:] if stacked else shapes[path].shape)
        for j in layers:
            if w.pieces:
                _check_pieces(w, j, want, reader, hf_dir)
                continue
            for name in _names(w, j):
                if reader.resolve(name) is None:
                    raise HFError(f"{hf_dir}: missing tensor {name!r} (for {'/'.join(path)})")
                if reader.shape(name) != want:
                    got = list(reader.shape(name))
                    raise HFError(f"{hf_dir}: tensor {name!r} has shape {got}, "
                                  f"config.json implies {list(want)}")


def _check_pieces(w: Weight, i: int, want, reader, hf_dir) -> None:
    """``w.pieces`` of layer ``i`` exist and join into ``want``."""
    names = _pieces(w, i)
    for name in names:
        if reader.resolve(name) is None:
            raise HFError(f"{hf_dir}: missing tensor {name!r} (a part of {w.name.replace('{i}', str(i))})")
    shapes = [reader.shape(n) for n in names]
    if any(s[1:] != tuple(want[1:]) for s in shapes) or sum(s[0] for s in shapes) != want[0]:
        raise HFError(f"{hf_dir}: tensors {', '.join(names)} have shapes {[list(s) for s in shapes]}; config.json "
                      f"implies {want[0]} rows of {list(want[1:])} between them")


# ----------------------------------------------------------------------------------- writing
def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def export_hf(config, params, out_dir: str, dtype=None, max_shard_bytes: int = 5 * 2**30,
              family: str | None = None, base: dict | None = None) -> dict:
    """Write ``config.json`` and safetensors (sharded with an index past ``max_shard_bytes``) that
    transformers' ``from_pretrained`` loads, in ``family``'s layout (default: the first family
    that expresses ``config``), keeping what ``base`` (the config.json it was imported from)
    says beyond the architecture (``config_to_hf``); with ``generation_config.json``. Returns
    the HF config dict."""
    import jax.numpy as jnp
    from safetensors.numpy import save_file

    hf_config = config_to_hf(config, dtype, family, base)
    out_dtype = jnp.dtype(dtype or config.param_dtype)
    flat = traverse_util.flatten_dict(params)
    glob, groups = _layer_weights(config, family_of_config(config, family))
    write = jax.process_index() == 0
    if write:
        os.makedirs(out_dir, exist_ok=True)
    shards, current, pending = [], {}, {}

    def flush():
        if current and write:
            file = f"model-tmp-{len(shards)}.safetensors"
            save_file(current, os.path.join(out_dir, file), metadata={"format": "pt"})
            shards.append((file, dict.fromkeys(current), sum(a.nbytes for a in current.values())))
        current.clear()

    def emit(w, i, leaf):
        for name, a in zip(_names(w, i), leaf_to_hf(w, leaf), strict=True):
            parts = pending.setdefault(name, {})
            parts[w.part[0]] = a
            if len(parts) < w.part[1]:
                continue
            ordered = [parts[k] for k in range(w.part[1])]
            if w.pieces:  # each part under its own name
                del pending[name]
                for piece, part in zip(_pieces(w, i), ordered, strict=True):
                    current[piece] = np.asarray(part.astype(out_dtype), order="C")
                continue
            if len(ordered) == 1:  # whole (a scalar too)
                arr = ordered[0]
            elif w.interleaved:  # column c of part j at c * n + j
                arr = np.stack(ordered, axis=-1).reshape(ordered[0].shape[:-1] + (-1,))
            elif w.groups > 1:  # each group's parts in turn
                grouped = [o.reshape(o.shape[:-1] + (w.groups, -1)) for o in ordered]
                arr = np.concatenate(grouped, axis=-1).reshape(ordered[0].shape[:-1] + (-1,))
            elif w.op == "depthwise":  # [channels, 1, width]: the parts' channels in turn
                arr = np.concatenate(ordered, axis=0)
            else:
                arr = np.concatenate(ordered, axis=-1)
            arr = np.asarray((np.swapaxes(arr, -1, -2) if w.op == "linear" else arr).astype(out_dtype),
                             order="C")  # (ascontiguousarray would make a scalar 1-d)
            if w.merged_experts:
                arr = arr.reshape(-1, arr.shape[-1])
            del pending[name]
            if current and sum(a.nbytes for a in current.values()) + arr.nbytes > max_shard_bytes:
                flush()
            current[name] = arr

    for w in glob:  # without the vocab padding rows
        leaf = _to_host(flat[w.path])
        emit(w, None, leaf[tuple(slice(0, n) for n in _unpadded(config, w.path, leaf.shape))])
    leaves = [(prefix, layers, stacked, w) for prefix, layers, stacked, ws in groups for w in ws]
    for prefix, layers, stacked, w in _bar(leaves, "export"):
        leaf = _to_host(flat[prefix + w.path])
        for j, layer in (zip(layers, leaf, strict=True) if stacked else [(layers[0], leaf)]):
            emit(w, j, layer)
    flush()
    if not write:
        return hf_config
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, shards[0][0]), os.path.join(out_dir, SINGLE_FILE))
    else:
        weight_map, total = {}, 0
        for k, (file, names, nbytes) in enumerate(shards):
            final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(os.path.join(out_dir, file), os.path.join(out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
            total += nbytes
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    write_hf_config(hf_config, out_dir)
    return hf_config
