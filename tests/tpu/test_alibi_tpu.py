"""ALiBi on the chip (BLOOM's tiny preset): ``attention_impl=auto`` leaves its attention to XLA
(splash has no bias input) and compiles without the Pallas kernel; its logits are finite.
Run: ``JAX_PLATFORMS=tpu python3 -m pytest -q tests/tpu/test_alibi_tpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from shardzoo.models import get_model
from shardzoo.models.attention import attention_kernel


def test_auto_keeps_alibi_in_xla_on_the_tpu():
    module, config = get_model("bloom-tiny")
    assert attention_kernel(config, jnp.dtype("float32"), 256) == "xla"
    _, llama = get_model("llama-tiny")
    assert attention_kernel(llama, jnp.dtype("float32"), 256) == "splash"  # the chip's choice otherwise
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 512, (2, 256)), jnp.int32)
    params = nn.unbox(jax.jit(module.init)(jax.random.key(0), tokens)["params"])
    fn = jax.jit(lambda p: module.apply({"params": p}, tokens))
    assert "tpu_custom_call" not in fn.lower(params).compile().as_text()
    assert np.isfinite(np.asarray(fn(params))).all()
