"""The train step fitted to a device's memory (``train/fit.py``, ``sharding.plan.first_fit``), on
faked memory tables and a faked accelerator: no compile here (the CLI's runs are in
test_train_cli.py)."""

import math
import types

import jax
import pytest

from shardzoo.cli import main
from shardzoo.models import get_config
from shardzoo.sharding import plan as plan_module
from shardzoo.sharding.plan import first_fit, local_device_memory
from shardzoo.train import fit
from shardzoo.train.config import ConfigError, TrainConfig

GB = 10**9
# llama3.2-1b at 2 x 2048 on a TPU v5e (TPU.md): none runs out while compiling, dots_... 19.1 GB
TABLE = {"none": None, "dots_with_no_batch_dims_saveable": 19.1 * GB, "save_qkv_mlp": 17.2 * GB,
         "save_qkv": 15.5 * GB, "save_attn_mlp": 16.3 * GB, "full": 9 * GB}
V5E = ("local TPU v5 lite (16.9 GB)", 16_910_000_000)
OOM = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. 37.32G exceeds available HBM (15.75G)"


def test_first_fit_takes_the_first_candidate_within_the_limit_less_headroom():
    asked = []

    def needed(c):
        asked.append(c)
        return {"a": 20, "b": 10, "c": 5}[c]

    got = first_fit(["a", "b", "c"], needed, limit=11, headroom=0.05)  # budget 10.45
    assert got.choice == "b" and got.budget == pytest.approx(10.45) and got.limit == 11
    assert got.needed == (("a", 20), ("b", 10)) and asked == ["a", "b"]  # c is never compiled
    assert first_fit(["a", "b"], needed, limit=10, headroom=0.05).choice is None  # budget 9.5
    assert first_fit(["a"], lambda c: None, limit=1).choice == "a"  # a backend that cannot tell


class _Compiled:
    def __init__(self, total):
        self.total = total

    def memory_analysis(self):
        return types.SimpleNamespace(argument_size_in_bytes=self.total // 2, output_size_in_bytes=self.total // 2,
                                     temp_size_in_bytes=self.total // 2, alias_size_in_bytes=self.total // 2)


class _Program:
    """A Program whose train step "compiles" to the memory table's bytes, or runs out of memory."""

    def __init__(self, config, table):
        self.config, self.policy = config, config.execution.remat_policy
        self.compiled = 0
        self.needed = table[self.policy]

    def compiled_train_step(self):
        self.compiled += 1
        if self.needed is None:
            raise jax.errors.JaxRuntimeError(OOM)
        return _Compiled(int(self.needed))

    def reference_bytes(self):
        return None

    def reward_model_bytes(self):
        return None


def _builder(table):
    built = []

    def build(config):
        built.append(_Program(config, table))
        return built[-1]

    return build, built


def test_remat_auto_takes_the_fastest_policy_whose_step_fits():
    config, cfg = get_config("llama-tiny"), TrainConfig()
    build, built = _builder(TABLE)
    got = fit.fit_step(cfg, config, build, V5E, "auto")
    # none runs out of memory while compiling, dots_... needs 19.1 GB, save_qkv_mlp 17.2: save_qkv
    # (15.5 of 16.4 allowed); save_attn_mlp, slower, is never compiled
    assert got.remat == "save_qkv" and got.config.execution.remat_policy == "save_qkv"
    assert got.program is built[-1] and [p.policy for p in built] == ["none", "dots_with_no_batch_dims_saveable",
                                                                      "save_qkv_mlp", "save_qkv"]
    assert all(p.compiled == 1 for p in built)  # each candidate compiled once; the Trainer reuses the choice
    assert got.line.startswith("remat auto: save_qkv, the first of none, dots_with_no_batch_dims_saveable, "
                               "save_qkv_mlp, save_qkv, save_attn_mlp, full (fastest first)")
    assert "none 40.07 GB" in got.line and "save_qkv 15.50 GB" in got.line  # 37.32 GiB from XLA's message


def test_remat_auto_on_a_resume_keeps_the_recorded_policy_and_checks_it():
    build, built = _builder(TABLE)
    got = fit.fit_step(TrainConfig(), get_config("llama-tiny"), build, V5E, "auto", recorded="full")
    assert got.remat == "full" and [p.policy for p in built] == ["full"] and built[0].compiled == 1
    assert "as the checkpoint it resumes records" in got.line


def test_a_step_that_fits_no_policy_is_one_line_naming_bytes_and_remedies():
    table = {**TABLE, "save_qkv": 17.1 * GB, "save_attn_mlp": 17 * GB, "full": 16.5 * GB}
    build, _ = _builder(table)
    with pytest.raises(fit.StepDoesNotFit) as e:
        fit.fit_step(TrainConfig(batch_size=4, seq_len=2048), get_config("llama-tiny"), build, V5E, "auto")
    msg = str(e.value)
    assert "\n" not in msg
    assert "it needs 16.50 GB" in msg and "one device has 16.91 GB" in msg and "remat none 40.07 GB" in msg
    for remedy in ("--batch-size (now 4)", "--seq-len (now 2048)", "--override param_dtype=bfloat16",
                   "--opt-rules zero1", "--grad-accum 2"):
        assert remedy in msg
    assert "--remat full" not in msg  # full was tried


def test_a_named_policy_is_checked_not_replaced():
    build, built = _builder({"none": 20 * GB})
    with pytest.raises(fit.StepDoesNotFit, match=r"remat none 20.00 GB.*--remat full"):
        fit.fit_step(TrainConfig(), get_config("llama-tiny"), build, V5E, "none")
    build, built = _builder({"none": 20 * GB})
    assert fit.fit_step(TrainConfig(), get_config("llama-tiny"), build, None, "none").remat == "none"
    assert built[0].compiled == 0  # no memory known: nothing to check, the Trainer compiles


def test_remat_auto_without_a_known_memory_takes_the_fastest_without_compiling():
    build, built = _builder(TABLE)
    got = fit.fit_step(TrainConfig(), get_config("llama-tiny"), build, None, "auto")
    assert got.remat == "none" and built[0].compiled == 0 and "no device memory known" in got.line


def test_requested_remat_defaults_to_auto_on_an_accelerator_only():
    config = get_config("llama-tiny")
    assert fit.requested_remat(TrainConfig(), config, accelerator=False) == "none"
    assert fit.requested_remat(TrainConfig(), config, accelerator=True) == "auto"
    pinned = TrainConfig(override=("remat_policy=full",))
    assert fit.requested_remat(pinned, config.replace(remat_policy="full"), accelerator=True) == "full"
    assert fit.requested_remat(TrainConfig(remat="auto"), config, accelerator=False) == "auto"
    with pytest.raises(ConfigError, match="--remat 'fast': choose auto or one of none, full"):
        fit.requested_remat(TrainConfig(remat="fast"), config, accelerator=True)
    with pytest.raises(ConfigError, match="disagree"):
        fit.requested_remat(TrainConfig(remat="none", override=("remat_policy=full",)), config, True)
    mlp = get_config("mlp-mnist")
    assert fit.requested_remat(TrainConfig(), mlp, accelerator=True) is None


def test_out_of_memory_while_running_names_the_sizes_xla_gives():
    error = jax.errors.JaxRuntimeError(OOM)
    msg = fit.out_of_memory_message(TrainConfig(), get_config("llama-tiny"), V5E, error)
    assert msg.startswith("the train step (remat none) needs 40.07 GB per device while running, one device has "
                          "16.91 GB (local TPU v5 lite (16.9 GB)): try a smaller --batch-size (now 16)")
    unsized = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    assert fit.out_of_memory_message(TrainConfig(), get_config("mlp-mnist"), None, unsized).startswith(
        "the train step ran out of device memory while running: try")


def test_xla_out_of_memory_sizes():
    assert fit.xla_sizes(OOM) == (37.32 * 2**30, 15.75 * 2**30)
    assert fit.xla_sizes("RESOURCE_EXHAUSTED: out of memory") == (None, None)
    assert fit.is_out_of_memory(jax.errors.JaxRuntimeError(OOM))
    assert not fit.is_out_of_memory(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: x"))
    assert not fit.is_out_of_memory(MemoryError("RESOURCE_EXHAUSTED"))
    assert fit.step_bytes(_Program(get_config("llama-tiny"), {"none": None})) == 37.32 * 2**30

    class Unsized(_Program):
        def compiled_train_step(self):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

    assert math.isinf(fit.step_bytes(Unsized(get_config("llama-tiny"), {"none": 1})))


class _Device:
    platform, device_kind = "tpu", "TPU v5 lite"

    def memory_stats(self):
        return {"bytes_limit": 16_910_000_000, "bytes_in_use": 0}


def test_local_device_memory_reads_an_accelerators_limit():
    assert local_device_memory(_Device()) == ("local TPU v5 lite (16.9 GB)", 16_910_000_000)
    assert local_device_memory() is None  # the CPU: no verdict without --device-memory
    broken = types.SimpleNamespace(platform="gpu", device_kind="x", memory_stats=lambda: 1 / 0)
    assert local_device_memory(broken) is None


def test_plan_on_an_accelerator_gives_its_verdict_without_flags(monkeypatch, capsys):
    monkeypatch.setattr(plan_module, "local_device_memory", lambda: local_device_memory(_Device()))
    assert main(["plan", "--model", "llama-tiny", "--rules", "fsdp", "--mesh", "fsdp=8"]) == 0
    out = capsys.readouterr().out
    assert "  device local TPU v5 lite (16.9 GB): fits (" in out and "no device memory named" not in out
