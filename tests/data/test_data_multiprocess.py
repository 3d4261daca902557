"""Two real JAX processes (4 CPU devices each): each computes only its part of the batch, and
every shard of the global arrays equals that part of the single-process numpy batch (fsdp splits
the rows between the processes; sp on sequence=2 splits the columns)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    index, port, data, cache, out = sys.argv[1:]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(index))
    import numpy as np
    from shardzoo.data import DataConfig, load_tokenizer, make_datasets
    from shardzoo.sharding import get_rules, make_mesh

    tok = load_tokenizer("byte")
    config = DataConfig(data=data, eval_fraction=0.2, cache_dir=cache)
    report = {}
    for rules, mesh_spec in [("fsdp", "data=2,fsdp=4"), ("sp", "sequence=2,tensor=4")]:
        mesh = make_mesh(mesh_spec)
        train, evaluation = make_datasets(config, tok, 16, 8, mesh=mesh, rules=get_rules(rules), seed=9)
        plain, plain_eval = make_datasets(config, tok, 16, 8, seed=9, process_index=0, process_count=1)
        pairs = [(next(train), next(plain)) for _ in range(train.batches_per_epoch + 1)]
        pairs += list(zip(evaluation, plain_eval, strict=True))
        local_rows = set()
        for batch, want in pairs:
            for key in want:  # every shard this process holds equals that part of the batch
                assert batch[key].shape == want[key].shape
                for shard in batch[key].addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), want[key][shard.index])
                    local_rows.update(range(*shard.index[0].indices(8)))
        report[rules] = {"batches": len(pairs), "local_rows": sorted(local_rows)}
    json.dump(report, open(out, "w"))
    """
)


def test_two_processes_assemble_the_global_batch(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " + "xy" * i}) + "\n" for i in range(40)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    outs = [tmp_path / f"out{i}.json" for i in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i), str(port), str(data), str(tmp_path / f"c{i}"), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    reports = [json.loads(o.read_text()) for o in outs]
    for report in reports:
        assert report["fsdp"]["batches"] == report["sp"]["batches"] > 3
    # fsdp: each process holds half of the rows; sp on sequence=2: all rows, half of the columns.
    assert reports[0]["fsdp"]["local_rows"] == list(range(4))
    assert reports[1]["fsdp"]["local_rows"] == list(range(4, 8))
    assert reports[0]["sp"]["local_rows"] == reports[1]["sp"]["local_rows"] == list(range(8))
