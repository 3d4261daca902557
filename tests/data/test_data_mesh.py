"""Global batches on the 8 fake devices: the rule table's sharding, equal to the numpy batch."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardzoo.data import DataConfig, DataError, load_tokenizer, make_datasets
from shardzoo.sharding import get_rules, make_mesh

SEQ, BATCH = 16, 8
TOK = load_tokenizer("byte")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " + "ab" * i}) + "\n" for i in range(30)))
    return DataConfig(data=str(path), eval_fraction=0.2, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "rules, mesh_spec, expected",
    [
        ("dp", "data=8", P("data", None)),
        ("fsdp", "data=2,fsdp=4", P(("data", "fsdp"), None)),
        ("sp", "data=2,sequence=4", P("data", "sequence")),
    ],
)
def test_global_batches_have_the_rule_tables_sharding(config, rules, mesh_spec, expected):
    mesh = make_mesh(mesh_spec)
    train, evaluation = make_datasets(
        config, TOK, SEQ, BATCH, mesh=mesh, rules=get_rules(rules), seed=4
    )
    plain_train, plain_eval = make_datasets(config, TOK, SEQ, BATCH, seed=4)
    want = NamedSharding(mesh, expected)
    pairs = [(next(train), next(plain_train)) for _ in range(train.batches_per_epoch + 1)]
    pairs += list(zip(evaluation, plain_eval, strict=True))
    for batch, plain in pairs:
        assert (
            set(batch) == set(plain) == {"inputs", "targets", "segment_ids", "positions", "weights"}
        )
        for key, array in batch.items():
            assert isinstance(array, jax.Array) and array.shape == (BATCH, SEQ)
            assert array.sharding.is_equivalent_to(want, 2), (key, array.sharding)
            assert array.dtype == plain[key].dtype
            np.testing.assert_array_equal(np.asarray(array), plain[key])
            for shard in array.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), plain[key][shard.index])


def test_batch_not_divisible_by_its_shards(config):
    with pytest.raises(DataError, match="global batch size 6 is not divisible by its 8 shards"):
        make_datasets(config, TOK, SEQ, 6, mesh=make_mesh("fsdp=8"), rules=get_rules("fsdp"))
