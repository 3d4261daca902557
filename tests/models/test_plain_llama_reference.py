"""bench/plain_llama.py, the plain-JAX bar of the train-step benchmark, is the same model as
shardzoo's Llama: same logits for the same weights (so "1.00x plain JAX" compares like with like)."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from shardzoo.models import get_model

PLAIN = pathlib.Path(__file__).resolve().parents[2] / "bench" / "plain_llama.py"


def _plain_module():
    spec = importlib.util.spec_from_file_location("plain_llama", PLAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_llama_reference_equals_shardzoo_llama():
    plain = _plain_module()
    module, config = get_model("llama-tiny", scan_layers=False, rope_theta=500000.0)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, config.vocab_size)
    params = nn.unbox(module.init(jax.random.key(0), tokens)["params"])
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape), params)

    def flat(kernel, n_in):  # [in..., out...] -> 2-D
        return kernel.reshape(int(np.prod(kernel.shape[:n_in])), -1)

    layers = []
    for i in range(config.num_hidden_layers):
        p = params[f"layers_{i}"]
        attn, mlp = p["attn"], p["mlp"]
        layers.append(dict(
            attn_norm=p["attn_norm"]["scale"], mlp_norm=p["mlp_norm"]["scale"],
            q=flat(attn["q"]["kernel"], 1), o=flat(attn["o"]["kernel"], 2),
            kv=jnp.concatenate([flat(attn["k"]["kernel"], 1), flat(attn["v"]["kernel"], 1)], 1),
            gate_up=jnp.concatenate([mlp["gate"]["kernel"], mlp["up"]["kernel"]], 1),
            down=mlp["down"]["kernel"]))
    plain_params = dict(embed=params["embed"]["embedding"], lm_head=params["lm_head"]["kernel"],
                        norm=params["final_norm"]["scale"], layers=layers)

    want = module.apply({"params": params}, tokens)
    got = plain.forward(config, plain_params, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert float(jnp.abs(want).max()) > 0.1  # logits of substance, not near zero
