"""JetMoE's mixture of attention heads (models/moa.py) on the chip, in bfloat16: the dropless dispatch
(one grouped matmul per projection: XLA's ragged_dot) and the indexed one (capacity buffers, factor
E / K: nothing dropped) give the same logits, within 2e-2 of their largest magnitude at 99% of the
tokens (bfloat16 rounding may flip a near-tied routing choice: on the CPU one token in 1024 did; in
float32 the two agreed to 1e-6 on the CPU), and the gradients of a loss through the experts are
finite and reach every expert projection.
Run: ``JAX_PLATFORMS=tpu python3 -m pytest -q tests/tpu/test_moa_tpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from shardzoo.models.transformer import TransformerConfig

TOL = 2e-2  # of the reference's largest magnitude
E, K = 8, 2
FIELDS = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4 * K,
              num_key_value_heads=4, head_dim=64, layer_types=("moa",) * 2, num_local_experts=E, num_experts_per_tok=K,
              moa_num_experts=E, moa_num_experts_per_tok=K, moe_output_bias=True, dtype="bfloat16",
              capacity_factor=E / K)


def test_dropless_and_indexed_moa_agree_and_train_on_the_chip():
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 512, (4, 256)), jnp.int32)
    models = {d: TransformerConfig.from_fields(**FIELDS, moe_dispatch=d).build() for d in ("dropless", "indexed")}
    params = nn.unbox(jax.jit(models["indexed"].init)(jax.random.key(0), tokens)["params"])
    logits = {d: np.asarray(jax.jit(lambda p, m=m: m.apply({"params": p}, tokens))(params), np.float32)
              for d, m in models.items()}
    want = logits["indexed"]
    close = np.abs(logits["dropless"] - want).max(-1) <= TOL * np.abs(want).max()  # [batch, length]
    assert close.mean() >= 0.99

    def loss(p):
        return jnp.mean(models["dropless"].apply({"params": p}, tokens).astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss))(params)["layers"]["attn"]
    for name in ("q_experts", "o_experts", "o_bias"):
        g = np.asarray(grads[name], np.float32)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name
