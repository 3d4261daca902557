"""Classification runs keep their class names, and ``shardzoo eval`` scores them: accuracy over
the split (equal to the trainer's final ``eval_accuracy``), per class by name; data with a class
the run never saw, or of another label kind, is one line."""

import json

import numpy as np
import pytest

from shardzoo.cli import main
from shardzoo.train.metrics import read_metrics

CLASSES = ["cat", "dog", "eel"]


def write_pets(path, n, seed=0, classes=CLASSES):
    """Three well-separated clusters of 8 features, labelled by name."""
    rng = np.random.default_rng(seed)
    centres = np.eye(8)[:3] * 3
    lines = ["a,b,c,d,e,f,g,h,label"]
    for i in range(n):
        k = i % len(classes)
        x = centres[CLASSES.index(classes[k])] + rng.normal(scale=0.5, size=8)
        lines.append(",".join(f"{v:.5f}" for v in x) + f",{classes[k]}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def pets_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pets")
    data = write_pets(root / "pets.csv", 120)
    out = root / "run"
    rc = main(["train", "--out", str(out), "--data", str(data), "--label-column", "label",
               "--model", "mlp-tiny", "--override", "in_features=8", "--override", "num_outputs=3",
               "--steps", "40", "--batch-size", "16", "--lr", "1e-2", "--warmup-steps", "2",
               "--log-every", "10", "--eval-every", "0", "--eval-fraction", "0.25"])
    assert rc == 0
    return root, out


def test_the_run_records_its_class_names(pets_run):
    _, out = pets_run
    run = json.loads((out / "run.json").read_text())
    assert run["classes"] == {"num_classes": 3, "names": CLASSES}


def test_eval_scores_a_classification_run_with_class_names(pets_run, tmp_path, capsys):
    root, out = pets_run
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--split", "eval", "--out", str(tmp_path / "m.json")]) == 0
    line = capsys.readouterr().out.strip()
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["task"] == "classification" and metrics["classes"] == CLASSES
    assert metrics["examples"] == 30 and sum(c["examples"] for c in metrics["per_class"].values()) == 30
    final = read_metrics(str(out / "metrics.jsonl"))[-1]
    assert abs(metrics["accuracy"] - final["eval_accuracy"]) < 1e-5
    assert abs(metrics["loss"] - final["eval_loss"]) < 1e-5
    assert metrics["accuracy"] > 0.9
    per_class = metrics["per_class"]
    expected = sum(c["accuracy"] * c["examples"] for c in per_class.values()) / 30
    assert abs(expected - metrics["accuracy"]) < 1e-6
    assert line.startswith("classification over 30 examples: accuracy ") and "cat " in line and "eel " in line


def test_eval_maps_names_of_other_data_onto_the_runs_ids(pets_run, tmp_path, capsys):
    root, out = pets_run
    # only dogs and eels: sorted on their own they would be ids 0 and 1, the run's are 1 and 2
    data = write_pets(tmp_path / "two.csv", 20, seed=5, classes=["dog", "eel"])
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--data", str(data), "--out", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["per_class"]["cat"]["examples"] == 0
    assert metrics["per_class"]["dog"]["examples"] == metrics["per_class"]["eel"]["examples"] == 10
    assert metrics["accuracy"] > 0.9


@pytest.mark.parametrize("content, expected", [
    ("a,b,c,d,e,f,g,h,label\n1,0,0,0,0,0,0,0,cat\n0,0,0,1,0,0,0,0,fox\n", "class 'fox' of label column 'label' is not one the run was trained on (cat, dog, eel)"),
    ("a,b,c,d,e,f,g,h,label\n1,0,0,0,0,0,0,0,0\n0,1,0,0,0,0,0,0,1\n", "holds class ids but the run was trained on class names"),
])
def test_eval_of_classes_the_run_never_saw_is_one_line(pets_run, snapshot, tmp_path, content, expected, capsys):
    _, out = pets_run
    data = tmp_path / "bad.csv"
    data.write_text(content)
    before = snapshot(out), snapshot(tmp_path)
    capsys.readouterr()
    rc = main(["eval", "--checkpoint", str(out), "--data", str(data)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("shardzoo eval: error: ") and expected in err[0], err
    assert (snapshot(out), snapshot(tmp_path)) == before


def test_a_resume_on_data_of_other_classes_is_one_line(pets_run, snapshot, tmp_path, capsys):
    import shutil

    _, out = pets_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    data = write_pets(tmp_path / "two.csv", 40, seed=5, classes=["dog", "eel"])
    before = snapshot(run)
    capsys.readouterr()
    rc = main(["train", "--out", str(run), "--data", str(data), "--label-column", "label",
               "--model", "mlp-tiny", "--override", "in_features=8", "--override", "num_outputs=3",
               "--steps", "41", "--batch-size", "16", "--lr", "1e-2", "--warmup-steps", "2",
               "--log-every", "10", "--eval-every", "0", "--eval-fraction", "0.25"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert "has the classes dog, eel, the run in" in err[0] and "was trained on cat, dog, eel" in err[0], err[0]
    assert snapshot(run) == before


def test_eval_of_a_class_id_beyond_the_model_is_one_line(snapshot, tmp_path, capsys):
    data = tmp_path / "ids.csv"
    rows = [",".join(["1" if j == i % 3 else "0" for j in range(8)]) + f",{i % 3}" for i in range(32)]
    data.write_text("a,b,c,d,e,f,g,h,label\n" + "\n".join(rows) + "\n")
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", str(data), "--label-column", "label", "--model", "mlp-tiny",
                 "--override", "in_features=8", "--override", "num_outputs=3", "--steps", "2",
                 "--batch-size", "16", "--eval-every", "0"]) == 0
    assert json.loads((out / "run.json").read_text())["classes"] == {"num_classes": 3, "names": None}
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c,d,e,f,g,h,label\n1,0,0,0,0,0,0,0,0\n0,1,0,0,0,0,0,0,5\n")
    before = snapshot(out)
    capsys.readouterr()
    rc = main(["eval", "--checkpoint", str(out), "--data", str(bad)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "class id 5 of label column 'label', the model has num_outputs=3" in err[0], err
    assert snapshot(out) == before
