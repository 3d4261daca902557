"""Hugging Face interop: ``config.json`` <-> ``TransformerConfig``, safetensors <-> the param tree.

Supported ``model_type``s: llama (Llama 2/3/3.1/3.2, rope_scaling llama3), mistral, qwen2 (2.5),
mixtral and gpt2. Import reads one tensor at a time, lazily, from a single or an indexed
(sharded) safetensors checkpoint, and builds every parameter straight into its sharding under
the given rules and mesh (``jax.make_array_from_callback``), so each device receives only its
slice and a model larger than one device imports. Export writes what ``from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import numpy as np
from flax import linen as nn
from flax import traverse_util
from safetensors import safe_open

from shardzoo.sharding.errors import UserError
from shardzoo.sharding.mesh import make_mesh
from shardzoo.sharding.partition import activate, logical_shardings
from shardzoo.sharding.rules import get_rules

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral", "gpt2")
# The zoo preset each family's imported config is recorded against (with every field overridden).
FAMILY_PRESETS = {"llama": "llama2-7b", "mistral": "mistral-7b", "qwen2": "qwen2.5-0.5b",
                  "mixtral": "mixtral-8x7b", "gpt2": "gpt2"}
ROPE_TYPES = ("default", "linear", "llama3")  # those models/layers.py's rope_inv_freq computes
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFError(UserError):
    """An HF model directory shardzoo cannot read (or a config it cannot write as one)."""


# ------------------------------------------------------------------------------- config.json
def read_hf_config(hf_dir: str) -> dict:
    """The parsed ``config.json`` of an HF model directory."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: cannot read: {e}") from None


def is_hf_dir(path) -> bool:
    """Whether ``path`` is an HF model directory: config.json with a model_type, and safetensors."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    try:
        with open(os.path.join(path, "config.json")) as f:
            has_type = "model_type" in json.load(f)
    except (OSError, ValueError):
        return False
    return has_type and any(n.endswith(".safetensors") for n in os.listdir(path))


def _rope(hf: dict, where: str) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling from either transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta`` + ``rope_scaling``; ``None`` for plain rotary embeddings."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: rope_scaling type {kind!r} is not supported; "
                      f"supported: {', '.join(ROPE_TYPES)}")
    return float(theta), scaling


def _sliding_window(hf: dict, where: str) -> int | None:
    window = hf.get("sliding_window")
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    kinds = set(hf.get("layer_types") or ())
    if window and kinds == {"full_attention"}:
        window = None
    if window and len(kinds) > 1:
        raise HFError(f"{where}: layer_types mixes sliding and full attention; "
                      "shardzoo has one window for all layers")
    return window


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """TransformerConfig fields (a dict) from an HF ``config.json``; names map one to one."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise HFError(
            f"{where}: unsupported model_type {kind!r}; supported: {', '.join(SUPPORTED)}"
        )
    special = {k: hf.get(k) for k in ("bos_token_id", "eos_token_id")}
    if isinstance(special["eos_token_id"], list):
        special["eos_token_id"] = tuple(special["eos_token_id"])
    if kind == "gpt2":
        needed = (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                  ("add_cross_attention", False))
        bad = [k for k, ok in needed if hf.get(k, ok) != ok]
        if bad:
            raise HFError(f"{where}: GPT-2 option {', '.join(bad)} is not supported")
        d = hf.get("n_embd", 768)
        return dict(
            vocab_size=hf.get("vocab_size", 50257), hidden_size=d,
            intermediate_size=hf.get("n_inner") or 4 * d, num_hidden_layers=hf.get("n_layer", 12),
            num_attention_heads=hf.get("n_head", 12), num_key_value_heads=None,
            max_position_embeddings=hf.get("n_positions", 1024),
            rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            hidden_act=hf.get("activation_function", "gelu_new"), mlp_type="plain",
            position_embedding="learned", norm_type="layernorm", attention_bias=True,
            attention_out_bias=True, mlp_bias=True,
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            initializer_range=hf.get("initializer_range", 0.02), **special,
        )
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise HFError(f"{where}: no {', '.join(missing)}")
    theta, scaling = _rope(hf, where)
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
        max_position_embeddings=hf.get("max_position_embeddings", 2048), rope_theta=theta,
        rope_scaling=scaling, partial_rotary_factor=hf.get("partial_rotary_factor", 1.0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), sliding_window=_sliding_window(hf, where),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        hidden_act=hf.get("hidden_act", "silu"),
        initializer_range=hf.get("initializer_range", 0.02), attention_bias=False,
        attention_out_bias=False, mlp_bias=False, **special,
    )
    if kind == "llama":  # one flag for q/k/v and o biases
        bias = hf.get("attention_bias", False)
        fields.update(attention_bias=bias, attention_out_bias=bias,
                      mlp_bias=hf.get("mlp_bias", False))
    elif kind == "qwen2":  # q/k/v biases, no o bias
        fields.update(attention_bias=True)
    elif kind == "mixtral":  # every layer MoE; no z-loss in HF's Mixtral; dropless = HF's routing
        fields.update(
            num_local_experts=hf.get("num_local_experts", 8),
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            router_jitter_noise=hf.get("router_jitter_noise", 0.0),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), router_z_loss_coef=0.0,
            moe_dispatch="dropless", norm_topk_prob=True,
        )
    return fields


def _hf_model_type(config) -> str:
    """The HF family that expresses ``config`` exactly; an HFError naming the obstacle if none."""
    c = config
    if c.position_embedding == "learned":
        need = dict(norm_type="layernorm", mlp_type="plain", attention_bias=True,
                    attention_out_bias=True, mlp_bias=True, num_local_experts=0)
        bad = [f"{k}={getattr(c, k)!r}" for k, v in need.items() if getattr(c, k) != v]
        heads = c.num_attention_heads
        if c.kv_heads != heads or c.head_size * heads != c.hidden_size:
            bad.append("grouped or resized heads")
        if bad:
            raise HFError(f"learned positions export as gpt2, which cannot express "
                          f"{', '.join(bad)}")
        return "gpt2"
    bad = [f"{k}={getattr(c, k)!r}" for k, v in (("norm_type", "rmsnorm"), ("mlp_type", "gated"))
           if getattr(c, k) != v]
    if bad:
        raise HFError(f"rotary models export as llama/mistral/qwen2/mixtral, which need "
                      f"{', '.join(bad)}")
    if c.num_local_experts:
        need = dict(moe_layer_freq=1, norm_topk_prob=True, attention_bias=False,
                    attention_out_bias=False)
        bad = [f"{k}={getattr(c, k)!r}" for k, v in need.items() if getattr(c, k) != v]
        if bad:
            raise HFError(f"MoE models export as mixtral, which needs {', '.join(bad)}")
        return "mixtral"
    if c.attention_bias and not c.attention_out_bias and not c.mlp_bias:
        return "qwen2"
    if c.attention_bias != c.attention_out_bias:
        raise HFError("attention_out_bias differs from attention_bias: no HF family expresses that")
    if c.sliding_window and not (c.attention_bias or c.mlp_bias):
        return "mistral"
    if c.sliding_window:
        raise HFError("sliding_window with biases: no HF family expresses that")
    return "llama"


def config_to_hf(config, dtype: str | None = None) -> dict:
    """An HF ``config.json`` dict for ``config`` (legacy rope keys: transformers 4 and 5 read them).
    """
    c, kind = config, _hf_model_type(config)
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
            "gpt2": "GPT2LMHeadModel"}[kind]
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    out = dict(architectures=[arch], model_type=kind, vocab_size=c.vocab_size,
               bos_token_id=c.bos_token_id, eos_token_id=eos,
               tie_word_embeddings=c.tie_word_embeddings, initializer_range=c.initializer_range,
               torch_dtype=dtype or c.param_dtype)
    if kind == "gpt2":
        return out | dict(n_embd=c.hidden_size, n_inner=c.intermediate_size,
                          n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
                          n_positions=c.max_position_embeddings, n_ctx=c.max_position_embeddings,
                          layer_norm_epsilon=c.rms_norm_eps, activation_function=c.hidden_act)
    out |= dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.kv_heads, head_dim=c.head_size,
                max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                rope_scaling=c.rope_scaling_dict or None, rms_norm_eps=c.rms_norm_eps,
                hidden_act=c.hidden_act, sliding_window=c.sliding_window)
    if c.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = c.partial_rotary_factor
    if kind == "llama":
        out |= dict(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    elif kind == "qwen2":
        out |= dict(use_sliding_window=bool(c.sliding_window), max_window_layers=0)
    elif kind == "mixtral":
        out |= dict(num_local_experts=c.num_local_experts,
                    num_experts_per_tok=c.num_experts_per_tok,
                    router_jitter_noise=c.router_jitter_noise,
                    router_aux_loss_coef=c.router_aux_loss_coef)
    return out


# ------------------------------------------------------------------------------ weight names
@dataclasses.dataclass(frozen=True)
class Weight:
    """One shardzoo leaf and the HF tensor(s) it is made of.

    ``op``: "copy" (same shape), "vec" (a bias, flat in HF), "linear" (HF ``nn.Linear`` (out, in))
    or "conv1d" (GPT-2 ``Conv1D`` (in, out)); the leaf's first ``n_in`` dims are the inputs.
    ``part`` (j, n): the leaf is the j-th of n equal column blocks (GPT-2's fused c_attn).
    ``experts``: ``{e}`` in the name runs over experts, stacked on the leaf's first axis.
    Names hold ``{i}`` for the layer.
    """

    path: tuple[str, ...]
    name: str
    op: str = "copy"
    n_in: int = 1
    part: tuple[int, int] = (0, 1)
    experts: int = 0


def weight_map(config, model_type: str) -> tuple[list[Weight], list[Weight], list[Weight]]:
    """(global weights, weights of a dense layer, weights of a MoE layer) with HF names."""
    if model_type == "gpt2":
        p = "transformer."
        glob = [Weight(("embed", "embedding"), p + "wte.weight"),
                Weight(("pos_embed", "embedding"), p + "wpe.weight"),
                Weight(("final_norm", "scale"), p + "ln_f.weight"),
                Weight(("final_norm", "bias"), p + "ln_f.bias")]
        h = p + "h.{i}."
        norms = (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"))
        layer = [Weight((norm, leaf), f"{h}{ln}.{name}") for norm, ln in norms
                 for leaf, name in (("scale", "weight"), ("bias", "bias"))]
        for j, n in enumerate("qkv"):
            layer += [Weight(("attn", n, "kernel"), h + "attn.c_attn.weight", "conv1d",
                             part=(j, 3)),
                      Weight(("attn", n, "bias"), h + "attn.c_attn.bias", "vec", part=(j, 3))]
        layer += [Weight(("attn", "o", "kernel"), h + "attn.c_proj.weight", "conv1d", n_in=2),
                  Weight(("attn", "o", "bias"), h + "attn.c_proj.bias", "vec"),
                  Weight(("mlp", "up", "kernel"), h + "mlp.c_fc.weight", "conv1d"),
                  Weight(("mlp", "up", "bias"), h + "mlp.c_fc.bias", "vec"),
                  Weight(("mlp", "down", "kernel"), h + "mlp.c_proj.weight", "conv1d"),
                  Weight(("mlp", "down", "bias"), h + "mlp.c_proj.bias", "vec")]
        moe = []
    else:
        glob = [Weight(("embed", "embedding"), "model.embed_tokens.weight"),
                Weight(("final_norm", "scale"), "model.norm.weight")]
        h = "model.layers.{i}."
        attn = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
                Weight(("mlp_norm", "scale"), h + "post_attention_layernorm.weight"),
                Weight(("attn", "o", "kernel"), h + "self_attn.o_proj.weight", "linear", n_in=2)]
        for n in "qkv":
            attn.append(Weight(("attn", n, "kernel"), h + f"self_attn.{n}_proj.weight", "linear"))
            if config.attention_bias:
                attn.append(Weight(("attn", n, "bias"), h + f"self_attn.{n}_proj.bias", "vec"))
        if config.attention_out_bias:
            attn.append(Weight(("attn", "o", "bias"), h + "self_attn.o_proj.bias", "vec"))
        layer = list(attn)
        for n in ("gate", "up", "down"):
            layer.append(Weight(("mlp", n, "kernel"), h + f"mlp.{n}_proj.weight", "linear"))
            if config.mlp_bias:
                layer.append(Weight(("mlp", n, "bias"), h + f"mlp.{n}_proj.bias", "vec"))
        e, x = config.num_local_experts, h + "block_sparse_moe."
        moe = attn + [Weight(("moe", "router", "kernel"), x + "gate.weight", "linear"),
                      Weight(("moe", "wi_gate"), x + "experts.{e}.w1.weight", "linear", experts=e),
                      Weight(("moe", "wi_up"), x + "experts.{e}.w3.weight", "linear", experts=e),
                      Weight(("moe", "wo"), x + "experts.{e}.w2.weight", "linear", experts=e)]
    if not config.tie_word_embeddings:
        glob.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return glob, layer, moe


def _names(w: Weight, i: int | None) -> list[str]:
    name = w.name.replace("{i}", str(i)) if i is not None else w.name
    return [name.replace("{e}", str(e)) for e in range(w.experts)] if w.experts else [name]


def _hf_shape(w: Weight, leaf_shape) -> tuple[int, ...]:
    """The HF tensor's shape for a per-layer leaf shape (per expert when stacked)."""
    shape = tuple(leaf_shape[1:] if w.experts else leaf_shape)
    n = w.part[1]
    if w.op == "copy":
        return shape
    if w.op == "vec":
        return (math.prod(shape) * n,)
    fan_in, fan_out = math.prod(shape[: w.n_in]), math.prod(shape[w.n_in:]) * n
    return (fan_out, fan_in) if w.op == "linear" else (fan_in, fan_out)


def hf_to_leaf(w: Weight, tensors: list[np.ndarray], leaf_shape) -> np.ndarray:
    """HF tensor(s) -> one per-layer shardzoo leaf (transposed, split, stacked, reshaped)."""
    out = []
    for t in tensors:
        t = t.T if w.op == "linear" else t
        if w.part[1] > 1:
            t = np.split(t, w.part[1], axis=-1)[w.part[0]]
        out.append(t)
    arr = np.stack(out) if w.experts else out[0]
    return arr.reshape(leaf_shape)


def leaf_to_hf(w: Weight, leaf: np.ndarray) -> list[np.ndarray]:
    """The inverse of ``hf_to_leaf`` (before joining ``part`` blocks): HF tensor(s) of a leaf."""
    out = []
    for a in (list(leaf) if w.experts else [leaf]):
        if w.op == "vec":
            a = a.reshape(-1)
        elif w.op in ("linear", "conv1d"):
            a = a.reshape(math.prod(a.shape[: w.n_in]), -1)
        out.append(a)
    return out


# ----------------------------------------------------------------------------------- reading
class SafetensorsReader:
    """Lazy, tensor-at-a-time access to an HF directory's safetensors (one file or an index)."""

    def __init__(self, hf_dir: str):
        self.hf_dir, self._handles = hf_dir, {}
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
            self._handles[file] = safe_open(path, framework="np")
        return self._handles[file]

    def resolve(self, name: str) -> str | None:
        """The stored name (GPT-2 files from the Hub lack the ``transformer.`` prefix)."""
        if name in self._where:
            return name
        bare = name.removeprefix("transformer.")
        return bare if bare in self._where else None

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self.resolve(name)
        return tuple(self._handle(self._where[stored]).get_slice(stored).get_shape())

    def get(self, name: str) -> np.ndarray:
        stored = self.resolve(name)
        return self._handle(self._where[stored]).get_tensor(stored)


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


def abstract_params(module, config, mesh, rules):
    """Params as ShapeDtypeStructs carrying their shardings under ``rules`` on ``mesh``."""
    inputs = config.sample_inputs(mesh.size, 8)
    with activate(mesh, rules):
        boxed = jax.eval_shape(module.init, jax.random.key(0), *inputs)["params"]
    shardings = logical_shardings(boxed, mesh, rules)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nn.meta.unbox(boxed), shardings)


def load_hf_config(hf_dir: str, dtype=None, scan_layers: bool = True, overrides=None):
    """The TransformerConfig of an HF model directory.

    ``dtype`` ("float32" | "bfloat16") sets both the parameter and the compute dtype (default
    float32); ``overrides`` are further TransformerConfig fields (e.g. ``moe_dispatch``).
    """
    from shardzoo.models import apply_overrides
    from shardzoo.models.transformer import TransformerConfig

    fields = config_from_hf(read_hf_config(hf_dir), where=os.path.join(hf_dir, "config.json"))
    fields["scan_layers"] = scan_layers
    if dtype is not None:
        fields.update(dtype=str(dtype), param_dtype=str(dtype))
    return apply_overrides(TransformerConfig(**fields), dict(overrides or {}), where=hf_dir)


def load_hf_params(hf_dir: str, target, config=None):
    """The HF directory's weights placed like ``target`` (a params tree of ShapeDtypeStructs
    with shardings, e.g. the trainer's): each leaf read, converted to its dtype, and sent slice
    by slice to the devices that hold it. ``config`` (default: from config.json) must be the
    model ``target`` was made from."""
    config = load_hf_config(hf_dir) if config is None else config
    model_type = read_hf_config(hf_dir)["model_type"]
    flat = traverse_util.flatten_dict(target)
    reader = SafetensorsReader(hf_dir)
    glob, groups = _layer_weights(config, model_type)
    plan = [(w.path, None, w) for w in glob]
    plan += [(prefix + w.path, i, w) for prefix, i, ws in groups for w in ws]
    _check(plan, flat, reader, config, hf_dir)
    params = {}
    for path, i, w in plan:
        leaf = flat[path]
        if i is None and path[0] == "layers":  # scanned: per-layer reads stacked on the device
            read = functools.partial(_read, reader, w, leaf.shape[1:])
            params[path] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding, read, leaf.shape[0])
        else:
            read = functools.partial(_read, reader, w, leaf.shape, i)
            params[path] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding, read)
    return traverse_util.unflatten_dict(params)


def _read(reader, w: Weight, shape, i: int | None) -> np.ndarray:
    """Leaf ``w`` (per-layer ``shape``) of layer ``i`` (None: a global leaf) from its HF tensors."""
    return hf_to_leaf(w, [reader.get(n) for n in _names(w, i)], shape)


def load_hf(hf_dir: str, mesh=None, rules=None, dtype=None, scan_layers: bool = True,
            overrides=None):
    """``(module, config, params)`` from an HF model directory, the params sharded under
    ``rules`` (default fsdp) on ``mesh`` (default: the first device). See ``load_hf_config``."""
    config = load_hf_config(hf_dir, dtype, scan_layers, overrides)
    module = config.build()
    mesh = make_mesh("", devices=jax.devices()[:1]) if mesh is None else mesh
    target = abstract_params(module, config, mesh, get_rules(rules or "fsdp"))
    return module, config, load_hf_params(hf_dir, target, config)


def _layer_weights(config, model_type):
    """(global weights, [(path prefix, layer index or None for the stack, weights)])."""
    glob, dense, moe = weight_map(config, model_type)
    if config.scan_layers:
        return glob, [(("layers",), None, moe if config.num_local_experts else dense)]
    return glob, [((f"layers_{i}",), i, moe if config.is_moe_layer(i) else dense)
                  for i in range(config.num_hidden_layers)]


def _check(plan, shapes, reader, config, hf_dir) -> None:
    """Every parameter has a source; every source tensor exists, shaped as config.json implies."""
    unmapped = sorted("/".join(p) for p in set(shapes) - {p for p, _, _ in plan})
    if unmapped:
        raise HFError(f"{hf_dir}: no HF tensor maps to shardzoo parameter(s) {', '.join(unmapped)}")
    for path, i, w in plan:
        if path not in shapes:
            raise HFError(f"{hf_dir}: HF tensor {w.name} has no shardzoo parameter "
                          f"{'/'.join(path)}")
        scanned = i is None and path[0] == "layers"
        want = _hf_shape(w, shapes[path].shape[1:] if scanned else shapes[path].shape)
        for j in range(config.num_hidden_layers) if scanned else [i]:
            for name in _names(w, j):
                if reader.resolve(name) is None:
                    raise HFError(f"{hf_dir}: missing tensor {name!r} (for {'/'.join(path)})")
                if reader.shape(name) != want:
                    got = list(reader.shape(name))
                    raise HFError(f"{hf_dir}: tensor {name!r} has shape {got}, "
                                  f"config.json implies {list(want)}")


# ----------------------------------------------------------------------------------- writing
def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def export_hf(config, params, out_dir: str, dtype=None, max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write ``config.json`` and safetensors (sharded with an index past ``max_shard_bytes``) that
    transformers' ``from_pretrained`` loads. Returns the HF config dict."""
    import jax.numpy as jnp
    from safetensors.numpy import save_file

    hf_config = config_to_hf(config, dtype)
    out_dtype = jnp.dtype(dtype or config.param_dtype)
    flat = traverse_util.flatten_dict(params)
    glob, groups = _layer_weights(config, hf_config["model_type"])
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
            arr = np.concatenate([parts[k] for k in range(w.part[1])], axis=-1)
            arr = np.ascontiguousarray((arr.T if w.op == "linear" else arr).astype(out_dtype))
            del pending[name]
            if current and sum(a.nbytes for a in current.values()) + arr.nbytes > max_shard_bytes:
                flush()
            current[name] = arr

    for w in glob:
        emit(w, None, _to_host(flat[w.path]))
    for prefix, i, ws in groups:
        for w in ws:
            leaf = _to_host(flat[prefix + w.path])
            for j, layer in (enumerate(leaf) if i is None else [(i, leaf)]):
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
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    return hf_config
