"An experiment notebook's frame (`topk_nb.runner.notebook`): each parameter declared once, in the notebook's parameters cell, checked the same way by the runner and by the notebook, and a new notebook that needs only its parameters and its body."
import re
from pathlib import Path

import nbformat
import pytest

from topk_nb.runner import batch
from topk_nb.runner.batch import load_records, run_grid
from topk_nb.runner.cli import main
from topk_nb.runner.grid import notebook_parameters, parameter_choices

NOTEBOOKS = Path(__file__).resolve().parent.parent / "nbs" / "experiments"


def new_notebook(path: Path, parameters: str, *body: str) -> Path:
    "A new experiment notebook as its author writes it: the parameters cell, `start`, the body, `finish`."
    cells = [nbformat.v4.new_code_cell(parameters),
             nbformat.v4.new_code_cell("from topk_nb.runner.notebook import start\njob = start(globals())"),
             *(nbformat.v4.new_code_cell(b) for b in body),
             nbformat.v4.new_code_cell('job.finish({"final": final})')]
    cells[0].metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


PARAMETERS = ("from typing import Literal\n\n"
              "loss: Literal['ce', 'topk_grouping'] = 'ce'   # the loss\n"
              "k = 2                                         # its k\n"
              "sizes = [3, 5]\n"
              "seed = 0\n"
              "record_path = None")
BODY = ("import torch\nfrom topk_nb.loss.registry import get_loss\n"
        "g = torch.Generator().manual_seed(seed)\n"
        "fn = get_loss(loss, **({'k': k} if loss != 'ce' else {}))\n"
        "final = [{'loss': loss, 'seed': seed, 'n': n, 'value': fn(torch.randn(4, n, generator=g), torch.arange(4) % n).item()}"
        " for n in sizes]")


def test_a_new_notebook_needs_only_its_parameters_and_body(tmp_path):
    nb = new_notebook(tmp_path / "mine.ipynb", PARAMETERS, BODY)
    summary = run_grid(str(nb), grid={"loss": ["ce", "topk_grouping"]}, seeds=2, out_dir=tmp_path / "runs", progress=False)
    assert summary["ok"] == 4 and summary["failed"] == 0
    records = load_records(tmp_path / "runs")
    # every parameter of the cell, with the grid's value, and nothing else; the seed the record names is the cell's
    assert sorted((r["params"]["loss"], r["params"]["seed"]) for r in records) == [("ce", 0), ("ce", 1),
                                                                                    ("topk_grouping", 0), ("topk_grouping", 1)]
    assert all(set(r["params"]) == {"loss", "k", "sizes", "seed"} and r["seed"] == r["params"]["seed"] for r in records)
    assert all([row["n"] for row in r["metrics"]["final"]] == [3, 5] and r["wall_time_s"] > 0 for r in records)


def test_the_runner_and_the_notebook_refuse_a_value_outside_the_annotation(tmp_path, capsys):
    nb = new_notebook(tmp_path / "mine.ipynb", PARAMETERS, BODY)
    # before anything runs: the runner reads the annotation from the cell's source
    assert main(["run", str(nb), "--grid", "loss=focal", "--out", str(tmp_path / "runs")]) == 2
    assert "--grid loss=focal: loss takes one of 'ce', 'topk_grouping'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # alone (papermill, as a user runs it): `start` refuses it from the annotation Python keeps
    import papermill
    with pytest.raises(papermill.PapermillExecutionError, match="loss takes one of 'ce', 'topk_grouping'"):
        papermill.execute_notebook(str(nb), str(tmp_path / "out.ipynb"), parameters={"loss": "focal"},
                                   progress_bar=False, kernel_name="python3")


def test_a_catalogue_notebook_alone_refuses_what_the_runner_refuses(tmp_path, capsys):
    import papermill
    nb = batch.EXPERIMENTS["cifar100_noise"].notebook_path()
    assert main(["run", "cifar100_noise", "--grid", "model=densenet_tiyn", "--out", str(tmp_path / "runs")]) == 2
    assert "'densenet_tiyn' is no model of the registry" in capsys.readouterr().err
    with pytest.raises(papermill.PapermillExecutionError, match="'densenet_tiyn' is no model of the registry"):
        papermill.execute_notebook(str(nb), str(tmp_path / "out.ipynb"), parameters={"model": "densenet_tiyn"},
                                   progress_bar=False, kernel_name="python3")
    assert main(["run", "cifar100_transition", "--grid", "augment=mixupp", "--out", str(tmp_path / "runs")]) == 2
    assert "--grid augment=mixupp: augment takes one of 'cutout', 'mixup'" in capsys.readouterr().err
    assert main(["run", "noise_scale", "--grid", "train_preset=garcin", "--out", str(tmp_path / "runs")]) == 2
    assert "'garcin' is no training preset of the registry" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(batch.EXPERIMENTS))
def test_every_experiment_notebook_has_the_frame_and_declares_its_parameters_once(name):
    nb = nbformat.read(str(batch.EXPERIMENTS[name].notebook_path()), as_version=4)
    body = [c.source for c in nb.cells if c.cell_type == "code" and not c.source.startswith(("#| export", "#| default_exp"))
            and "parameters" not in c.metadata.get("tags", [])]
    text = "\n".join(body)
    assert len(re.findall(rf'\bstart\(globals\(\), "{name}"', text)) == 1, "one start, with the notebook's catalogue name"
    assert len(re.findall(r"\bjob\.finish\(", text)) == 1, "one finish, which writes the record"
    # none of the hand-written frame is left: no parameter dictionary, no record written by hand, no clock
    assert not re.search(r"\bparams = dict\(|\bwrite_record\(|time\.perf_counter\(\)|json\.dumps\(params\)", text)
    params = notebook_parameters(batch.EXPERIMENTS[name].notebook_path())
    # no parameter is assigned again outside its cell (reading it is the body's business)
    for p in params:
        assert not re.search(rf"^{p}\s*=", text, re.M), f"{p} is assigned outside the parameters cell"
    # the choices of each annotation include its default
    for p, values in parameter_choices(batch.EXPERIMENTS[name].notebook_path()).items():
        assert params[p] in values, (p, params[p], values)


def test_zero_temperature_runs_the_hard_hinge_through_the_registry(tmp_path):
    exp = batch.EXPERIMENTS["temperature"]
    rec = batch.run_cell(exp.notebook_path(), {"tau": 0.0, "epochs": 0}, tmp_path, experiment="temperature")
    assert rec["status"] == "ok", rec.get("error")
    rows = {r["loss"]: r for r in rec["metrics"]["final"]}
    assert set(rows) == {"smooth_svm", "ce"} and rows["smooth_svm"]["tau"] == 0.0
    assert rows["smooth_svm"]["nonzero_share"] <= 2 / 100 and rows["ce"]["nonzero_share"] == 1.0


def test_start_refuses_an_experiment_the_catalogue_does_not_know():
    "A misspelt experiment name would go into the record unknown to the report: it stops at start, with the near name."
    from topk_nb.runner.notebook import start
    with pytest.raises(ValueError, match="did you mean 'circles_tradeoffs'"):
        start({"sigma": 20.0}, "circles_tradeoff")
    assert start({"loss": "mine", "k": 2}).experiment is None          # no name: an ad-hoc notebook, as before


def test_a_value_that_strict_json_cannot_hold_is_refused_at_start():
    "The record holds the parameters as strict JSON (`records.plain`: NaN would become the string 'nan'): NaN and infinities stop the notebook, even inside a list or for a string parameter, instead of being recorded as what they are not."
    import json
    from topk_nb.runner.notebook import start
    from topk_nb.runner.records import plain
    nan_list = [3, float("nan")]
    assert json.loads(json.dumps(plain(nan_list), allow_nan=False)) != nan_list     # what a record would have said
    for namespace in ({"sizes": nan_list}, {"name": float("inf")}, {"grid": {"a": (1.0, float("-inf"))}}):
        name = next(iter(namespace))
        with pytest.raises(ValueError, match=f"^{name}=.*: {name} holds NaN or an infinity"):
            start(namespace)
    assert start({"sizes": (3, 5), "grid": {"a": (1.0, None)}}).params == {"sizes": [3, 5], "grid": {"a": [1.0, None]}}

