"Tests of topk_nb.runner.batch and topk_nb.runner.report: grid expansion, resume after kill -9, failure isolation, GPU assignment, the report."
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from topk_nb.runner import batch
from topk_nb.runner import report as reports
from topk_nb.runner.batch import (RECORD, Experiment, Figure, Finding, PaperValue, cell_dir, cell_id,
                           expand_grid, load_records, parse_grid, read_record, run_grid, write_record)
from topk_nb.runner.cli import main
from topk_nb.runner.report import report
from topk_nb.training.data import fake_image_folder

CIRCLES_TRADEOFFS = batch.EXPERIMENTS["circles_tradeoffs"]


def fake_notebook(path, body: str, tagged: bool = True) -> Path:
    "A tiny experiment notebook: a (`parameters`-tagged) defaults cell, then `body` (which writes the record)."
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("x = 1\nseed = 0\nrecord_path = None")
    if tagged: params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return Path(path)


WRITE = ("import os\nfrom topk_nb.runner.records import write_record\n"
         "write_record(record_path, {'x': x, 'seed': seed}, {'final': [{'y': 10 * x + seed, "
         "'gpu': os.environ.get('CUDA_VISIBLE_DEVICES')}]}, seed=seed)")


# --- grid expansion -------------------------------------------------------------------------------------------
def test_expand_grid_product_order_and_seeds():
    cells = expand_grid({"a": [1, 2], "b": "z", "c": [True, False]}, seeds=2)
    assert cells == [{"a": a, "b": "z", "c": c, "seed": s} for a in (1, 2) for c in (True, False) for s in (0, 1)]


def test_expand_grid_overrides_union_and_vectorised_seeds():
    cells = expand_grid([{"a": [1, 2], "e": 5}, {"a": [2, 3], "e": 5}], {"e": [7]}, seeds=4, seeds_param="n")
    assert cells == [{"a": 1, "e": 7, "n": 4}, {"a": 2, "e": 7, "n": 4}, {"a": 3, "e": 7, "n": 4}]
    assert expand_grid(None) == [{}]
    with pytest.raises(ValueError, match="seeds must be a positive integer"):
        expand_grid({"a": 1}, seeds=0)


def test_parse_grid():
    assert parse_grid(["sigma=10,12.5", "d=null", "loss=ce,topk_grouping"]) == \
        {"sigma": [10, 12.5], "d": [None], "loss": ["ce", "topk_grouping"]}
    with pytest.raises(ValueError, match="key=v1,v2"):
        parse_grid(["sigma="])


def test_paper_presets_are_the_papers_values():
    cells = expand_grid(CIRCLES_TRADEOFFS.presets["paper"])
    assert len(cells) == 15
    assert sorted(c["sigma"] for c in cells if c["experiment"] == 1) == [10, 15, 20, 25, 30]
    assert sorted(c["d"] for c in cells if c["experiment"] == 2) == [30, 45, 60, 75, 90]
    assert sorted(c["m"] for c in cells if c["experiment"] == 3) == [2, 4, 8, 16, 32]
    assert all(c["epochs"] == 1000 and c["n_per_class"] == c["n_test_per_class"] == 300 and c["n_seeds"] == 10
               and c["n_classes"] == 6 and c["k"] == 2 for c in cells)
    assert all(c["sigma"] == 10 and c["minor_ratio"] == 0.5 for c in cells if c["experiment"] > 1)
    assert all(c["d"] == 90 for c in cells if c["experiment"] == 3)


# the papers' sentences on how many runs each number averages
PAPER_SEEDS = [
    ("circles_tradeoffs", "paper", 10),        # Sawada IV-A: "averaged over ten runs with different random seeds"
    ("cifar100_noise", "berrada", 3),          # Berrada 2018, §5.1: "averaged over three runs with different random seeds"
    ("cifar100_noise", "garcin", 2),           # Garcin 2022, §4.4: "averaged over two runs with two different random seeds"
    ("cifar100_transition", "paper", 10),      # Sawada, Tab. I: "averaged over 10 different trials"
    ("imagenet_lt", "paper", 4),               # Garcin 2022 draft, §4.5.2: "four seeds, 95% confidence interval"
    ("plantnet_imbalanced", "paper", 3),       # Garcin 2022 draft, §4.5.1 (Tab. 5): "three seeds, 95% confidence interval"
]


@pytest.mark.parametrize("name, preset, n", PAPER_SEEDS)
def test_paper_presets_run_the_papers_seeds(name, preset, n):
    exp = batch.EXPERIMENTS[name]
    seeds = {}
    for cell in expand_grid(exp.presets[preset]):
        setting = json.dumps({k: v for k, v in cell.items() if k not in ("seed", exp.seeds_param)}, sort_keys=True)
        seeds.setdefault(setting, []).append(cell[exp.seeds_param] if exp.seeds_param else cell["seed"])
    expected = [n] if exp.seeds_param else list(range(n))
    assert seeds and all(sorted(s) == expected for s in seeds.values()), (name, preset)


def test_a_fine_tuning_preset_refuses_to_start_without_its_weights(tmp_path, capsys):
    # Garcin 2022, §4.5: "We train a ResNet-50 (He et al., 2016) pre-trained on ImageNet"
    with pytest.raises(ValueError, match="preset 'paper' of plantnet_imbalanced needs the parameter weights: Garcin "
                                         "2022, §4.5 fine-tunes .* give it with --grid weights="):
        batch.plan_grid("plantnet_imbalanced", "paper", data_root=tmp_path)
    assert main(["run", "plantnet_imbalanced", "--preset", "paper", "--data-root", str(tmp_path), "--out",
                 str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the parameter weights" in err and not (tmp_path / "runs").exists()
    weights = tmp_path / "resnet50.pth"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="holds no plantnet300k data set"):     # the weights given, the data set missing
        batch.plan_grid("plantnet_imbalanced", "paper", {"weights": [str(weights)]}, data_root=tmp_path)
    for split in ("train", "val", "test"):
        fake_image_folder(tmp_path / "images" / split, 2, 1)
    missing = tmp_path / "resnet50_imagenet.pth"    # a weights file that is not there: refused before anything runs
    with pytest.raises(ValueError, match=f"^--grid weights={missing}: the weights file '{missing}' does not exist; save "):
        batch.plan_grid("plantnet_imbalanced", "paper", {"weights": [str(missing)]}, data_root=tmp_path)
    with pytest.MonkeyPatch.context() as mp:        # a relative path is read from where the run starts, not the notebook's folder
        mp.chdir(tmp_path)
        _, cells = batch.plan_grid("plantnet_imbalanced", "paper", {"weights": ["resnet50.pth"]}, data_root=tmp_path)
    assert len(cells) == (5 * 4 + 3) * 3 and all(c["weights"] == str(weights.resolve()) for c in cells)


def test_training_runs_in_float32_unless_asked():
    from topk_nb.training.loop import TrainConfig    # none of the papers trains in reduced precision
    assert TrainConfig().amp is False and TrainConfig(amp=True).amp is True


def test_cell_paths_are_stable():
    assert cell_id({"a": 1, "b": [1, 2]}) == cell_id({"b": [1, 2], "a": 1})
    assert cell_id({"a": 1}) != cell_id({"a": 2}) and cell_id({"a": 1}) != cell_id({"a": "1"})
    assert cell_dir("o", "e", {"a": 1}) == cell_dir("o", "e", {"a": 1})


def test_unknown_experiment_and_preset():
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        run_grid("nope")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        run_grid("circles_tradeoffs", preset="nope")


# --- records ----------------------------------------------------------------------------------------------------
def test_write_record_is_complete_and_atomic(tmp_path):
    path = write_record(tmp_path / "c" / RECORD, {"a": 1}, {"final": [{"top1": 0.25}]}, experiment="e", seed=3,
                        wall_time_s=2.0)
    rec = read_record(path)
    assert rec["status"] == "ok" and rec["params"] == {"a": 1} and rec["seed"] == 3 and rec["wall_time_s"] == 2.0
    assert {"torch", "cuda", "device_name", "git_commit", "python"} <= set(rec["environment"])
    # the one description of a process, which the GPU check's records carry too: its device's capability, Triton
    import platform
    env = rec["environment"]
    assert {"capability", "triton", "cudnn", "n_threads", "cuda_visible_devices"} <= set(env)
    assert (env["python"], env["platform"]) == (platform.python_version(), platform.platform())
    assert [p.name for p in (tmp_path / "c").iterdir()] == [RECORD]
    with pytest.raises(TypeError, match="cannot write object"):
        write_record(tmp_path / "d" / RECORD, {"a": object()})
    assert not (tmp_path / "d" / RECORD).exists() and list((tmp_path / "d").glob("*")) == []   # no file, not even a partial one


# --- resume after kill -9 ---------------------------------------------------------------------------------------
def test_resume_after_kill(tmp_path):
    nb = fake_notebook(tmp_path / "slow.ipynb", "import time\ntime.sleep(0.5)\n" + WRITE)
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "topk_nb.runner.cli", "run", str(nb), "--grid", "x=1,2,3", "--out", str(out),
           "--no-progress"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not load_records(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)          # the runner, its job process and the kernel, at once
    proc.wait()
    done_before = {r["params"]["x"] for r in load_records(out)}
    assert 1 <= len(done_before) < 3, done_before  # killed mid-grid
    for path in out.rglob(RECORD):               # whatever exists is complete JSON
        json.loads(path.read_text())
    summary = run_grid(str(nb), grid=parse_grid(["x=1,2,3"]), out_dir=out, progress=False)
    assert summary["skipped"] == len(done_before) and summary["failed"] == 0
    records = load_records(out, status=None)
    assert sorted(r["params"]["x"] for r in records) == [1, 2, 3]      # each once
    assert all(r["status"] == "ok" and r["metrics"]["final"][0]["y"] == 10 * r["params"]["x"] for r in records)
    assert len(list(out.rglob(RECORD))) == 3 and not list(out.rglob("*.tmp"))
    assert all((Path(r["path"]).parent / "notebook.ipynb").is_file() for r in records)


# --- failure isolation ------------------------------------------------------------------------------------------
def test_failure_is_recorded_and_the_grid_goes_on(tmp_path, monkeypatch):
    (tmp_path / "nbs").mkdir()
    nb = fake_notebook(tmp_path / "nbs" / "fails.ipynb", "if x == 2: raise RuntimeError('cell two is broken')\n" + WRITE,
                       tagged=False)              # as nbdev_clean leaves it: the runner tags the first code cell
    monkeypatch.chdir(tmp_path)                  # a relative --out: records land here, not in the notebook's folder
    out = tmp_path / "runs"
    code = main(["run", str(nb), "--grid", "x=2,3", "--out", "runs", "--no-progress", "--jobs", "2"])
    assert code == 1
    records = {r["params"]["x"]: r for r in load_records(out, status=None)}
    assert sorted(records) == [2, 3]
    assert records[2]["status"] == "failed" and "cell two is broken" in records[2]["error"]
    assert records[3]["status"] == "ok" and records[3]["metrics"]["final"][0]["y"] == 30
    # a rerun skips the successful cell and retries the failed one
    summary = run_grid(str(nb), grid={"x": [2, 3]}, out_dir=out, progress=False)
    assert (summary["skipped"], summary["ok"], summary["failed"]) == (1, 0, 1)
    assert not list((tmp_path / "nbs").rglob(RECORD))



# the notebook writes its record with `write_record`, counting in a file how many times its kernel sealed a record
SEAL_COUNTING = ("import topk_nb.runner.records as R\n"
                 "sealed, seal = [], R.seal_record\n"
                 "R.seal_record = lambda record: (sealed.append(1), seal(record))[1]\n"
                 "R.write_record(record_path, {{'x': x, 'seed': seed}}, {{'final': [{{'y': x}}]}}, seed=seed)\n"
                 "open({count!r}, 'w').write(str(len(sealed)))")


def _counted(calls, name, function):
    def counting(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)
    return counting


def test_a_run_checks_its_request_makes_its_folder_and_seals_each_record_once(tmp_path, monkeypatch):
    from collections import Counter
    from topk_nb.runner import cli, grid, records
    count = tmp_path / "kernel_seals.txt"
    nb = fake_notebook(tmp_path / "nb.ipynb", SEAL_COUNTING.format(count=str(count)))
    calls = Counter()
    for module, name in ((cli, "parse_grid"), (batch, "plan_grid"), (grid, "check_parameters"), (batch, "check_out_dir")):
        monkeypatch.setattr(module, name, _counted(calls, name, getattr(module, name)))
    assert main(["run", str(nb), "--grid", "x=2,3", "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    assert calls == {"parse_grid": 1, "plan_grid": 1, "check_parameters": 1, "check_out_dir": 1}
    recs = load_records(tmp_path / "runs")                  # sealed: a record without its checksum is unreadable
    assert sorted(r["identity"]["cell"]["x"] for r in recs) == [2, 3]
    assert all(r["checksum"] == records.record_checksum(r) for r in recs)
    assert count.read_text() == "0"                          # the notebook's write_record left the seal to the runner
    # a caller of run_grid without a plan gets it planned, once
    calls.clear()
    assert run_grid(str(nb), grid={"x": [2, 4]}, out_dir=tmp_path / "runs", progress=False)["skipped"] == 1
    assert calls == {"plan_grid": 1, "check_parameters": 1, "check_out_dir": 1}


def test_a_record_is_sealed_once_by_the_runner_or_once_by_a_notebook_run_alone(tmp_path, monkeypatch):
    import papermill
    from topk_nb.runner.records import record_checksum
    count = tmp_path / "kernel_seals.txt"
    nb = fake_notebook(tmp_path / "nb.ipynb", SEAL_COUNTING.format(count=str(count)))
    runner, seal = [], batch.seal_record
    monkeypatch.setattr(batch, "seal_record", lambda record: (runner.append(1), seal(record))[1])
    rec = batch.run_cell(nb, {"x": 3}, tmp_path / "cell", identity={"experiment": "nb", "preset": None, "cell": {"x": 3}})
    assert (len(runner), count.read_text()) == (1, "0")          # the runner's seal, with the identity it adds
    assert rec["checksum"] == record_checksum(rec) and rec["identity"]["cell"] == {"x": 3}
    papermill.execute_notebook(str(nb), str(tmp_path / "out.ipynb"), kernel_name="python3", progress_bar=False,
                               parameters={"x": 4, "record_path": str(tmp_path / "alone.json")})
    assert (len(runner), count.read_text()) == (1, "1")          # alone: the notebook's write_record seals it
    assert read_record(tmp_path / "alone.json")["params"] == {"x": 4, "seed": 0}

def test_a_kernel_that_does_not_start_is_started_again(tmp_path, monkeypatch):
    "Busy machines sometimes lose a kernel before its first reply (two kernels racing for a port): the cell starts it again."
    import papermill
    nb, real, starts = fake_notebook(tmp_path / "t.ipynb", WRITE), papermill.execute_notebook, []
    def flaky(*args, **kwargs):
        starts.append(kwargs["start_timeout"])
        if len(starts) == 1: raise RuntimeError("Kernel didn't respond in 60 seconds")
        return real(*args, **kwargs)
    monkeypatch.setattr(papermill, "execute_notebook", flaky)
    rec = batch.run_cell(nb, {"x": 4}, tmp_path / "cell")
    assert rec["status"] == "ok" and rec["metrics"]["final"][0]["y"] == 40 and starts == [batch.KERNEL_START_TIMEOUT] * 2
    def never(*args, **kwargs):
        starts.append(1)
        raise RuntimeError("Kernel didn't respond in 120 seconds")
    monkeypatch.setattr(papermill, "execute_notebook", never)
    starts.clear()
    rec = batch.run_cell(nb, {"x": 5}, tmp_path / "cell5")
    assert rec["status"] == "failed" and "Kernel didn't respond" in rec["error"] and len(starts) == batch.KERNEL_START_TRIES


def test_one_job_per_gpu(tmp_path):
    nb = fake_notebook(tmp_path / "gpu.ipynb", WRITE)
    summary = run_grid(str(nb), grid={"x": [1, 2]}, out_dir=tmp_path / "runs", gpus=["3", "5"], progress=False)
    assert summary["ok"] == 2
    gpus = [r["metrics"]["final"][0]["gpu"] for r in load_records(tmp_path / "runs")]
    assert set(gpus) <= {"3", "5"} and len(gpus) == 2


# --- every experiment notebook runs under papermill with its defaults --------------------------------------
@pytest.mark.parametrize("name", sorted(batch.EXPERIMENTS))
def test_experiment_notebook_defaults(name, tmp_path):
    exp = batch.EXPERIMENTS[name]
    rec = batch.run_cell(exp.notebook_path(), {}, tmp_path, experiment=name)
    assert rec["status"] == "ok", rec.get("error")
    assert rec["metrics"]["final"] and rec["wall_time_s"] > 0 and (tmp_path / "notebook.ipynb").is_file()


def test_parameters_tag_added_when_missing(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("y")]
    nbformat.write(nb, str(tmp_path / "t.ipynb"))
    tagged = batch.with_parameters_tag(tmp_path / "t.ipynb")
    assert [c.metadata.get("tags") for c in tagged.cells] == [None, ["parameters"], None]


# --- the report -------------------------------------------------------------------------------------------------
def _fabricate(out, name, params, rows):
    write_record(cell_dir(out, name, params) / RECORD, params, {"final": rows}, experiment=name)


def test_report_on_fabricated_records(tmp_path):
    exp = Experiment("fab", "none.ipynb", "fabricated", group_by=("s", "loss"),
                     figures=(Figure("f", "fabricated figure", {}, "s", metrics=("top1",)),),
                     paper=(PaperValue("Some 2020, Tab. 1", "ce, s=1", {"s": 1, "loss": "ce"}, "top1", 0.60),
                            PaperValue("Some 2020, Tab. 1", "g, s=3", {"s": 3, "loss": "g"}, "top1", 0.60)),
                     findings=(Finding("Some 2020, Fig. 1", "ce is best", {}, "s", (1, 2), "top1", "best"),))
    for s, vals in ((1, {"ce": [0.6, 0.7, 0.8], "g": [0.5, 0.5, 0.5]}), (2, {"ce": [0.4, 0.4, 0.4], "g": [0.6, 0.6, 0.6]})):
        _fabricate(tmp_path, "fab", {"s": s}, [{"loss": l, "seed": i, "top1": v} for l, vs in vals.items()
                                               for i, v in enumerate(vs)])
    write_record(cell_dir(tmp_path, "fab", {"s": 9}) / RECORD, {"s": 9}, status="failed", error="ValueError: bad s")
    md = report(exp, tmp_path).read_text()
    assert "| Some 2020, Tab. 1 | ce, s=1 | top1 | 60.00 | 70.00 ± 10.00 | 3 | +10.00 |" in md
    assert "| Some 2020, Tab. 1 | g, s=3 | top1 | 60.00 | n/a | 0 | n/a |" in md
    # ce 20 points ahead with a spread of 10 over three seeds: Welch t = 3.46 on 2 df, p = 0.074, within noise
    assert "| s=1 | top1 | ce best | 70.00 ± 10.00 (3) | g: 50.00 ± 0.00 (3) | +20.00 | 3.46 (2.0) | 0.074 | within noise |" in md
    assert "| s=2 | top1 | ce best | 40.00 ± 0.00 (3) | g: 60.00 ± 0.00 (3) | -20.00 | -inf (4.0) | 0.000 | **contradicted** |" in md
    assert "Findings: 0 hold, 1 within noise, 1 contradicted, 0 untested (one seed), 0 not run" in md
    assert "| 1 | 70.00 ± 10.00 | 50.00 ± 0.00 |" in md and "| 2 | 40.00 ± 0.00 | 60.00 ± 0.00 |" in md
    assert "2 successful records, 1 failed" in md and "ValueError: bad s" in md
    assert (tmp_path / "fab" / "report" / "f.png").stat().st_size > 1000
    assert (tmp_path / "fab" / "report" / "f.svg").read_text().startswith("<?xml")
    assert md.startswith("# fab: report\n\n> **Not comparable with the papers' numbers: 2 of 2 records ran no paper")



def _table_rows(md: str) -> list[list[str]]:
    "Each row of the tables of the markdown `md`, as a markdown parser reads it: the texts of its cells, `<br>` as a line break."
    markdown_it = pytest.importorskip("markdown_it")
    rows, row = [], None
    for token in markdown_it.MarkdownIt("commonmark").enable("table").parse(md):
        if token.type == "tr_open": row = []
        elif token.type == "inline" and row is not None: row.append(token.content.replace("<br>", "\n"))
        elif token.type == "tr_close": rows.append(row); row = None
    return rows


def test_a_pipe_or_a_line_break_in_a_cell_stays_in_its_table_row(tmp_path):
    # the report and the GPU check write their tables with one function (`topk_nb.base.results.markdown_table`): a `|` in a
    # GPU check's error no longer splits its row, nor does a line break in a report's claim
    from topk_nb.perf.gpucheck import render_markdown
    error = "RuntimeError: shapes (2 | 3) differ\nin the second line"
    gpu = {"device": "cpu", "preset": "dry", "date": "2026-01-01", "sections": {
        "environment": {"status": "ok", "seconds": 0.0}, "compile": {"status": "error", "error": error, "seconds": 1.5}}}
    assert _table_rows(render_markdown(gpu)) == [["section", "status", "seconds", "note"], ["environment", "ok", "0.0", "-"],
                                                 ["compile", "error", "1.5", error]]
    statement = "ce is best | in top-1\nand in top-2"
    exp = Experiment("fab", "none.ipynb", "fabricated", group_by=("s", "loss"),
                     findings=(Finding("Some 2020, Fig. 1", statement, {}, "s", (1,), "top1", "best"),))
    _fabricate(tmp_path, "fab", {"s": 1}, [{"loss": l, "seed": i, "top1": v} for l, v in (("ce", 0.7), ("g", 0.5))
                                           for i in range(2)])
    rows = _table_rows(report(exp, tmp_path, figures=False).read_text())
    claims = [r for r in rows if r[0] == "Some 2020, Fig. 1"]
    assert len(claims) == 1 and len(claims[0]) == len(rows[0]) == 11 and claims[0][1] == statement

def test_circles_report_on_fabricated_records(tmp_path):
    name = CIRCLES_TRADEOFFS.name
    for d, ce2 in ((30, 0.99), (60, 0.90)):          # CE best in top-2 at d=30, worse at d=60
        rows = [{"loss": l, "seed": s, "top1": t1, "top2": t2} for s in range(2)
                for l, t1, t2 in (("ce", 0.8, ce2), ("topk_grouping", 0.6, 0.95), ("topk_transition", 0.7, 0.96),
                                  ("bayes", 0.9, 1.0))]
        _fabricate(tmp_path, name, {"experiment": 2, "sigma": 10, "d": d, "n_seeds": 2}, rows)
    path = report(name, tmp_path)
    md = path.read_text()
    # two seeds without spread: any difference is beyond the noise
    assert "| d=30 | top2 | ce best | 99.00 ± 0.00 (2) | topk_transition: 96.00 ± 0.00 (2) | +3.00 | inf (2.0) | 0.000 | holds |" in md
    assert "| d=60 | top2 | ce not_best | 90.00 ± 0.00 (2) | topk_transition: 96.00 ± 0.00 (2) | -6.00 | inf (2.0) | 0.000 | holds |" in md
    assert "| d=75 | top2 | ce not_best | n/a | n/a | n/a | n/a | n/a | not run |" in md        # not run: not judged
    assert "| 30 | 80.00 ± 0.00 |" in md and (path.parent / "fig3.png").is_file()
    assert not (path.parent / "fig2.png").exists()                      # no exp. 1 records, no figure


def test_report_counts_each_seed_once_and_ties_are_no_wins(tmp_path):
    name, base = CIRCLES_TRADEOFFS.name, {"experiment": 2, "sigma": 10, "d": 30, "m": None}

    def rows(seeds, ce1, tr1):
        return [{"loss": l, "seed": s, "top1": t1, "top2": 0.99} for s in seeds
                for l, t1 in (("ce", ce1), ("topk_grouping", 0.5), ("topk_transition", tr1), ("bayes", 0.95))]
    old = cell_dir(tmp_path, name, {**base, "n_seeds": 2}) / RECORD          # seeds 0, 1: CE far ahead
    write_record(old, {**base, "n_seeds": 2}, {"final": rows((0, 1), 0.9, 0.6)}, experiment=name, seed=[0, 1])
    os.utime(old, ns=(1, 1))                                                # older than the next one
    _fabricate(tmp_path, name, {**base, "n_seeds": 3}, rows((0, 1, 2), 0.8, 0.8))   # seeds 0-2 again: a tie
    md = report(name, tmp_path).read_text()
    assert "Dropped 8 result rows (2 seeds of 1 records) that repeat the experiment, parameters and seed" in md
    assert "| 30 | 80.00 ± 0.00 | 50.00 ± 0.00 | 80.00 ± 0.00 | 95.00 ± 0.00 |" in md   # three seeds, not five
    # CE ties the transition loss exactly: not a win, however small the spread
    assert "| d=30 | top1 | ce best | 80.00 ± 0.00 (3) | topk_transition: 80.00 ± 0.00 (3) | +0.00 | 0.00 (4.0) | 1.000 | within noise |" in md


def test_figures_draw_the_papers_values_beside_ours(tmp_path):
    exp = batch.EXPERIMENTS["cifar100_noise"]                # Berrada 2018 Tab. 1 with the standard deviations of its Tab. 9
    points = reports.paper_points(exp.paper, exp.figures[0], "top5")
    assert points["ce"]["Berrada 2018, Tab. 1"][0] == (0.0, pytest.approx(0.9434), pytest.approx(0.0009))
    assert points["noised_bal"]["Garcin 2022, Tab. 4"][:2] == [(0.0, pytest.approx(0.9435), None),
                                                               (0.1, pytest.approx(0.9203), None)]
    rows = [{"loss": "ce", "noise_p": p, "seed": s, "top1": 0.5, "top5": 0.8 + 0.01 * s} for p in (0.0, 0.2) for s in (0, 1)]
    path = reports.plot_figure(rows, exp.figures[0], tmp_path / "tab1.png", exp.paper)
    width = int.from_bytes(path.read_bytes()[16:20], "big")                 # PNG header: 2 panels of 5 in at 150 dpi
    # the legend names Berrada 2018, Tab. 1 for CE and L_{5,1} in each of the two panels
    assert width == 1500 and path.with_suffix(".svg").read_text().count("Berrada 2018, Tab. 1 (± its std)") == 4


def test_sawada_fig5_from_the_predictions_along_the_circle(tmp_path):
    name, params = CIRCLES_TRADEOFFS.name, {"experiment": 2, "sigma": 10, "d": 90, "m": None, "minor_ratio": 0.5,
                                            "n_classes": 6, "n_seeds": 2}
    ring = "".join("20" if 100 <= a < 140 else "01" for a in range(360))      # class 2 top-1 from 100° to 140°
    regions = {"angles_deg": [0.5, 359.5, 1.0], "top2": {"ce": [ring, ring], "bayes": [ring]}}
    write_record(cell_dir(tmp_path, name, params) / RECORD, params,
                 {"final": [{"loss": "ce", "seed": s, "top1": 0.5, "top2": 0.9} for s in (0, 1)], "regions": regions},
                 experiment=name)
    md = report(name, tmp_path).read_text()
    assert "## Sawada Fig. 5: predictions for class 2 along the circle" in md and "![Sawada Fig. 5](fig5.png)" in md
    assert (tmp_path / name / "report" / "fig5.svg").read_text().count("ce (2)") == 1


def test_welch_test_matches_the_t_tables():
    assert abs(reports.t_two_sided(2.228, 10) - 0.05) < 2e-5 and abs(reports.t_two_sided(12.706, 1) - 0.05) < 2e-5
    test = reports.welch_test({"mean": 0.7, "std": 0.1, "n": 3}, {"mean": 0.5, "std": 0.0, "n": 3})
    assert (round(test["t"], 4), round(test["df"], 6), round(test["p"], 4)) == (3.4641, 2.0, 0.0742)
    assert reports.verdict({"mean": 0.5, "std": 0.0, "n": 1}, {"mean": 0.1, "std": 0.1, "n": 5}, "best") == ("untested", None)


def test_records_carry_their_identity(tmp_path):
    nb = fake_notebook(tmp_path / "fake.ipynb", WRITE)
    exp = Experiment("fake", str(nb), "fake", presets={"p": {"x": [1, 2]}})
    assert run_grid(exp, "p", out_dir=tmp_path / "runs", progress=False)["ok"] == 2
    ids = sorted((r["identity"]["preset"], r["identity"]["cell"]["x"], r["identity"]["seed"])
                 for r in load_records(tmp_path / "runs"))
    assert ids == [("p", 1, 0), ("p", 2, 0)]


def test_cli_list(capsys):
    assert main(["list"]) == 0
    assert "circles_tradeoffs" in capsys.readouterr().out
    assert batch.get_experiment("circles_tradeoffs").notebook_path().is_file()


# --- the speed entry: Berrada 2018 Tab. 3-4, Garcin 2022 Fig. 3 ----------------------------------------------
def _paper(exp, source):
    return {(pv.row, pv.metric): pv for pv in exp.paper if pv.source == source}


def test_speed_paper_values_are_the_tables():
    tab3, tab4 = _paper(batch.EXPERIMENTS["speed"], "Berrada 2018, Tab. 3"), _paper(batch.EXPERIMENTS["speed"], "Berrada 2018, Tab. 4")
    assert {r: round(pv.value, 6) for (r, _), pv in tab3.items()} == {
        "SA, n = 100": 6.0, "SA, n = 1,000": 62.0, "SA, n = 10,000": 627.0, "SA, n = 100,000": 6258.0,
        "DC, n = 100": 11.0, "DC, n = 1,000": 18.0, "DC, n = 10,000": 24.0, "DC, n = 100,000": 146.0}
    assert {r: round(pv.value, 6) for (r, _), pv in tab4.items()} == {
        "DC (AD), n = 100": 93.0, "DC (AD), n = 1,000": 139.0, "DC (AD), n = 10,000": 194.0,
        "DC (AD), n = 100,000": 287.0, "DC (CB), n = 100": 7.0, "DC (CB), n = 1,000": 6.0, "DC (CB), n = 10,000": 20.0,
        "DC (CB), n = 100,000": 171.0}
    assert all(pv.unit == "ms" and pv.where["part"] == "forward" for pv in tab3.values())
    assert all(pv.where["part"] == "backward" for pv in tab4.values())        # the backward alone, not forward+backward
    fig3 = _paper(batch.EXPERIMENTS["speed"], "Garcin 2022, §4.3 (Fig. 3)")
    assert {(pv.where["k"], pv.where["variant"], pv.metric): pv.value for pv in fig3.values()} == {
        (5, "ce", "epoch_s"): 65.0, (5, "noised_bal (B=3)", "epoch_s"): 68.0, (5, "smooth_svm", "epoch_s"): 81.0,
        (10, "smooth_svm", "epoch_s"): 90.0, (10, "noised_bal (B=3)", "epoch_s"): 60.0,
        (5, "noised_bal (B=3)", "overhead"): 0.046, (5, "smooth_svm", "overhead"): 0.246}


def test_speed_paper_values_name_rows_the_bench_writes():
    from topk_nb.perf.bench import epoch_times, esp_speed
    rows = esp_speed(ns=(100,), k=5, batch=256, repeats=1)
    assert {r["part"] for r in rows} == {"forward", "backward", "forward_backward"}
    for pv in batch.EXPERIMENTS["speed"].paper:
        if pv.where["part"] != "epoch" and pv.where["n"] == 100:        # each value of Tab. 3-4 at n = 100: one row
            assert sum(reports._matches(r, pv.where) for r in rows) == 1, pv
    configs = [{"loss": "ce"}, {"loss": "smooth_svm", "k": 5}, {"loss": "noised_bal", "k": 5, "n_samples": 3}]
    epoch = epoch_times(configs, model="densenet_tiny", batch=4, rounds=1, n_train=8)
    epoch = [{**r, "model": "densenet40_40"} for r in epoch]             # the paper's model, timed as a tiny one
    for pv in batch.EXPERIMENTS["speed"].paper:
        if pv.where["part"] == "epoch" and pv.where["k"] == 5:
            assert sum(reports._matches(r, pv.where) for r in epoch) == 1 and pv.metric in epoch[0], pv


def _speed_rows(seeds=(0, 1)):
    rows = []
    for s in seeds:
        for n, sa, dc, ad, cb in ((100, 5.0, 9.0, 80.0, 6.0), (1000, 60.0, 20.0, 150.0, 7.0)):
            common = {"n": n, "k": 5, "batch": 256, "seed": s}
            rows += [{**common, "part": "forward", "variant": "summation (Alg. 3)", "ms": sa + s},
                     {**common, "part": "forward", "variant": "divide and conquer (Alg. 1)", "ms": dc + s},
                     {**common, "part": "backward", "variant": "autograd", "ms": ad + s},
                     {**common, "part": "backward", "variant": "alg2", "ms": cb + s},
                     {**common, "part": "forward_backward", "variant": "alg2", "ms": dc + cb + s}]
        for k, ce, nb, svm in ((5, 64.0, 69.0, 80.0), (10, None, 61.0, 91.0)):
            common = {"part": "epoch", "model": "densenet40_40", "k": k, "seed": s}
            for v, t in (("ce", ce), ("noised_bal (B=3)", nb), ("smooth_svm", svm)):
                if t is not None:
                    rows.append({**common, "variant": v, "loss": v.split()[0], "epoch_s": t + s,
                                 "overhead": (t + s) / (64.0 + s) - 1})
    return rows


def test_speed_report_judges_the_findings_and_draws_the_tables(tmp_path):
    _fabricate(tmp_path, "speed", {"ns": [100, 1000]}, _speed_rows())
    md = report("speed", tmp_path).read_text()
    # times in ms, not scaled as percentages: SA at n = 100 is 5 and 6 ms over the two seeds
    assert "| Berrada 2018, Tab. 3 | SA, n = 100 | ms (ms) | 6.00 | 5.50 ± 0.71 | 2 | -0.50 |" in md
    assert "| Berrada 2018, Tab. 4 | DC (CB), n = 1,000 | ms (ms) | 6.00 | 7.50 ± 0.71 | 2 | +1.50 |" in md
    assert "| Garcin 2022, §4.3 (Fig. 3) | K = 5, smooth_svm | epoch_s (s) | 81.00 | 80.50 ± 0.71 | 2 | -0.50 |" in md
    assert "| Berrada 2018, Tab. 3 | SA, n = 100,000 | ms (ms) | 6258.00 | n/a | 0 | n/a |" in md
    # SA faster at n = 100, DC at n = 1000, the custom backward faster than autograd (equal spreads: exact)
    assert "| n=100 | ms (ms) | divide and conquer (Alg. 1) best | 9.50 ± 0.71 (2) | summation (Alg. 3): 5.50 ± 0.71 (2) | +4.00 |" in md
    assert "| n=1000 | ms (ms) | summation (Alg. 3) best | 60.50 ± 0.71 (2) | divide and conquer (Alg. 1): 20.50 ± 0.71 (2) | +40.00 |" in md
    assert "| n=1000 | ms (ms) | autograd best | 150.50 ± 0.71 (2) | alg2: 7.50 ± 0.71 (2) | +143.00 |" in md
    assert "| k=10 | epoch_s (s) | smooth_svm best | 91.50 ± 0.71 (2) | noised_bal (B=3): 61.50 ± 0.71 (2) | +30.00 |" in md
    assert "| variant=smooth_svm | epoch_s (s) | 10 best | 91.50 ± 0.71 (2) | 5: 80.50 ± 0.71 (2) | +11.00 |" in md
    assert "| n=10000 | ms (ms) | summation (Alg. 3) best | n/a | n/a | n/a | n/a | n/a | not run |" in md
    svg = (tmp_path / "speed" / "report" / "tab3.svg").read_text()
    assert "summation (Alg. 3): Berrada 2018, Tab. 3" in svg and "ms (ms)" in svg
    assert "alg2: Berrada 2018, Tab. 4" in (tmp_path / "speed" / "report" / "tab4.svg").read_text()
    assert "smooth_svm: Garcin 2022, §4.3 (Fig. 3)" in (tmp_path / "speed" / "report" / "fig3.svg").read_text()
    assert "Berrada" not in (tmp_path / "speed" / "report" / "tab4_forward_backward.svg").read_text()


# --- Sawada: 99 % top-k accuracy with 8 fewer candidates than CE ----------------------------------------------
def test_sawada_candidates_99_paper_values_and_finding(tmp_path):
    exp = batch.EXPERIMENTS["cifar100_transition"]
    pvs = [pv for pv in exp.paper if pv.metric == "candidates_99"]
    assert {(pv.where["loss"], pv.where["augment"], pv.value) for pv in pvs} == {
        ("topk_transition", "cutout", 25.0), ("ce", "cutout", 33.0), ("topk_transition", "mixup", 25.0),
        ("ce", "mixup", 33.0)}
    assert all(pv.where["model"] == "cifar_resnet18" and pv.unit == "candidates" for pv in pvs)
    where = {"model": "cifar_resnet18", "augment": "mixup", "select_metric": "val_top5"}
    for loss, cands in (("ce", (34, 32)), ("topk_transition", (26, 24)), ("topk_grouping", (41, 41))):
        for s, c in enumerate(cands):
            _fabricate(tmp_path, exp.name, {**where, "loss": loss, "seed": s},
                       [{**where, "loss": loss, "seed": s, "top1": 0.7, "top5": 0.9, "candidates_99": c}])
    md = report(exp.name, tmp_path).read_text()
    assert ("| Sawada §V-B and abstract | Cross entropy, ResNet18 (augmentation not named; ours: Mixup), 99 % top-k "
            "accuracy | candidates_99 (candidates) | 33.00 | 33.00 ± 1.41 | 2 | +0.00 |") in md
    # CE needs 8 more candidates than the transition loss (the grouping loss, 41, is not the claim's competitor)
    assert ("| select_metric=val_top5 | candidates_99 (candidates) | ce best | 33.00 ± 1.41 (2) | topk_transition: "
            "25.00 ± 1.41 (2) | +8.00 | 5.66 (2.0) | 0.030 | holds |") in md


# --- level sets: Garcin 2022 Fig. 4 (B) and Fig. 5 (ε) sweeps --------------------------------------------------
def test_level_set_sweeps_draw_and_judge(tmp_path):
    exp = batch.EXPERIMENTS["level_sets"]
    assert exp.presets["fig4"]["sweep_samples"] == [[1, 3, 10, 50]] and exp.presets["fig5"]["sweep_epsilons"]
    params = {"k": 1, "panels": ["cal_hinge"], "resolution": 10, "replications": 20, "sweep_samples": [1, 50],
              "sweep_epsilons": [0.01, 10.0]}
    for seed in (0, 1, 2):                                  # three seeds, as the presets: two leave one df
        rec = batch.run_cell(exp.notebook_path(), {**params, "seed": seed}, tmp_path / "runs" / exp.name / f"s{seed}",
                             experiment=exp.name)
        assert rec["status"] == "ok", rec.get("error")
        assert sorted(rec["metrics"]["sweep_figures"]) == ["fig4", "fig5"]
        assert (tmp_path / "runs" / exp.name / f"s{seed}" / "level_sets_fig5_K1.png").is_file()
    md = report(exp, tmp_path / "runs").read_text()
    # ε = 10 (reference of the first claim) is farther from the calibrated hinge than ε = 0.01, and B = 1 noisier than 50
    assert "| k=1 | gap_cal_hinge (loss) | 10.0 best |" in md and "| k=1 | mc_error (loss) | 1 best |" in md
    lines = [l for l in md.splitlines() if "| k=1 | gap_cal_hinge" in l or "| k=1 | mc_error" in l]
    assert len(lines) == 3 and all(l.endswith("| holds |") for l in lines), lines
    assert "| k=2 | mc_error (loss) | 1 best | n/a |" in md                        # K = 2 not run
    # the main panels' claim does not see the sweep rows (only cal_hinge ran: no competitor, not run)
    assert "| k=1 | zero_share | smooth_svm not_best | n/a |" in md
    assert (tmp_path / "runs" / exp.name / "report" / "fig4.svg").read_text().count("mc_error (loss)") == 1


# --- the catalogue is the experiments' notebooks ---------------------------------------------------------------
def test_the_catalogue_is_one_entry_per_experiment_notebook():
    notebooks = Path(__file__).resolve().parent.parent / "nbs" / "experiments"
    assert sorted(batch.EXPERIMENTS) == sorted(p.stem for p in notebooks.glob("*.ipynb"))
    for name, exp in batch.EXPERIMENTS.items():
        assert exp.notebook == f"{name}.ipynb" and exp.notebook_path().is_file()
        assert importlib.import_module(f"topk_nb.experiments.{name}").ENTRY is exp


def test_a_new_experiment_module_is_discovered(tmp_path, monkeypatch):
    pkg = tmp_path / "more_experiments"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny.py").write_text("from topk_nb.base.catalogue import Experiment, Finding\n"
                                 "ENTRY = Experiment('tiny', 'tiny.ipynb', 'a tiny experiment', presets={'smoke': {'x': 2}},\n"
                                 "                   findings=(Finding('Some 2020, Fig. 1', 'a claim', {}, 'x', (2,), 'y', 'best'),))\n")
    (pkg / "helpers.py").write_text("SHARED = 1\n")               # a module without an entry is left out
    monkeypatch.syspath_prepend(str(tmp_path))
    found = batch.discover_experiments("more_experiments")
    assert list(found) == ["tiny"] and found["tiny"].presets == {"smoke": {"x": 2}}
    (pkg / "misnamed.py").write_text("from topk_nb.base.catalogue import Experiment\nENTRY = Experiment('other', 'o.ipynb', 'o')\n")
    with pytest.raises(ValueError, match="must be an Experiment named 'misnamed'"):
        batch.discover_experiments("more_experiments")


@pytest.mark.parametrize("name", sorted(batch.EXPERIMENTS))
def test_every_preset_sets_only_notebook_parameters(name):
    exp = batch.EXPERIMENTS[name]
    for preset in exp.presets:
        batch.check_parameters(exp, preset)


def test_a_preset_key_that_is_no_parameter_fails_before_anything_runs(tmp_path, capsys):
    nb = fake_notebook(tmp_path / "fake.ipynb", WRITE)
    typo = Experiment("typo", str(nb), "a typo", presets={"smoke": [{"x": 1}, {"xx": [1, 2]}]})
    with pytest.raises(ValueError) as err:
        run_grid(typo, "smoke", out_dir=tmp_path / "runs", progress=False)
    assert str(err.value) == ("preset 'smoke' of typo sets 'xx', which is not a parameter of fake.ipynb; "
                              "its parameters: seed, x")
    assert not (tmp_path / "runs").exists()
    assert main(["run", str(nb), "--grid", "y=1", "--out", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "topk-nb run: error: --grid y=...: 'y' is not a parameter of fake.ipynb; its parameters: seed, x"]
    assert not (tmp_path / "runs").exists()
