"""Decoding on a Program: prefill and the sampling loop in one compiled program, the KV cache
sharded by its logical axes under the program's rules like every other array
(``program.decoding``). Compiled once per prompt shape and sampling settings, through the
program's one jit site."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import AbstractMesh, NamedSharding

from shardzoo.errors import UserError
from shardzoo.models.decode import (
    cache_init_fn,
    cache_segments,
    flat_head_kernels,
    generate_tokens,
    grow_cache,
    prefill_fuses,
    segment_ends,
    unrolled_params,
)
from shardzoo.models.execution import DECODE_VMEM_CACHE_SHARE, DECODE_VMEM_SHARE
from shardzoo.models.layers import fuses
from shardzoo.models.rope import check_rope_decoding
from shardzoo.sharding import axes as ax
from shardzoo.sharding.partition import activate, replicated
from shardzoo.sharding.validate import check, resolve_array
from shardzoo.train.jit import global_array, host_array, per_device_bytes, zeros_on


def auto_vmem_kib(vmem_bytes: int, *, scanned: bool, cache_bytes: int, weight_bytes: int) -> int:
    """``decode_vmem_kib`` "auto" for a chip of ``vmem_bytes`` of VMEM, in KiB (0: the compiler's
    default): DECODE_VMEM_SHARE of it (v5e's 128 MiB: 114,688, the limit measured there) where the
    layers are unrolled and the cache weighs at least DECODE_VMEM_CACHE_SHARE of the weights, the
    cases it was measured to help (models/execution.py); the default elsewhere."""
    if scanned or cache_bytes < DECODE_VMEM_CACHE_SHARE * weight_bytes:
        return 0
    return int(vmem_bytes * DECODE_VMEM_SHARE) // 1024


class Decoding:
    """A Program's decoding: its decoder module, cache shardings and compiled samplers."""

    def __init__(self, program):
        self.program = program
        self._compiled: dict = {}

    @property
    def _scan_decoding(self) -> bool:
        return self.program.config.execution.decode_layers == "scan"

    @functools.cached_property
    def decoder(self):
        """The module decoding runs: with ``decode_layers="unroll"`` this model with its layers
        unrolled (``models.decode.unrolled_params``), with "scan" the model as built; its
        projections fused in the prefill as ``models.decode.prefill_fuses`` says (the same params)."""
        config, fuse = self.program.config, prefill_fuses(self.program.config.execution)
        if self._scan_decoding and fuse == fuses(config.execution):
            return self.program.module
        return config.replace(scan_layers=config.execution.scan_layers and self._scan_decoding,
                              fuse_projections=fuse).build(self.program.placement)

    @functools.cached_property
    def _flat_head_dims(self):
        """Which head_dims decoding stores the q, k and v kernels flat for
        (``execution.decode_flat_heads``; ``models.decode.flat_head_kernels``), or None."""
        mode = self.program.config.execution.decode_flat_heads
        if mode != "auto":
            return (lambda dim: True) if mode == "on" else None
        placement = self.program.placement
        held = placement is not None and any(placement.mesh_axes(n) for n in (ax.HEADS, ax.KV_HEADS, ax.HEAD_DIM))
        return (lambda dim: dim % 128 != 0) if self._platform == "tpu" and not held else None

    @functools.cached_property
    def _platform(self) -> str:
        """The mesh's devices' platform; an AbstractMesh's (a plan's, no devices): this machine's backend."""
        mesh = self.program.mesh
        return jax.default_backend() if isinstance(mesh, AbstractMesh) else mesh.devices.flat[0].platform

    def decoding_params(self, params):
        """``params`` as decoding takes them (``self.decoder``: every layer unrolled, or as they
        are; the kernels onto heads flat where ``_flat_head_dims`` says)."""
        if self._flat_head_dims is not None:
            params = flat_head_kernels(params, self.program.boxed_params, self._flat_head_dims)
        return params if self._scan_decoding else unrolled_params(self.program.config.layout(), params)

    def cache_shardings(self, batch_size: int, max_length: int):
        """``(abstract cache, shardings)`` of the decoding cache for ``batch_size`` rows of
        ``max_length`` positions (``decode_layers="unroll"``: one per layer, ``layers_i``;
        "scan": a scanned stack's with a leading ``layers`` axis, an unrolled layer's its own):
        its arrays' logical axes under the rules, like every array."""
        init = cache_init_fn(self.decoder, batch_size, max_length)
        with activate(self.program.mesh):
            boxed = jax.eval_shape(lambda p: init(self.decoding_params(p)), self.program.abstract.params)
        report = check(boxed, self.program.rules, self.program.mesh, strict=False)
        return nn.meta.unbox(boxed), report.shardings(self.program.mesh)

    def cache_bytes(self, batch_size: int, max_length: int) -> int:
        """What that cache costs one device."""
        return per_device_bytes(*self.cache_shardings(batch_size, max_length))

    def new_cache(self, batch_size: int, max_length: int):
        """An empty decoding cache (zeros, index 0), each array created sharded as its logical
        axes say (``cache_shardings``)."""
        shapes, shardings = self.cache_shardings(batch_size, max_length)
        return zeros_on(shapes, shardings)

    def generate(self, params, prompt, prompt_lengths=None, *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_ids=(), pad_id: int | None = None,
                 key=None):
        """Continue ``prompt`` int32 [batch, prompt_len] (left-padded; ``prompt_lengths`` each
        row's real length, default all) by ``max_new_tokens``: prefill and the sampling loop in
        one compiled program, params, prompt and cache sharded under the rules (compiled once per
        shape and sampling settings). Greedy at temperature 0. Returns int32 [batch, prompt_len +
        max_new_tokens] on the host; rows end at an eos id, padded with ``pad_id`` (default the
        first eos id, else 0). ``key``: the sampler's raw key (uint32 [2]) in place of ``seed``'s."""
        prompt = np.asarray(prompt, np.int32)
        if prompt.ndim != 2:
            raise UserError(f"a prompt must be [batch, prompt_len] tokens, got shape {prompt.shape}")
        vocab = self.program.config.arch.vocab_size
        if top_k < 0 or top_k > vocab:
            raise UserError(f"top-k {top_k} must be between 0 (off) and the model's vocab_size {vocab}")
        eos_ids = tuple(int(e) for e in eos_ids)
        pad_id = (eos_ids[0] if eos_ids else 0) if pad_id is None else int(pad_id)
        lengths = np.full(prompt.shape[:1], prompt.shape[1], np.int32) if prompt_lengths is None \
            else np.asarray(prompt_lengths, np.int32)
        check_rope_decoding(self.program.config.arch, int(lengths.max(initial=0)), int(max_new_tokens))
        settings = (prompt.shape, int(max_new_tokens), float(temperature), int(top_k), float(top_p), eos_ids, pad_id)
        if settings not in self._compiled:
            self._compiled[settings] = self._compile_generate(prompt.shape, *settings[1:])
        fn, (prompt_sharding, rows_sharding) = self._compiled[settings]
        key = np.asarray(jax.random.key_data(jax.random.key(seed)) if key is None else key, np.uint32)
        args = (global_array(prompt, prompt_sharding), global_array(lengths, rows_sharding),
                global_array(key, replicated(self.program.mesh)))
        return host_array(fn(params, *args))

    def compiler_options(self, batch_size: int, max_length: int) -> dict:
        """The options of generate's compile for ``batch_size`` rows of ``max_length`` positions:
        on a TPU, libtpu's scoped VMEM limit (``execution.decode_vmem_kib``; "auto": ``auto_vmem_kib``
        of the chip's VMEM as Pallas knows it, by this cache's and the weights' bytes); none
        elsewhere, nor on a chip Pallas does not know."""
        kib = self.program.config.execution.decode_vmem_kib
        if self._platform != "tpu" or kib == 0:
            return {}
        if kib == -1:
            from jax.experimental.pallas import tpu as pltpu  # noqa: I001 - lazily: Pallas on a TPU only

            try:
                vmem = pltpu.get_tpu_info().vmem_capacity_bytes
            except ValueError:  # a TPU this jax does not describe: the compiler's default
                return {}
            weights = per_device_bytes(self.program.abstract.params, self.program.shardings.params)
            kib = auto_vmem_kib(vmem, scanned=self._scan_decoding, cache_bytes=self.cache_bytes(batch_size, max_length),
                                weight_bytes=weights)
        return {"xla_tpu_scoped_vmem_limit_kib": kib} if kib else {}

    def _divisible_sharding(self, shape, names):
        resolved, _ = resolve_array("decode", shape, "int32", names, self.program.rules, self.program.mesh, param=False)
        return NamedSharding(self.program.mesh, resolved.spec)

    def _compile_generate(self, shape, max_new_tokens, temperature, top_k, top_p, eos_ids, pad_id):
        batch, prompt_len = shape
        # the sampling loop's stretches, each over a cache of the positions filled by its end
        ends = segment_ends(max_new_tokens, cache_segments(self.program.config.execution, max_new_tokens))
        caches = [self.cache_shardings(batch, prompt_len + end) for end in ends]  # (shapes, shardings)
        # rows split as the rules say when they divide (a batch of one prompt: replicated)
        tokens = self._divisible_sharding((batch, prompt_len + max_new_tokens), ("batch", None))
        rows = self._divisible_sharding((batch,), ("batch",))

        def placed(cache, shardings):
            return jax.tree.map(jax.lax.with_sharding_constraint, cache, shardings)

        def run(params, prompt, lengths, key_data):
            shapes, shardings = caches[0]
            cache = placed(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), shardings)
            grow = [(end, lambda c, s=s, sh=sh: placed(grow_cache(c, s), sh))
                    for end, (s, sh) in zip(ends[:-1], caches[1:], strict=True)]
            return generate_tokens(self.decoder, self.decoding_params(params), cache, prompt, lengths,
                                   jax.random.wrap_key_data(key_data),
                                   max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, eos_ids=eos_ids, pad_id=pad_id, grow=grow)

        prompt = self._divisible_sharding(shape, ("batch", None))
        args = (self.program.abstract.params, jax.ShapeDtypeStruct(shape, jnp.int32, sharding=prompt),
                jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=rows),
                jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated(self.program.mesh)))
        options = self.compiler_options(batch, prompt_len + max_new_tokens)
        fn = self.program.compile(run, *args, out_shardings=tokens, options=options,
                                  in_shardings=(self.program.shardings.params, prompt, rows, replicated(self.program.mesh)))
        return fn, (prompt, rows)
