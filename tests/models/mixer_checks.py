"""What the token-mixer tests share (test_conv_mixer, test_linear_attention, test_ssm): the
objective whose logits and gradients one device and a context-parallel mesh must agree on, and
readings of the compiled HLO (collective-permutes of an array shape, all-gathers of a whole row)."""

import re

import jax
import jax.numpy as jnp

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def objective(module, per_token: bool = False):
    """A jitted value_and_grad of <logits, a fixed probe> (with the logits as aux): the mean over
    every logit, or with ``per_token`` the sum over the vocabulary averaged over tokens (larger
    gradients, for small parameters such as Mamba2's A_log)."""
    def f(params, batch):
        logits = module.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
        probe = jnp.cos(0.01 * jnp.arange(logits.size, dtype=jnp.float32)).reshape(logits.shape)
        if per_token:
            return jnp.sum(logits * probe) / (logits.shape[0] * logits.shape[1]), logits
        return jnp.mean(logits * probe), logits

    return jax.jit(jax.value_and_grad(f, has_aux=True), compiler_options=FAST)


def permutes_of(hlo: str, shape: str) -> int:
    """Collective-permutes whose result is ``shape`` (a regex such as ``f32\\[4,2,8\\]``)."""
    return len(re.findall(rf"= \(?{shape}\S* collective-permute(?:-start)?\(", hlo))


def length_gathers(hlo: str, length: int, scope: str) -> list[str]:
    """All-gathers inside ``scope`` (e.g. "/mamba/") whose result has a dimension of ``length``."""
    return [line.strip()[:160] for line in hlo.splitlines()
            if (m := re.search(r"= \S*?\[([\d,]*)\]\S* all-gather(?:-start)?\(", line))
            and str(length) in m.group(1).split(",") and scope in line]
