"""The MLP family: registry presets, config checks, parameter names, and its forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import ModelError, get_config, get_model, list_models
from shardzoo.models.mlp import MLPConfig


def test_presets_are_registered_and_build():
    names = list_models()
    assert {"mlp-tiny", "mlp-mnist", "mlp-tiny-regression"} <= set(names)
    module, config = get_model("mlp-mnist")
    assert isinstance(config, MLPConfig) and config.in_features == 784 and config.num_outputs == 10
    assert config.task == "classification"
    assert get_config("mlp-tiny-regression").task == "regression"
    assert type(module).__name__ == "MLP"


def test_config_is_frozen_hashable_and_overridable_from_strings():
    config = get_config("mlp-tiny", width="64", depth="3", activation="gelu", dropout_rate="0.1")
    assert (config.width, config.depth, config.activation, config.dropout_rate) == (64, 3, "gelu", 0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.width = 8
    assert hash(config) == hash(dataclasses.replace(config))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(task="lm"), ["task", "classification"]),
        (dict(activation="swish"), ["activation", "relu"]),
        (dict(depth="0"), ["depth=0"]),
        (dict(dropout_rate="1.5"), ["dropout_rate"]),
        (dict(width="wide"), ["width", "int"]),
    ],
)
def test_bad_configs_are_user_errors(overrides, words):
    with pytest.raises(ModelError) as e:
        get_config("mlp-tiny", **overrides)
    for w in words:
        assert w in str(e.value)


def test_hidden_kernels_alternate_names_and_every_dim_is_named():
    module, config = get_model("mlp-tiny", depth=3, in_features=6, width=10, num_outputs=5)
    (x,) = config.sample_inputs(4, 999)  # seq_len is ignored by the MLP
    assert (x.shape, x.dtype) == ((4, 6), jnp.float32)
    abstract = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    got = {
        "/".join(k.key for k in path): (leaf.value.shape, leaf.names)
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            abstract, is_leaf=lambda v: isinstance(v, nn.Partitioned)
        )[0]
    }
    assert got == {
        "layers_0/kernel": ((6, 10), ("embed", "mlp")),
        "layers_0/bias": ((10,), ("mlp",)),
        "layers_1/kernel": ((10, 10), ("mlp", "embed")),
        "layers_1/bias": ((10,), ("embed",)),
        "layers_2/kernel": ((10, 10), ("embed", "mlp")),
        "layers_2/bias": ((10,), ("mlp",)),
        "head/kernel": ((10, 5), ("mlp", "vocab")),
        "head/bias": ((5,), ("vocab",)),
    }


def test_forward_matches_numpy_and_dropout_only_in_training():
    module, config = get_model("mlp-tiny", depth=2, in_features=6, width=8, num_outputs=3,
                               activation="tanh", dropout_rate=0.5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6)).astype(np.float32)
    shapes = {"layers_0": (6, 8), "layers_1": (8, 8), "head": (8, 3)}
    params = {
        name: {"kernel": rng.normal(size=shape).astype(np.float32),
               "bias": rng.normal(size=shape[1:]).astype(np.float32)}
        for name, shape in shapes.items()
    }

    @jax.jit
    def forward(params, x, key):
        det = module.apply({"params": params}, x)
        train = module.apply({"params": params}, x, deterministic=False, rngs={"dropout": key})
        return det, train

    det, train = forward(params, x, jax.random.key(1))
    h = np.tanh(x @ params["layers_0"]["kernel"] + params["layers_0"]["bias"])
    h = np.tanh(h @ params["layers_1"]["kernel"] + params["layers_1"]["bias"])
    want = h @ params["head"]["kernel"] + params["head"]["bias"]
    np.testing.assert_allclose(det, want, rtol=1e-5, atol=1e-5)
    assert det.shape == (4, 3) and not np.allclose(det, train)


def test_regression_head_shape():
    module, config = get_model("mlp-tiny-regression")
    (x,) = config.sample_inputs(2, None)
    out = jax.eval_shape(lambda: module.init_with_output(jax.random.key(0), jnp.zeros(x.shape))[0])
    assert out.shape == (2, 1) and config.num_outputs == 1
