"""The run config: sections, the sectioned --config file, the one coercer."""

import dataclasses

import pytest

from shardzoo.cli import build_parser
from shardzoo.train.config import SECTIONS, ConfigError, TrainConfig
from shardzoo.train.flags import config_from_args


def test_every_setting_lives_in_exactly_one_section():
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    placed = [name for names in SECTIONS.values() for name in names]
    assert sorted(placed) == sorted(fields)  # no field missing, none twice


def test_a_sectioned_config_file_applies_and_flags_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {model: gpt2-tiny, override: {hidden_size: 32}}\n"
        "data: {batch_size: 4, seq_len: 32, feature_columns: [a, b]}\n"
        "optimizer: {lr: 2.0e-2, steps: 50, grad-accum: 2}\n"
        "runtime: {compile_cache: /tmp/cache}\n"
    )
    args = build_parser().parse_args(["train", "--config", str(path), "--out", "x", "--steps", "7"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.override, cfg.batch_size, cfg.seq_len) == ("gpt2-tiny", ("hidden_size=32",), 4, 32)
    assert (cfg.lr, cfg.steps, cfg.grad_accum, cfg.compile_cache) == (0.02, 7, 2, "/tmp/cache")
    assert cfg.feature_columns == ("a", "b")
    assert cfg.to_sections()["optimizer"]["steps"] == 7 and cfg.section("checkpoint")["out"] == "x"


@pytest.mark.parametrize("text, message", [
    ("optimizer: {learning_rate: 0.1}\n", "unknown setting 'learning_rate' in section 'optimizer'"),
    ("data: {batch_size: many}\n", "data.batch_size: expected an integer, got 'many'"),
    ("optimizer: {lr: [1]}\n", "optimizer.lr: expected a number"),
])
def test_a_bad_config_file_names_the_setting(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    args = build_parser().parse_args(["train", "--config", str(path), "--out", "x"])
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        config_from_args(args)


def test_flags_go_through_the_same_coercer():
    args = build_parser().parse_args(["train", "--out", "x", "--feature-columns", "pixels,extra"])
    assert config_from_args(args).feature_columns == ("pixels", "extra")


def test_a_warm_up_as_long_as_the_run_is_said_in_one_line():
    from shardzoo.train.optim import make_schedule, warmup_note

    short = TrainConfig(steps=20, warmup_steps=20, lr=1e-3)
    note = warmup_note(short)
    assert note.startswith("note: --warmup-steps 20 >= --steps 20: ") and "never reaches --lr 0.001" in note
    assert "\n" not in note and "--warmup-steps below 20, e.g. 2" in note
    assert float(make_schedule(short)(short.steps - 1)) < short.lr  # what it says: the last step's lr is below
    assert warmup_note(TrainConfig(steps=21, warmup_steps=20)) is None
    assert warmup_note(TrainConfig(steps=5, warmup_steps=0)) is None


def test_each_task_owns_its_settings_and_the_other_tasks_refuse_them():
    from shardzoo.train.tasks.registry import RUN_TASKS
    from shardzoo.train.tasks.settings import OWNED, TASK_SETTINGS

    assert set(OWNED) <= {f.name for f in dataclasses.fields(TrainConfig)}  # no typo in a task's settings
    assert all(component.settings is TASK_SETTINGS[name] for name, component in RUN_TASKS.items())
    assert TrainConfig(task="kto", desirable_weight=2.0).desirable_weight == 2.0
    with pytest.raises(ConfigError, match="--desirable-weight is a setting of --task kto$"):
        TrainConfig(task="dpo", desirable_weight=2.0)
    with pytest.raises(ConfigError, match="--reference is a setting of --task dpo, kto, grpo or rloo$"):
        TrainConfig(task="reward", reference="somewhere")
    # on-policy distillation takes the sampler's settings; off-policy it refuses them
    assert TrainConfig(task="distill", teacher="t", lmbda=0.5, top_k=4).on_policy
    with pytest.raises(ConfigError, match="--top-k is a setting of --task grpo or rloo$"):
        TrainConfig(task="distill", teacher="t", top_k=4)
