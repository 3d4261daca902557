"""The decoding cache's write kernel (models/kv_write.py) in Pallas' interpreter: equal to
``dynamic_update_slice`` at every kind of position, in bf16 and float32, on one device and per
device under a mesh that splits batch and kv heads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardzoo.models import kv_write
from shardzoo.models.execution import Execution
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement


def _cache(shape, dtype, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("index", [0, 7, 8, 15, 16, 31])
def test_the_kernel_writes_what_dynamic_update_slice_writes(dtype, index):
    """Batch 3 (blocks of one row), 2 kv rows, 32 positions (two bf16 tiles, four float32 ones):
    the first, last and middle slots of a tile, and the tile boundaries."""
    cache, new = _cache((3, 2, 32, 128), dtype), _cache((3, 2, 1, 128), dtype, seed=1)
    want = jax.lax.dynamic_update_slice(cache, new, (0, 0, index, 0))
    got = jax.jit(kv_write.write_position)(cache, new, jnp.int32(index))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(cache, np.float32))


def test_the_kernel_under_a_mesh_writes_each_devices_rows():
    """Under data=2,tensor=2 (batch and kv heads split): the shard_map'd kernel equals the dus,
    and the result keeps the cache's sharding."""
    mesh = make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    placement = Placement(mesh, get_rules("tp"))
    spec = placement.sharding(("batch", "kv_heads", None, None))
    cache = jax.device_put(_cache((4, 4, 16, 64), jnp.float32), spec)
    new = jax.device_put(_cache((4, 4, 1, 64), jnp.float32, seed=1), spec)
    fn = jax.jit(lambda c, n, i: kv_write.write_position(c, n, i, placement))
    got = fn(cache, new, jnp.int32(9))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.lax.dynamic_update_slice(cache, new, (0, 0, 9, 0))))
    assert got.sharding.is_equivalent_to(spec, 4)


def test_auto_uses_the_kernel_on_a_tpu_for_one_token_of_unrolled_layers_only():
    on = Execution(kv_cache_write="kernel")
    assert kv_write.uses_kernel(on, 1, 32, jnp.bfloat16)
    assert not kv_write.uses_kernel(on, 2, 32, jnp.bfloat16)  # a prefill: the dus
    assert not kv_write.uses_kernel(on, 1, 24, jnp.bfloat16)  # not whole bf16 tiles of 16 rows
    assert kv_write.uses_kernel(on, 1, 24, jnp.float32)
    assert not kv_write.uses_kernel(Execution(kv_cache_write="dus"), 1, 32, jnp.bfloat16)
    auto = Execution()
    assert kv_write.uses_kernel(auto, 1, 32, jnp.bfloat16) == (jax.default_backend() == "tpu")
    assert not kv_write.uses_kernel(Execution(decode_layers="scan"), 1, 32, jnp.bfloat16)
