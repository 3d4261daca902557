"""Gemma 4 on the chip (gemma4-tiny: global layers with heads of 32 beside sliding ones of 16, keys as
values, value norms, windows of 8 in rows of 256): ``attention_impl=auto`` runs splash on both kinds of
layer and gives XLA attention's logits (within 1e-4 of their largest magnitude). The model is float32,
so both run under ``jax.default_matmul_precision("highest")``: at the chip's default precision XLA's
float32 matmuls take one bfloat16 pass, where the kernel's do not, and six layers of that differ by
several percent (4.8e-2 of the largest logit, measured), in the reference.
Run: ``JAX_PLATFORMS=tpu python3 -m pytest -q tests/tpu/test_gemma4_tpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from shardzoo.models import get_model
from shardzoo.models.attention import attention_kernel

TOL = 1e-4  # of the reference's largest magnitude, both at "highest" (2.9e-6 measured on the chip)


def test_auto_runs_splash_on_the_global_and_sliding_layers_and_gives_xlas_logits():
    _, config = get_model("gemma4-tiny")
    assert attention_kernel(config, jnp.dtype("float32"), 256) == "splash"
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 512, (2, 256)), jnp.int32)
    xla, _ = get_model("gemma4-tiny", attention_impl="xla")
    auto, _ = get_model("gemma4-tiny")
    params = nn.unbox(jax.jit(xla.init)(jax.random.key(0), tokens)["params"])
    fn = jax.jit(lambda p: auto.apply({"params": p}, tokens))
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(lambda p: xla.apply({"params": p}, tokens))(params), np.float32)
        got = np.asarray(fn(params), np.float32)  # the precision is part of jit's cache key: compiled anew
    default = np.asarray(jax.jit(lambda p: xla.apply({"params": p}, tokens))(params), np.float32)
    err = lambda x: float(np.abs(x - want).max() / np.abs(want).max())
    print(f"of the largest logit, from XLA at 'highest': splash {err(got):.2e}; "
          f"splash at default precision {err(np.asarray(fn(params), np.float32)):.2e}; XLA at default {err(default):.2e}")
    assert err(got) <= TOL
    assert "tpu_custom_call" in fn.lower(params).compile().as_text()  # the Pallas kernel, not XLA's attention
