"""Block forms: how a layer joins its token mixer and its MLP to the residual stream, each form
one line of ``BLOCK_FORMS`` (``arch.block_form``).

``transformer.Block`` runs its layer through the form's ``apply``; ``models/costs.py`` counts its
norms (``norms``) and the arrays it keeps for the backward pass (``terms``); ``arch`` runs its
``check``. A new form is one function here and one table line (and its feature in
``models/features.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError
from shardzoo.models.components import MIXERS, MLPS, NO_MIXER, NO_MLP, NONE
from shardzoo.models.layers import DENSE, constrain, dtype_of
from shardzoo.models.norms import block_norm
from shardzoo.sharding import axes as ax

BLE = (ax.BATCH, ax.LENGTH, ax.EMBED)


def _residual(block, x, h):
    """``x + residual_multiplier * h`` (Granite's multiplier; 1 elsewhere)."""
    scale = block.config.arch.residual_multiplier
    h = h if scale == 1.0 else h * jnp.asarray(scale, h.dtype)
    return constrain(x + h, BLE, block.placement)


def _mixer(block, h, positions, segment_ids):
    return MIXERS[block.spec.mixer].apply(block, h, positions, segment_ids)  # the layer's token mixer


def _mlp(block, h, segment_ids):
    return MLPS[block.spec.mlp].apply(block, h, segment_ids)


def sequential(block, x, positions, segment_ids, extra=None):
    """x + mixer(norm(x)), then x + mlp(norm(x)); ``norm_position`` "post" moves the norms onto
    the outputs: x + norm(mixer(x)) (OLMo 2); "both" has both: x + norm(mixer(norm(x))) (Gemma
    2/3); each layer as its spec says (``norm_positions``: OLMo hybrid). A layer whose mixer or
    MLP is "none" has only the other half (Nemotron-H, Mamba2); one without ``attn_norm`` (its
    spec) no norm before the mixer (ModernBERT's first layer). ``extra``: added to the mixer's
    input before its norm, not to the residual: x + mixer(norm(x + extra)) (a shared block's
    output: models/shared_block.py)."""
    cfg = block.config
    pre, post = block.spec.norm in ("pre", "both"), block.spec.norm in ("post", "both")
    if MIXERS[block.spec.mixer] is not NO_MIXER:
        mixed = x if extra is None else x + extra
        h = _mixer(block, block_norm(cfg, "attn_norm")(mixed) if pre and block.spec.attn_norm else mixed, positions,
                   segment_ids)
        x = _residual(block, x, block_norm(cfg, "post_attn_norm")(h) if post else h)
    if MLPS[block.spec.mlp] is not NO_MLP:
        own = MLPS[block.spec.mlp].reads_residual  # it norms its input itself
        h = _mlp(block, block_norm(cfg, "mlp_norm")(x) if pre and not own else x, segment_ids)
        x = _residual(block, x, block_norm(cfg, "post_mlp_norm")(h) if post else h)
    return x


def parallel(block, x, positions, segment_ids):
    """x + mixer(norm(x)) + mlp(norm(x)): one norm, mixer and MLP side by side (Phi, GPT-J, Cohere,
    Falcon-7B)."""
    h = block_norm(block.config, "attn_norm")(x)
    return _residual(block, x, _mixer(block, h, positions, segment_ids) + _mlp(block, h, segment_ids))


def parallel_two_norms(block, x, positions, segment_ids):
    """x + mixer(norm1(x)) + mlp(norm2(x)): mixer and MLP side by side, each with its own norm
    (GPT-NeoX, Falcon-40B's new decoder architecture)."""
    attn = _mixer(block, block_norm(block.config, "attn_norm")(x), positions, segment_ids)
    return _residual(block, x, attn + _mlp(block, block_norm(block.config, "mlp_norm")(x), segment_ids))


def post_residual(block, x, positions, segment_ids):
    """norm(x + mixer(x)), then norm(x + mlp(x)): the norms on the residual stream after each
    addition (the original Transformer's post-LN: GPT-1), so the model has no final norm."""
    cfg = block.config
    x = block_norm(cfg, "attn_norm")(_residual(block, x, _mixer(block, x, positions, segment_ids)))
    return block_norm(cfg, "mlp_norm")(_residual(block, x, _mlp(block, x, segment_ids)))


def _check_post_residual(a) -> None:
    if a.norm_position != "pre":
        raise ModelError(f"block_form={a.block_form!r} (norm(x + attn(x))) places its norms itself; "
                         f"norm_position={a.norm_position!r} must be 'pre'")
    if NONE in (a.layer_types or ()) or NONE in (a.mlp_layer_types or ()):
        raise ModelError(f"block_form={a.block_form!r} normalizes after both halves: every layer needs a mixer and "
                         "an MLP (no 'none' in layer_types or mlp_layer_types)")


def _sequential_norms(a, spec) -> int:
    halves = (spec.mixer != NONE) + (spec.mlp != NONE)
    return halves * (2 if spec.norm == "both" else 1) - (spec.mixer != NONE and not spec.attn_norm)


def _sequential_terms(a, spec, t) -> dict:
    """Its input; per half its norm's float32 intermediates and output; the residual between them."""
    mixes, mlp, d = spec.mixer != NONE, spec.mlp != NONE, a.hidden_size
    out = {"block_input": t(d, BLE)}
    if mixes:
        out.update(attn_norm=t(3 * d, BLE, 4) if spec.attn_norm else 0, attn_out=t(d, BLE))
    if mixes and mlp:
        out["attn_residual"] = t(d, BLE)
    if mlp:
        out.update(mlp_norm=t(3 * d, BLE, 4), mlp_out=t(d, BLE))
    if spec.norm == "both":
        if mixes:
            out["post_attn_norm"] = t(3 * d, BLE, 4)
        if mlp:
            out["post_mlp_norm"] = t(3 * d, BLE, 4)
    return out


def _parallel_terms(norms: int):
    """Its input, its ``norms`` norms' intermediates and both outputs; no residual between them."""
    def terms(a, spec, t) -> dict:
        d = a.hidden_size
        out = {"block_input": t(d, BLE), "attn_norm": t(3 * d, BLE, 4), "attn_out": t(d, BLE), "mlp_out": t(d, BLE)}
        return out | ({"mlp_norm": t(3 * d, BLE, 4)} if norms == 2 else {})
    return terms


def _check_parallel(a) -> None:
    if a.norm_position != "pre" or a.norm_positions is not None:
        raise ModelError(f"block_form={a.block_form!r} (x + attn(norm(x)) + mlp(norm(x))) has its norms before "
                         f"attention and MLP; norm_position={a.norm_position!r} must be 'pre' (and no norm_positions)")
    types, mlps = a.layer_types or (), a.mlp_layer_types or ()
    if any(MLPS[m].reads_residual for m in mlps):
        raise ModelError(f"block_form={a.block_form!r}: mlp_layer_types {sorted(set(mlps))} has a kind that norms the "
                         "residual stream itself; it runs in sequential blocks only")
    if NONE in types or NONE in mlps:
        raise ModelError(f"block_form={a.block_form!r} runs a mixer and an MLP side by side: every layer needs both "
                         "(no 'none' in layer_types or mlp_layer_types)")


class Half(nn.Module):
    """One of a ``shortcut_moe`` layer's two halves: x + mixer(norm(x)), then x + dense MLP(norm(x));
    -> (its output, its MLP's normed input). It has a block's fields, so the components build
    under it as under a block (their paths: ``half_0/attn``, ``half_0/mlp``, ...)."""

    config: object
    spec: object
    placement: object = None
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        cfg = self.config
        x = _residual(self, x, _mixer(self, block_norm(cfg, "attn_norm")(x), positions, segment_ids))
        h = block_norm(cfg, "mlp_norm")(x)
        return _residual(self, x, MLPS[DENSE].apply(self, h, segment_ids)), h


def shortcut_moe(block, x, positions, segment_ids):
    """LongCat-Flash's layer: two halves (``Half``: attention and a dense MLP, pre-norm), and the
    layer's MLP kind (its MoE) of the first half's normed MLP input, added after the second half
    (the shortcut: the experts' all-to-all overlaps the second half's work)."""
    fields = dict(config=block.config, spec=block.spec, placement=block.placement, deterministic=block.deterministic,
                  decode=block.decode)
    x, h = Half(**fields, name="half_0")(x, positions, segment_ids)
    shortcut = _mlp(block, h, segment_ids)  # [batch, length, embed]
    x, _ = Half(**fields, name="half_1")(x, positions, segment_ids)
    return _residual(block, x, shortcut)


def _check_shortcut(a) -> None:
    if a.norm_position != "pre" or a.norm_positions is not None:
        raise ModelError(f"block_form={a.block_form!r} (LongCat-Flash's two pre-norm halves) has its norms before "
                         f"attention and MLP; norm_position={a.norm_position!r} must be 'pre' (and no norm_positions)")
    types, mlps = a.layer_types or (), a.mlp_layer_types or ()
    if NONE in types or any(m == NONE or MLPS[m].reads_residual for m in mlps):
        raise ModelError(f"block_form={a.block_form!r} needs a mixer and a shortcut MLP (normed by the block) in "
                         f"every layer; got layer_types={list(types)}, mlp_layer_types={list(mlps)}")


def _shortcut_terms(a, spec, t) -> dict:
    """Both halves' sequential terms and their dense MLPs'; the shortcut's output."""
    halves = {k: 2 * v for k, v in _sequential_terms(a, dataclasses.replace(spec, mlp=DENSE), t).items()}
    return halves | {"shortcut_out": t(a.hidden_size, BLE)}


class LayerScalar(nn.Module):
    """A layer's output times its scalar (Gemma 4's ``layer_scalar``): a buffer to transformers,
    read and written with the checkpoint and, like it, not trained."""

    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ()), (), dtype_of(self.param_dtype))
        return x * jax.lax.stop_gradient(scale).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class BlockForm:
    """A block form: ``apply(block, x, positions, segment_ids)`` -> the layer's output; ``norms(a,
    spec)`` the norms of a layer; ``terms(a, spec, t)`` its own activations (``models/costs.py``);
    ``check(a)`` a ModelError for what it cannot be beside the rest of the record;
    ``final_norm``: whether the model norms the last layer's output (post_residual's layers end normed);
    ``mixers``: how many of its mixer a layer has, ``dense_mlps``: dense MLPs beside its MLP kind
    (``shortcut_moe``: 2 and 2; ``models/costs.py`` counts them)."""

    name: str
    apply: Callable
    norms: Callable
    terms: Callable
    check: Callable | None = None
    final_norm: bool = True
    mixers: int = 1
    dense_mlps: int = 0


BLOCK_FORMS = {f.name: f for f in (
    BlockForm("sequential", sequential, _sequential_norms, _sequential_terms),
    BlockForm("parallel", parallel, lambda a, spec: 1, _parallel_terms(1), _check_parallel),
    BlockForm("parallel_two_norms", parallel_two_norms, lambda a, spec: 2, _parallel_terms(2), _check_parallel),
    BlockForm("post_residual", post_residual, lambda a, spec: 2, _sequential_terms, _check_post_residual, False),
    BlockForm("shortcut_moe", shortcut_moe, lambda a, spec: 4, _shortcut_terms, _check_shortcut, mixers=2, dense_mlps=2),
)}
