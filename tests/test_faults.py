"""Fault tests: runners racing on one folder, runners and jobs killed at random instants, damaged checkpoints,
records and data files, and mistakes on every command line. Each test states what must hold afterwards."""
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import redirect_stderr
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from topk_nb.runner import batch, cli; from topk_nb.training import loop as train
from topk_nb.runner.batch import EXECUTED, RECORD, cell_done, load_records, read_record
from topk_nb.training.data import fake_cifar100
from topk_nb.training.loop import CheckpointError, atomic_write, fit, load_checkpoint, previous_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
LEFTOVERS = (".record.*.json", ".notebook.*.ipynb", "*.tmp")


def counting_notebook(folder: Path) -> Path:
    """An experiment notebook without torch (fast to start) that appends `x` to executions.txt, sleeps `sleep`
    seconds and writes its record."""
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("x = 1\nseed = 0\nsleep = 0.0\nrecord_path = None")
    params.metadata["tags"] = ["parameters"]
    log = str(folder / "executions.txt")
    nb.cells = [params, nbformat.v4.new_code_cell(
        f"import json, os, time\nwith open({log!r}, 'a') as f: f.write(f'{{x}}\\n')\ntime.sleep(sleep)\n"
        "rec = {'status': 'ok', 'params': {'x': x, 'seed': seed, 'sleep': sleep}, 'metrics': {'final': [{'y': 10 * x}]}}\n"
        "with open(record_path + '.tmp', 'w') as f: json.dump(rec, f)\n"
        "os.replace(record_path + '.tmp', record_path)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(folder / "count.ipynb"))
    return folder / "count.ipynb"


def runner(nb: Path, out: Path, xs, sleep: float, *extra) -> list[str]:
    return [sys.executable, "-m", "topk_nb.runner.cli", "run", str(nb), "--grid", "x=" + ",".join(map(str, xs)),
            f"sleep={sleep}", "--out", str(out), "--no-progress", *extra]


def executions(folder: Path) -> Counter:
    path = folder / "executions.txt"
    return Counter(int(x) for x in path.read_text().split()) if path.exists() else Counter()


def check_all_done(out: Path, xs) -> list[dict]:
    "Every cell of `xs` done exactly once: one ok record each, its notebook final, nothing of an attempt left."
    records = load_records(out, status=None)
    assert sorted(r["params"]["x"] for r in records) == sorted(xs), records
    assert all(r["status"] == "ok" and r["metrics"]["final"][0]["y"] == 10 * r["params"]["x"] for r in records)
    assert all(cell_done(Path(r["path"]).parent) for r in records)
    assert len(list(out.rglob(RECORD))) == len(xs)
    assert [p for pattern in LEFTOVERS for p in out.rglob(pattern)] == []
    return records


def processes_in(folder: Path) -> list[int]:
    "Live processes started for `folder`: command line naming it (runner, jobs) or working directory in it (kernels)."
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid(): continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
            state = next(l for l in (proc / "status").read_text().splitlines() if l.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "Z" not in state.split()[1] and (str(folder) in cmd or cwd.startswith(str(folder))):
            found.append(int(proc.name))
    return found


def job_processes(folder: Path) -> list[int]:
    "The live job processes (`python -c <launcher importing topk_nb.runner.batch> job SPEC`) started for `folder`."
    def is_job(pid):
        try: cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError: return False
        return b"topk_nb.runner.batch" in cmdline and b"\0job\0" in cmdline
    return [pid for pid in processes_in(folder) if is_job(pid)]


def wait_gone(folder: Path, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := processes_in(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# --- two runners on one --out ------------------------------------------------------------------------------------
def test_two_runners_on_one_out_run_each_cell_once(tmp_path):
    nb, out, xs = counting_notebook(tmp_path), tmp_path / "runs", range(1, 7)
    procs = [subprocess.Popen(runner(nb, out, xs, 0.3, "--jobs", "2"), env=ENV, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    for (stdout, stderr), code in results:
        summary = json.loads(stdout.splitlines()[-1])
        assert code == 0 and summary["total"] == 6 and summary["skipped"] + summary["ok"] == 6, (stdout, stderr)
        assert summary["failed"] == summary["missing"] == 0
    check_all_done(out, xs)
    assert executions(tmp_path) == Counter({x: 1 for x in xs})     # no cell executed twice


# --- kills at random instants --------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["runner", "group"])
@pytest.mark.parametrize("seed", [6, 5, 9])              # the kill after 0, 2 and 3 cells began (see below)
def test_kill_at_a_random_instant_then_rerun(tmp_path, target, seed):
    nb, out, xs = counting_notebook(tmp_path), tmp_path / "runs", range(1, 5)
    cmd = runner(nb, out, xs, 1.0, "--jobs", "2")
    proc = subprocess.Popen(cmd, env=ENV, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # a random instant of the run, whatever the machine's speed: once `began` of the 4 cells have begun, up to a second on
    rng = random.Random(seed)
    began, delay = rng.randrange(4), rng.uniform(0.0, 1.0)
    deadline = time.monotonic() + 120
    while sum(executions(tmp_path).values()) < began and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(delay)
    if target == "runner": os.kill(proc.pid, signal.SIGKILL)        # the runner alone: its jobs must die with it
    else: os.killpg(proc.pid, signal.SIGKILL)                       # the runner and its jobs at once
    proc.wait()
    deadline = time.monotonic() + 1.0                               # jobs die at once with their runner ...
    while job_processes(tmp_path) and time.monotonic() < deadline: time.sleep(0.05)
    assert job_processes(tmp_path) == []
    assert wait_gone(tmp_path) == []                                # ... and their kernels within a second or two
    done_before = [x for x in xs if cell_done(batch.cell_dir(out, "count", {"x": x, "sleep": 1.0}))]
    for path in out.rglob(RECORD):                                  # whatever exists is complete JSON
        json.loads(path.read_text())
    rerun = subprocess.run(cmd, env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    summary = json.loads(rerun.stdout.splitlines()[-1])
    assert rerun.returncode == 0, rerun.stderr
    assert summary == {"total": 4, "skipped": len(done_before), "ok": 4 - len(done_before), "failed": 0, "missing": 0}
    check_all_done(out, xs)
    assert set(executions(tmp_path)) == set(xs)


def signal_the_job(tmp_path: Path, signum: int) -> tuple[Path, Path, subprocess.Popen, str, str]:
    "Run one cell of 30 s, send `signum` to its job process alone once the kernel is in the cell; (notebook, out, the runner's process, stdout, stderr)."
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    proc = subprocess.Popen(runner(nb, out, [1], 30), env=ENV, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not executions(tmp_path) and time.monotonic() < deadline: time.sleep(0.1)   # the kernel is in the cell
    jobs = job_processes(tmp_path)
    assert len(jobs) == 1
    os.kill(jobs[0], signum)
    stdout, stderr = proc.communicate(timeout=60)
    return nb, out, proc, stdout, stderr


def test_a_job_killed_alone_gets_a_failed_record_and_the_summary_says_so(tmp_path):
    nb, out, proc, stdout, stderr = signal_the_job(tmp_path, signal.SIGKILL)
    assert proc.returncode == 1
    assert json.loads(stdout.splitlines()[-1]) == {"total": 1, "skipped": 0, "ok": 0, "failed": 1, "missing": 0}
    rec, = load_records(out, status=None)
    assert rec["status"] == "failed" and "the job process was killed by SIGKILL without a record" in rec["error"]
    assert "not done: " in stderr and wait_gone(tmp_path) == []


def test_a_job_stopped_alone_by_a_signal_leaves_its_cell_to_run_again(tmp_path):
    # scancel and Ctrl-C signal every process at once, and the job process may end on its signal before the runner has
    # seen its own: as here, where only the job gets SIGTERM. It cleaned up (128 + the signal): no failed record, the
    # cell is missing, and the next run does it
    nb, out, proc, stdout, stderr = signal_the_job(tmp_path, signal.SIGTERM)
    assert json.loads(stdout.splitlines()[-1]) == {"total": 1, "skipped": 0, "ok": 0, "failed": 0, "missing": 1}, stderr
    assert proc.returncode != 0 and load_records(out, status=None) == [] and wait_gone(tmp_path) == []
    assert [p for pattern in LEFTOVERS for p in out.rglob(pattern)] == []
    done = subprocess.run(runner(nb, out, [1], 0), env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check_all_done(out, [1])


def test_a_kill_between_notebook_and_record_is_not_done(tmp_path):
    nb, out, xs = counting_notebook(tmp_path), tmp_path / "runs", [1, 2, 3, 4]
    assert batch.run_grid(str(nb), grid={"x": xs}, out_dir=out, jobs=2, progress=False)["ok"] == 4
    cell = {x: batch.cell_dir(out, "count", {"x": x}) for x in xs}
    # 1: an ok record beside a notebook papermill had not finished (what writing the record first allowed)
    executed = json.loads((cell[1] / EXECUTED).read_text())
    executed["metadata"]["papermill"]["end_time"] = None
    (cell[1] / EXECUTED).write_text(json.dumps(executed))
    # 2: killed between the two renames: the notebook is final, the record still under its attempt's name
    (cell[2] / RECORD).rename(cell[2] / ".record.4242-0a1b2c3d.json")
    # 3: an ok record and no notebook at all
    (cell[3] / EXECUTED).unlink()
    assert [cell_done(cell[x]) for x in xs] == [False, False, False, True]
    summary = batch.run_grid(str(nb), grid={"x": xs}, out_dir=out, jobs=2, progress=False)
    assert {k: summary[k] for k in ("skipped", "ok", "failed", "missing")} == {"skipped": 1, "ok": 3, "failed": 0, "missing": 0}
    check_all_done(out, xs)
    assert executions(tmp_path) == Counter({1: 2, 2: 2, 3: 2, 4: 1})


def test_no_record_is_deleted_or_overwritten_by_a_process_that_does_not_own_its_cell(tmp_path):
    nb = counting_notebook(tmp_path)
    cell = tmp_path / "cell"
    batch.write_record(cell / RECORD, {"x": 1}, status="failed", error="an earlier attempt")
    with batch.claim_cell(cell):                                   # another process is on it
        with pytest.raises(batch.CellBusy, match="is being run by pid"):
            batch.run_cell(nb, {"x": 1}, cell)
        assert read_record(cell / RECORD)["error"] == "an earlier attempt"
    assert batch.run_cell(nb, {"x": 1}, cell)["status"] == "ok"    # free again: retried and replaced by its owner


# --- checkpoints ----------------------------------------------------------------------------------------------------
def _damaged(good: bytes, weight: torch.Tensor) -> dict[str, bytes]:
    at = good.rindex(weight.numpy().tobytes()) + 3
    return {"bit flip in a weight": good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1:],
            "truncated": good[:-100], "empty": b"", "random bytes": random.Random(0).randbytes(4096)}


@pytest.mark.parametrize("damage, expected", [
    ("bit flip in a weight", "the data does not match the SHA-256 in the header (the file is corrupt)"),
    ("truncated", "the file is truncated or has extra bytes"),
    ("empty", "the file is empty"),
    ("random bytes", "not a checkpoint written by save_checkpoint"),
])
def test_a_damaged_checkpoint_is_refused_with_a_clear_error(tmp_path, damage, expected):
    path, weight = tmp_path / "checkpoint.pt", torch.linspace(-1, 1, 64)
    save_checkpoint({"epoch": 1, "w": weight}, path)
    save_checkpoint({"epoch": 2, "w": weight * 2}, path)
    path.write_bytes(_damaged(path.read_bytes(), weight * 2)[damage])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path}: {expected}") and "\n" not in message
    assert f"delete it to start the run over, or put the previous checkpoint in its place " \
           f"(mv {previous_checkpoint(path)} {path})" in message
    assert "weights_only=False" not in message and info.value.__cause__ is None
    os.replace(previous_checkpoint(path), path)                     # the way out the message gives
    assert load_checkpoint(path)["epoch"] == 1


def _blobs(n):
    g = torch.Generator().manual_seed(n)
    y = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(3 * torch.eye(3)[y] + torch.randn(n, 3, generator=g), y)


def _fit(out_dir, epochs):
    torch.manual_seed(0)
    return fit(nn.Linear(3, 3), nn.CrossEntropyLoss(), _blobs(48), _blobs(24), None, epochs=epochs, batch_size=16,
               ks=(1, 2), progress=False, out_dir=str(out_dir))


def test_resume_refuses_a_damaged_checkpoint_and_removes_temporary_files(tmp_path):
    torch.set_num_threads(1)
    ref = _fit(tmp_path / "ref", 3)
    _fit(tmp_path / "run", 2)
    ckpt = tmp_path / "run" / "checkpoint.pt"
    good = ckpt.read_bytes()
    ckpt.write_bytes(good[:len(good) // 3])
    with pytest.raises(CheckpointError, match="truncated"):
        _fit(tmp_path / "run", 3)
    ckpt.write_bytes(good)
    (tmp_path / "run" / ".checkpoint.pt.4b1d2e.tmp").write_bytes(good[:100])   # a save killed half-way
    res = _fit(tmp_path / "run", 3)
    assert res["resumed_from"] == 2 and not list((tmp_path / "run").glob("*.tmp"))
    strip = lambda h: [{k: v for k, v in r.items() if k != "time_s"} for r in h]
    assert strip(res["history"]) == strip(ref["history"])


def test_atomic_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        for name, mask in (("a", 0o022), ("b", 0o077), ("c", 0o002)):
            os.umask(mask)
            path = atomic_write(tmp_path / name, lambda f: f.write(b"x"))
            assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    finally:
        os.umask(old)


def test_one_fsync_makes_both_a_file_and_a_folder_durable(tmp_path, monkeypatch):
    # the atomic writes and the runner's renames of a cell's results share `fsync_path`: the file's data and the
    # folder's entries are each flushed, seen by the inode each fsync gets
    from topk_nb.base.files import fsync_path
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    data = tmp_path / "data.bin"
    data.write_bytes(b"x")
    fsync_path(data)
    fsync_path(tmp_path)
    fsync_path(tmp_path / "missing")                        # nothing to open: nothing to flush, and no error
    assert synced == [data.stat().st_ino, tmp_path.stat().st_ino]
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / ".notebook.1.ipynb").write_text("{}")
    batch.write_record(cell / ".record.1.json", {"x": 1}, {"final": [{"y": 1}]})
    executed = (cell / ".notebook.1.ipynb").stat().st_ino
    synced.clear()
    batch._publish(cell, cell / ".record.1.json", cell / ".notebook.1.ipynb")
    assert synced.count(cell.stat().st_ino) >= 2 and executed in synced   # the notebook, then the folder after each rename
    assert read_record(cell / RECORD)["params"] == {"x": 1} and (cell / EXECUTED).stat().st_ino == executed


# --- the report -------------------------------------------------------------------------------------------------------
def _report(*words):
    return subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "report", *words], env=ENV, capture_output=True,
                          text=True, timeout=120)


def test_report_names_unreadable_records_and_refuses_a_missing_out(tmp_path):
    out = tmp_path / "runs"
    params = {"experiment": 1, "sigma": 10, "n_seeds": 1}
    batch.write_record(batch.cell_dir(out, "circles_tradeoffs", params) / RECORD, params,
                       {"final": [{"loss": "ce", "seed": 0, "top1": 0.5, "top2": 0.8}]}, experiment="circles_tradeoffs")
    cut = batch.cell_dir(out, "circles_tradeoffs", {**params, "sigma": 15}) / RECORD
    cut.parent.mkdir(parents=True)
    cut.write_text(json.dumps({"status": "ok", "params": {**params, "sigma": 15}})[:30])
    done = _report("circles_tradeoffs", "--out", str(out))
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("topk-nb report: error: 1 unreadable record(s)") and f"{cut}: not complete JSON" in done.stderr
    md = (out / "circles_tradeoffs" / "report" / "report.md").read_text()
    assert "1 successful records, 0 failed, 1 unreadable" in md and f"| {cut} | not complete JSON" in md
    (tmp_path / "empty").mkdir()
    for folder, expected in ((tmp_path / "nowhere", "is not a directory"), (tmp_path / "empty", "no records of")):
        res = _report("circles_tradeoffs", "--out", str(folder))
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and expected in res.stderr, res.stderr
        assert not (folder / "circles_tradeoffs").exists()


# --- command-line mistakes: one line, exit status 2, nothing run -----------------------------------------------------
@pytest.mark.parametrize("words, expected", [
    (["--jobs", "0"], "argument --jobs: must be a positive integer, got '0'"),
    (["--jobs", "-3"], "argument --jobs: must be a positive integer, got '-3'"),
    (["--grid", "sigma=10,,20"], "--grid 'sigma=10,,20' has an empty value"),
    (["--grid", "sigma"], "--grid expects key=v1,v2"),
    (["--grid", "sigmaa=10"], "'sigmaa' is not a parameter of circles_tradeoffs.ipynb"),
    (["--preset", "nope"], "unknown preset 'nope' of circles_tradeoffs"),
    (["--seeds", "-1"], "argument --seeds: must be a positive integer"),
    (["--timeout", "0"], "argument --timeout: must be a positive number"),
    (["--data-root", "/nowhere/at/all"], "data_root='/nowhere/at/all' is not a directory"),
    (["--preset", "paper", "--jobs", "2", "--bogus"], "unrecognized arguments: --bogus"),
    (["--grid", "sigma=abc"], "--grid sigma=abc: sigma takes a number (its default in circles_tradeoffs.ipynb is"),
    (["--grid", "epochs=2.5"], "--grid epochs=2.5: epochs takes an integer"),
])
def test_runner_mistakes_stop_before_anything_runs(tmp_path, words, expected):
    res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "run", "circles_tradeoffs", "--out",
                          str(tmp_path / "runs"), *words], env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(("topk-nb run: error: ", "topk-nb: error: ")) and expected in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()


def test_a_data_root_without_the_data_set_stops_before_anything_runs(tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "run", "cifar100_noise", "--preset", "paper",
                          "--data-root", str(empty), "--out", str(tmp_path / "runs")],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res
    assert "holds no cifar100 data set (cifar-100-python/train not found)" in res.stderr, res.stderr
    assert not (tmp_path / "runs").exists()


def test_a_missing_weights_file_stops_the_paper_preset_before_anything_runs(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    missing = tmp_path / "resnet50_imagenet.pt"
    res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "run", "plantnet_imbalanced", "--preset", "paper",
                          "--data-root", str(data), "--grid", f"weights={missing}", "--out", str(tmp_path / "runs")],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res
    assert res.stderr.startswith(f"topk-nb run: error: --grid weights={missing}: the weights file '{missing}' does not exist; "
                                 "save the model's weights once with torch.save(model.state_dict(), path)"), res.stderr
    assert not (tmp_path / "runs").exists()


def test_an_out_that_cannot_be_written_stops_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("")
    res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "run", "circles_tradeoffs", "--out",
                          str(tmp_path / "file" / "runs")], env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res
    assert "is not a folder this process can write to" in res.stderr, res.stderr


def test_list_name_shows_the_parameters_and_the_presets_values():
    res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "list", "imagenet_lt"], env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res
    assert "parameters (their defaults are a CPU smoke run): " in res.stdout and "milestones=[60, 80]" in res.stdout
    assert "preset paper: 60 cells (needs --data-root)" in res.stdout and "milestones=[60, 80]" in res.stdout.split("preset paper")[1]
    bad = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "list", "nope"], env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown experiment 'nope'" in bad.stderr, bad


def test_help_describes_every_option():
    for command in ("run", "status", "report", "list"):
        res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", command, "--help"], env=ENV, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res
        parser = cli._parser()._subparsers._group_actions[0].choices[command]
        for action in parser._actions:
            assert action.help, (command, action.dest)          # each option and argument says what it does
            assert any(opt in res.stdout for opt in action.option_strings or [action.dest]), (command, action.dest)


def _train_cli(*words) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        code = train.main(list(words))
    return code, err.getvalue()


@pytest.fixture(scope="module")
def broken_cifar(tmp_path_factory):
    root = fake_cifar100(tmp_path_factory.mktemp("cifar"), n_train=200, n_test=50)
    (root / "cifar-100-python" / "train").write_bytes(b"not a pickle at all")
    return root


TRAIN_OK = ["dataset=circles", 'dataset_params={"n_per_class": 4, "n_test_per_class": 4}', "model=circle_linear",
            "loss=ce", "ks=[1]", "progress=false"]


@pytest.mark.parametrize("words, expected", [
    (["dataset=nope"], "unknown dataset 'nope'; valid names: cifar100"),
    (["model=nope"], "unknown model 'nope'; valid names:"),
    (["loss=nope"], "unknown loss 'nope'; valid names:"),
    (["learning_rate=0.1"], "unknown training option(s) learning_rate"),
    (["epochs=-1"], "epochs must be an integer in [1, inf], got -1"),
    (["epochs"], "'epochs' is neither key=value nor a JSON file"),
    (["=3"], "'=3' has no key before '='"),
    (["dataset=cifar100", "dataset_params=CIFAR"], "cifar-100-python/train is not a CIFAR-100 python pickle (UnpicklingError"),
    (["dataset=cifar100", "dataset_params=CIFAR_MD5"], "do not match the official checksums"),
    (["out_dir=CKPT"], "the file is empty"),
])
def test_training_mistakes_are_one_line_and_status_2(tmp_path, broken_cifar, words, expected):
    cifar = {"root": str(broken_cifar), "check_md5": False, "val_size": 10}
    subst = {"dataset_params=CIFAR": "dataset_params=" + json.dumps(cifar),
             "dataset_params=CIFAR_MD5": "dataset_params=" + json.dumps({**cifar, "check_md5": True}),
             "out_dir=CKPT": f"out_dir={tmp_path}"}
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    words = [subst.get(w, w) for w in words]
    keys = {w.split("=", 1)[0] for w in words}
    code, err = _train_cli(*[w for w in TRAIN_OK if w.split("=", 1)[0] not in keys], *words)
    assert code == 2 and err.count("\n") == 1 and err.startswith("topk_nb.training.loop: error: ") and expected in err, err


def test_training_command_exit_status(tmp_path):
    res = subprocess.run([sys.executable, "-m", "topk_nb.training.loop", *TRAIN_OK, "epochs=0"], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert (res.returncode, res.stdout) == (2, "") and res.stderr == \
        "topk_nb.training.loop: error: epochs must be an integer in [1, inf], got 0\n"


def test_list_into_a_closed_pipe_is_quiet():
    # `topk-nb list | head -1`: the reader goes away before the listing is written; no traceback
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "list"], stdout=write, stderr=subprocess.PIPE,
                             env=ENV, text=True, timeout=120)
    finally:
        os.close(write)
    assert res.returncode == 0 and res.stderr == "", res.stderr


# --- interrupts -------------------------------------------------------------------------------------------------------
def leftovers(out: Path) -> list[Path]:
    return [p for pattern in LEFTOVERS for p in out.rglob(pattern)]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_one_signal_stops_the_run_at_once_with_a_summary(tmp_path, signum):
    # one Ctrl-C (SIGINT to the runner's process group), or SIGTERM to the runner alone, during cell 2 of 4
    nb, out, xs = counting_notebook(tmp_path), tmp_path / "runs", [1, 2, 3, 4]
    proc = subprocess.Popen(runner(nb, out, xs, 2.0, "--jobs", "1"), env=ENV, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while sum(executions(tmp_path).values()) < 2 and time.monotonic() < deadline: time.sleep(0.05)
    assert executions(tmp_path) == Counter({1: 1, 2: 1})              # cell 2 is in its notebook
    if signum == signal.SIGINT: os.killpg(proc.pid, signum)
    else: os.kill(proc.pid, signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, (stdout, stderr)
    assert "Traceback" not in stderr and f"topk-nb run: stopped: interrupted by {signum.name}; 3 of 4 cells not done" in stderr
    summary = json.loads(stdout.splitlines()[-1])
    assert summary == {"total": 4, "skipped": 0, "ok": 1, "failed": 0, "missing": 3,
                       "stopped": f"interrupted by {signum.name}"}
    assert executions(tmp_path) == Counter({1: 1, 2: 1})              # no cell started after the signal
    records = load_records(out, status=None)                          # nothing false: cell 1 ok, no failed record
    assert [(r["params"]["x"], r["status"]) for r in records] == [(1, "ok")]
    assert leftovers(out) == [] and wait_gone(tmp_path) == []
    assert [x for x in xs if cell_done(batch.cell_dir(out, "count", {"x": x, "sleep": 2.0}))] == [1]


def _console_script() -> str:
    "The code of the `topk-nb` console script that the package declares (settings.ini), as pip writes it."
    line = next(l for l in (ROOT / "settings.ini").read_text().splitlines() if l.startswith("console_scripts"))
    module, func = line.split("topk-nb=")[1].split()[0].split(":")
    return f"import sys; from {module} import {func}; sys.exit({func}())"


def _catches(pid: int, signum: int) -> bool:
    "Whether the process `pid` has a handler of its own for `signum` (SigCgt of /proc/PID/status)."
    try: text = Path(f"/proc/{pid}/status").read_text()
    except OSError: return False
    caught = int(next(l for l in text.splitlines() if l.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signum - 1) & 1)


# the package's import made slow (as a cold disk or a loaded machine makes it): it stalls at the import of topk_nb.runner.cli
SLOW_IMPORT = """import sys, time
class _SlowImport:
    def find_spec(self, name, path=None, target=None):
        if name == "topk_nb.runner.cli": time.sleep(60)
        return None
sys.meta_path.insert(0, _SlowImport())
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_while_the_command_starts_is_one_line_and_128_plus_the_signal(tmp_path, signum):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SLOW_IMPORT)
    proc = subprocess.Popen([sys.executable, "-c", _console_script(), "list"], env={**ENV, "PYTHONPATH": f"{shim}{os.pathsep}{ROOT}"},
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.monotonic() < deadline: time.sleep(0.001)
    caught = _catches(proc.pid, signal.SIGTERM)
    proc.send_signal(signum)                                            # the package is still being imported
    stdout, stderr = proc.communicate(timeout=60)
    assert caught, "the console script installs no SIGTERM handler before it imports the package"
    assert (proc.returncode, stdout, stderr) == (128 + signum, "", f"topk-nb: interrupted by {signum.name}\n"), stderr


# --- a full disk ------------------------------------------------------------------------------------------------------
FULL_DISK = """import errno, os
_flag, _fsync = os.environ.get("FULL_DISK_FLAG"), os.fsync
def _full_fsync(fd):
    if _flag and os.path.exists(_flag):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _fsync(fd)
os.fsync = _full_fsync
"""


def test_a_full_disk_stops_the_run_with_a_summary_and_keeps_finished_records(tmp_path):
    # every process of the run (runner, jobs) gets ENOSPC from fsync once the flag file exists: the disk is full
    shim, flag = tmp_path / "shim", tmp_path / "disk-is-full"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(FULL_DISK)
    env = {**ENV, "PYTHONPATH": f"{shim}{os.pathsep}{ROOT}", "FULL_DISK_FLAG": str(flag)}
    nb, out, xs = counting_notebook(tmp_path), tmp_path / "runs", [1, 2, 3]
    cmd = runner(nb, out, xs, 1.5, "--jobs", "1")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while sum(executions(tmp_path).values()) < 2 and time.monotonic() < deadline: time.sleep(0.05)
    first = (batch.cell_dir(out, "count", {"x": 1, "sleep": 1.5}) / RECORD).read_bytes()
    flag.write_text("")                                                # cell 2 is running: the disk fills up
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
    assert "topk-nb run: stopped: no space left on the device of" in stderr and "free some space, then run the same command again" in stderr
    assert json.loads(stdout.splitlines()[-1])["stopped"].startswith("no space left on the device of")
    assert executions(tmp_path) == Counter({1: 1, 2: 1})              # cell 3 not attempted
    records = load_records(out, status=None)
    assert [(r["params"]["x"], r["status"]) for r in records] == [(1, "ok")]
    assert (Path(records[0]["path"])).read_bytes() == first and leftovers(out) == []
    flag.unlink()                                                      # space again: the same command finishes the grid
    rerun = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    check_all_done(out, xs)


# --- links in a shared --out ------------------------------------------------------------------------------------------
@pytest.fixture
def short_tmp():
    "A fresh folder with a short path: a line of the runner keeps at most 200 characters, which a line naming a cell under pytest's deep temporary folders (pytest-xdist's are deeper still) can pass."
    import tempfile
    path = Path(tempfile.mkdtemp(prefix="topk-nb-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_links_in_cell_folders_are_never_followed(short_tmp):
    tmp_path = short_tmp
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    precious, elsewhere = tmp_path / "precious.txt", tmp_path / "elsewhere"
    precious.write_text("keep me")
    elsewhere.mkdir()
    cell = {x: batch.cell_dir(out, "count", {"x": x, "sleep": 0.0}) for x in (1, 2, 3, 4)}
    cell[1].mkdir(parents=True)
    (cell[1] / ".lock").symlink_to(precious)
    (cell[2].parent / cell[2].name).symlink_to(elsewhere, target_is_directory=True)
    cell[3].mkdir()
    (cell[3] / "job.log").symlink_to(precious)
    res = subprocess.run(runner(nb, out, [1, 2, 3, 4], 0.0), env=ENV, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == {"total": 4, "skipped": 0, "ok": 1, "failed": 0, "missing": 3}
    for x, link in ((1, cell[1] / ".lock"), (2, cell[2]), (3, cell[3] / "job.log")):
        assert f"not done: {json.dumps({'x': x, 'sleep': 0.0})}: not run: {link} is a symbolic link, which the runner does not follow" in res.stderr
    assert precious.read_text() == "keep me" and list(elsewhere.iterdir()) == []
    assert executions(tmp_path) == Counter({4: 1})
    (cell[4] / RECORD).rename(tmp_path / "moved.json")                 # a record that is a link is not read
    (cell[4] / RECORD).symlink_to(tmp_path / "moved.json")
    assert not cell_done(cell[4])
    with pytest.raises(batch.RecordError, match="is a symbolic link, which the runner never writes"):
        load_records(out)


def test_a_done_cell_with_a_link_beside_a_new_cell_is_counted_once(tmp_path):
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    assert batch.run_grid(str(nb), grid={"x": [1], "sleep": [0.0]}, out_dir=out, progress=False)["ok"] == 1
    done = batch.cell_dir(out, "count", {"x": 1, "sleep": 0.0})
    (done / "job.log").unlink()
    (done / "job.log").symlink_to(tmp_path / "elsewhere.txt")
    assert batch.pending_cells(batch.get_experiment(str(nb)), [{"x": 1, "sleep": 0.0}], out) == [{"x": 1, "sleep": 0.0}]
    res = subprocess.run(runner(nb, out, [1, 2], 0.0), env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary == {"total": 2, "skipped": 0, "ok": 1, "failed": 0, "missing": 1}, res.stderr
    assert f"not run: {done / 'job.log'} is a symbolic link" in res.stderr and res.returncode == 1, res.stderr
    assert executions(tmp_path) == Counter({1: 1, 2: 1}) and not (tmp_path / "elsewhere.txt").exists()


def test_hard_links_in_a_cell_folder_are_never_written_through(short_tmp):
    tmp_path = short_tmp
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    cell = {x: batch.cell_dir(out, "count", {"x": x, "sleep": 0.0}) for x in (1, 2)}
    for x, name in ((1, ".lock"), (2, "job.log")):
        (tmp_path / f"precious-{x}.txt").write_text("keep me")
        cell[x].mkdir(parents=True)
        os.link(tmp_path / f"precious-{x}.txt", cell[x] / name)
    res = subprocess.run(runner(nb, out, [1, 2], 0.0), env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert [(tmp_path / f"precious-{x}.txt").read_text() for x in (1, 2)] == ["keep me"] * 2
    assert json.loads(res.stdout.splitlines()[-1]) == {"total": 2, "skipped": 0, "ok": 1, "failed": 0, "missing": 1}, res.stderr
    assert (f"not done: {json.dumps({'x': 1, 'sleep': 0.0})}: not run: {cell[1] / '.lock'} is a hard link (one of 2 names "
            "of one file), which the runner does not write through") in res.stderr, res.stderr
    assert executions(tmp_path) == Counter({2: 1}) and cell_done(cell[2])
    assert os.stat(cell[2] / "job.log").st_nlink == 1                       # a job.log of its own, the other name untouched


def test_a_link_at_the_slurm_ledger_lock_is_refused_and_nothing_is_made_through_it(tmp_path, monkeypatch):
    from topk_nb.runner import slurm
    monkeypatch.setattr(slurm, "slurm_available", lambda: None)             # as if a cluster answered
    out = tmp_path / "runs"
    folder = slurm.slurm_folder(out, "circles_tradeoffs")
    folder.mkdir(parents=True)
    (folder / ".lock").symlink_to(tmp_path / "made-through-the-link")
    code, stdout, err = _cli("run", "circles_tradeoffs", "--executor", "slurm", "--grid", "epochs=1", "--out", str(out),
                             "--no-progress", "--no-wait")
    assert not (tmp_path / "made-through-the-link").exists()
    assert (code, stdout, err.count("\n")) == (2, "", 1), err
    assert f"{folder / '.lock'} is a symbolic link, which the runner does not follow" in err, err


@pytest.mark.skipif(not all(map(shutil.which, ("sbatch", "squeue", "scancel", "scontrol"))), reason="Slurm is not installed")
def test_slurm_installed_without_a_controller_is_no_cluster(tmp_path):
    conf = tmp_path / "slurm.conf"                                          # a controller nobody runs
    conf.write_text("ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort=9\n")
    env = {k: v for k, v in ENV.items() if k != "CI"} | {"SLURM_CONF": str(conf)}
    res = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "run", "circles_tradeoffs", "--executor", "slurm",
                          "--grid", "epochs=1", "--out", str(tmp_path / "runs")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert (res.returncode, res.stdout, res.stderr.count("\n")) == (2, "", 1), res
    assert res.stderr.startswith("topk-nb run: error: --executor slurm: the Slurm controller does not answer (scontrol ping:")
    assert not (tmp_path / "runs").exists()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_slurm.py")],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert tests.returncode in (0, 5) and "1 skipped" in tests.stdout, tests.stdout      # 5: no test ran
    assert "no Slurm cluster (the Slurm controller does not answer (scontrol ping:" in tests.stdout, tests.stdout


def test_a_timed_out_cell_is_named_with_its_time_limit_and_log(tmp_path):
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    res = subprocess.run(runner(nb, out, [1], 3.0, "--timeout", "1"), env=ENV, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    cell = batch.cell_dir(out, "count", {"x": 1, "sleep": 3.0})
    assert res.returncode == 1 and json.loads(res.stdout.splitlines()[-1])["failed"] == 1, res.stderr
    assert (f"not done: {json.dumps({'x': 1, 'sleep': 3.0})}: timed out: a notebook cell ran longer than the limit of 1 s "
            f"per cell (--timeout); the cell begins `import json, os, time`; log: {cell / 'job.log'}\n") in res.stderr, res.stderr


def test_status_during_a_local_run_shows_the_running_cells(tmp_path):
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    proc = subprocess.Popen(runner(nb, out, [1, 2], 4.0, "--jobs", "2"), env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while sum(executions(tmp_path).values()) < 2 and time.monotonic() < deadline: time.sleep(0.05)
        status = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "status", "--out", str(out)], env=ENV,
                                capture_output=True, text=True, timeout=120)
    finally:
        stdout, stderr = proc.communicate(timeout=120)
    assert executions(tmp_path) == Counter({1: 1, 2: 1}) and proc.returncode == 0, stderr
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout.splitlines()[-1]) == {"ok": 0, "queued": 0, "running": 2, "failed": 0, "missing": 0}, status.stdout
    for x in (1, 2):
        assert f"running             -  count/{batch.cell_dir(out, 'count', {'x': x, 'sleep': 4.0}).name}" in status.stdout, status.stdout


# --- an ok record is never replaced by a failed one -------------------------------------------------------------------
def test_a_failed_rerun_keeps_the_ok_record(tmp_path):
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    assert batch.run_grid(str(nb), grid={"x": [1], "sleep": [3.0]}, out_dir=out, progress=False)["ok"] == 1
    cell = batch.cell_dir(out, "count", {"x": 1, "sleep": 3.0})
    ok_text = (cell / RECORD).read_text()
    (cell / EXECUTED).unlink()                                        # not done: it runs again, and times out
    summary = batch.run_grid(str(nb), grid={"x": [1], "sleep": [3.0]}, out_dir=out, timeout=1, progress=False)
    assert (cell / RECORD).read_text() == ok_text                     # the ok record and its metrics stay
    assert {k: summary[k] for k in ("ok", "failed", "missing")} == {"ok": 0, "failed": 1, "missing": 0}
    error = summary["failures"][0]["error"]
    assert "a rerun: the earlier ok record is kept" in error and str(cell / batch.FAILED_ATTEMPT) in error, error
    assert read_record(cell / batch.FAILED_ATTEMPT)["status"] == "failed"
    assert [r["metrics"]["final"][0]["y"] for r in load_records(out)] == [10]
    assert batch.run_grid(str(nb), grid={"x": [1], "sleep": [3.0]}, out_dir=out, progress=False)["ok"] == 1
    assert not (cell / batch.FAILED_ATTEMPT).exists() and cell_done(cell)


# --- records of the wrong shape, changed, or old ----------------------------------------------------------------------
PARAMS = {"experiment": 1, "sigma": 10, "n_seeds": 1}
ROW = {"loss": "ce", "seed": 0, "top1": 0.5, "top2": 0.8}


def _good_record(out):
    "One well-formed circles record under `out`: its JSON, and the same without its format and checksum (an older record)."
    good = batch.write_record(batch.cell_dir(out, "circles_tradeoffs", PARAMS) / RECORD, PARAMS, {"final": [ROW]},
                              experiment="circles_tradeoffs")
    rec = json.loads(good.read_text())
    return rec, {k: v for k, v in rec.items() if k not in ("format", "checksum")}


def test_report_names_records_of_the_wrong_shape_or_changed(tmp_path):
    out = tmp_path / "runs"
    params = PARAMS
    rec, old = _good_record(out)
    texts = {"a changed digit": json.dumps(rec).replace('"top1": 0.5', '"top1": 0.6'),
             "status alone": json.dumps({"status": "ok"}),
             "metrics a string": json.dumps({**old, "metrics": "top1=0.5"}),
             "final a string": json.dumps({**old, "metrics": {"final": "0.5"}}),
             "params a list": json.dumps({**old, "params": [1, 2]})}
    paths = {}
    for i, (name, text) in enumerate(texts.items()):
        paths[name] = batch.cell_dir(out, "circles_tradeoffs", {**params, "sigma": 20 + i}) / RECORD
        paths[name].parent.mkdir(parents=True)
        paths[name].write_text(text)
    legacy = batch.cell_dir(out, "circles_tradeoffs", {**params, "sigma": 40}) / RECORD
    legacy.parent.mkdir(parents=True)
    legacy.write_text(json.dumps({**old, "params": {**params, "sigma": 40}}))   # no checksum: refused as well
    paths["no checksum"] = legacy
    done = _report("circles_tradeoffs", "--out", str(out))
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("topk-nb report: error: 6 unreadable record(s)")
    for name, why in (("a changed digit", "its content does not match its checksum"),
                      ("no checksum", "it has no 'checksum'"),
                      ("status alone", "not a record: no 'params'"),
                      ("metrics a string", "'metrics' is a string, not an object"),
                      ("final a string", "'metrics.final' is a string"),
                      ("params a list", "'params' is a list, not an object")):
        assert f"{paths[name]}: {why}" in done.stderr, (name, done.stderr)
    md = (out / "circles_tradeoffs" / "report" / "report.md").read_text()
    assert "1 successful records, 0 failed, 6 unreadable" in md, md
    assert not batch.cell_done(paths["status alone"].parent)


def test_report_replaces_links_where_it_writes_and_never_writes_through_them(tmp_path):
    out = tmp_path / "runs"
    _good_record(out)
    assert _report("circles_tradeoffs", "--out", str(out)).returncode == 0
    folder = out / "circles_tradeoffs" / "report"
    written = sorted(p.name for p in folder.iterdir())
    assert "report.md" in written and "fig2.png" in written and "fig2.svg" in written, written
    for name in written:                                 # each file the report writes: a link to a file outside --out
        target = tmp_path / f"other-{name}"
        target.write_text("keep me")
        (folder / name).unlink()
        (folder / name).symlink_to(Path("../../..") / target.name)
    done = _report("circles_tradeoffs", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"other-{name}").read_text() for name in written] == ["keep me"] * len(written)
    assert [name for name in written if (folder / name).is_symlink()] == []
    assert (folder / "report.md").read_text().startswith("# circles_tradeoffs: report")
    assert sorted(p.name for p in folder.iterdir()) == written      # no temporary file left


def _odd_records(out: Path, experiment: str, cells: list[dict]) -> dict[str, Path]:
    "A deeply nested JSON, a FIFO and a sparse 100 MB file, each as the record.json of one of `cells`."
    paths = {name: batch.cell_dir(out, experiment, cell) / RECORD for name, cell in zip(("deep", "fifo", "huge"), cells)}
    for path in paths.values(): path.parent.mkdir(parents=True)
    paths["deep"].write_text("[" * 200000 + "]" * 200000)
    os.mkfifo(paths["fifo"])
    with open(paths["huge"], "wb") as f: f.truncate(100 * 2**20)
    return paths


def test_records_that_are_no_plain_json_file_are_named_by_report_and_status(tmp_path):
    out = tmp_path / "runs"
    _good_record(out)
    paths = _odd_records(out, "circles_tradeoffs", [{**PARAMS, "sigma": s} for s in (21, 22, 23)])
    done = _report("circles_tradeoffs", "--out", str(out))                # a FIFO read would block: the timeout fails
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("topk-nb report: error: 3 unreadable record(s)"), done.stderr
    for name, why in (("deep", "not a record: its JSON is nested too deeply to be read"),
                      ("fifo", "is not a regular file but a FIFO"), ("huge", "is 104857600 bytes, more than the")):
        assert f"{paths[name]}: {why}" in done.stderr, (name, done.stderr)
    status = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "status", "--out", str(out)], env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert set(json.loads(status.stdout.splitlines()[-1])) == {"ok", "queued", "running", "failed", "missing"}, status.stdout


def test_run_runs_again_cells_whose_record_is_no_plain_json_file(tmp_path):
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    _odd_records(out, "count", [{"x": x, "sleep": 0.0} for x in (1, 2, 3)])
    res = subprocess.run(runner(nb, out, [1, 2, 3], 0.0), env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == {"total": 3, "skipped": 0, "ok": 3, "failed": 0, "missing": 0}
    check_all_done(out, [1, 2, 3])


def test_report_names_records_whose_metrics_are_not_numbers(tmp_path):
    out = tmp_path / "runs"
    params, row = PARAMS, ROW
    _, old = _good_record(out)
    changes = {"a string": ({"top1": "abc"}, "'metrics.final[0].top1' is a string, not a number"),
               "a number as a string": ({"top1": "0.5"}, "'metrics.final[0].top1' is the string '0.5', not a number"),
               "nan as a string": ({"top2": "nan"}, "'metrics.final[0].top2' is the string 'nan', not a number"),
               "a list": ({"top2": [0.8, 0.9]}, "'metrics.final[0].top2' is a list, not a number"),
               "true": ({"top1": True}, "'metrics.final[0].top1' is true or false, not a number")}
    paths = {}
    for i, (name, (change, _)) in enumerate(changes.items()):    # written before records had a checksum
        cell = {**params, "sigma": 20 + i}
        paths[name] = batch.cell_dir(out, "circles_tradeoffs", cell) / RECORD
        paths[name].parent.mkdir(parents=True)
        paths[name].write_text(json.dumps({**old, "params": cell, "metrics": {"final": [{**row, **change}]}}))
    done = _report("circles_tradeoffs", "--out", str(out))
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("topk-nb report: error: 5 unreadable record(s)"), done.stderr
    for name, (_, why) in changes.items():
        assert f"{paths[name]}: {why}" in done.stderr, (name, done.stderr)
    md = (out / "circles_tradeoffs" / "report" / "report.md").read_text()
    assert "1 successful records, 0 failed, 5 unreadable" in md, md
    assert all(f"| {paths[name]} | {why}" in md for name, (_, why) in changes.items()), md


def test_a_record_without_its_checksum_is_refused_until_sealed(tmp_path):
    # a record whose checksum and format were deleted and whose top1 was edited: not in the report, not done for run
    out = tmp_path / "runs"
    rec, old = _good_record(out)
    path = batch.cell_dir(out, "circles_tradeoffs", PARAMS) / RECORD
    edited = {**old, "metrics": {"final": [{**ROW, "top1": 0.123}]}}
    path.write_text(json.dumps(edited))
    done = _report("circles_tradeoffs", "--out", str(out))
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{path}: it has no 'checksum'" in done.stderr, done.stderr
    assert f"if you trust its numbers, seal it: topk-nb seal circles_tradeoffs --out {out}" in done.stderr, done.stderr
    md = (out / "circles_tradeoffs" / "report" / "report.md").read_text()
    assert "0 successful records, 0 failed, 1 unreadable" in md and "12.30" not in md, md
    assert not cell_done(path.parent) and read_record(path) is None
    sealed = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", "seal", "circles_tradeoffs", "--out", str(out)],
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert sealed.returncode == 0 and sealed.stdout == f"sealed {path}\n", sealed
    assert read_record(path)["metrics"]["final"][0]["top1"] == 0.123              # the user's statement: now it reads
    done = _report("circles_tradeoffs", "--out", str(out))
    assert done.returncode == 0 and "12.30" in (out / "circles_tradeoffs" / "report" / "report.md").read_text(), done


def test_run_runs_again_a_cell_whose_record_lost_its_checksum(tmp_path):
    nb, out = counting_notebook(tmp_path), tmp_path / "runs"
    grid = {"x": [1], "sleep": [0.0]}
    assert batch.run_grid(str(nb), grid=grid, out_dir=out, progress=False)["ok"] == 1
    path = batch.cell_dir(out, "count", {"x": 1, "sleep": 0.0}) / RECORD
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**{k: v for k, v in rec.items() if k not in ("checksum", "format")},
                                "metrics": {"final": [{"y": 99}]}}))
    summary = batch.run_grid(str(nb), grid=grid, out_dir=out, progress=False)
    assert {k: summary[k] for k in ("skipped", "ok", "failed", "missing")} == {"skipped": 0, "ok": 1, "failed": 0, "missing": 0}
    assert executions(tmp_path) == Counter({1: 2})                                 # it ran again
    check_all_done(out, [1])                                                      # a sealed record with y = 10


# --- notebooks and grids that could run code or write outside --out ---------------------------------------------------
def _cli(*words) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stderr(err):
        from contextlib import redirect_stdout
        with redirect_stdout(out):
            code = cli.main(list(words))
    return code, out.getvalue(), err.getvalue()


def test_grid_keys_are_identifiers_and_notebook_names_stay_inside_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(str(counting_notebook(tmp_path)), as_version=4)
    nb.cells[0].source = "%env SOME_SETTING=1\n" + nb.cells[0].source   # a parameters cell that does not parse
    nbformat.write(nb, str(tmp_path / "magic.ipynb"))
    mark = tmp_path / "was-run"
    code, out, err = _cli("run", str(tmp_path / "magic.ipynb"), "--out", str(tmp_path / "runs"),
                          "--grid", f"tag;__import__('os').system('touch {mark}');z=1")
    assert (code, out, err.count("\n")) == (2, "", 1) and "is not a parameter name" in err, err
    nbformat.write(nb, str(tmp_path / "...ipynb"))                      # its name would be the folder '..'
    code, out, err = _cli("run", str(tmp_path / "...ipynb"), "--out", str(tmp_path / "runs"))
    assert (code, err.count("\n")) == (2, 1) and "the experiment name '..' cannot name the folder of its cells" in err, err
    assert not mark.exists() and not (tmp_path / "runs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["...ipynb", "count.ipynb", "magic.ipynb"]


@pytest.mark.parametrize("words, expected", [
    (["--out", ""], "--out '' is empty: give the folder for the cells"),
    (["--grid", 'losses=["nosuchloss"]'], "--grid losses=[\"nosuchloss\"]: 'nosuchloss' is no loss of the registry"),
    (["--grid", "sigma=NaN"], "--grid sigma=NaN: sigma takes a number"),
    (["--grid", "sigma=Infinity"], "--grid sigma=Infinity: sigma takes a number"),
    (["--grid", "d=__import__('os').system('true')"],
     "--grid d=__import__('os').system('true'): d takes a number or null (its type in circles_tradeoffs.ipynb is float | None)"),
    (["--grid", "m=8.5"], "--grid m=8.5: m takes an integer or null"),
    (["--grid", "sigma=10,10.0"], "--grid 'sigma=10,10.0' gives one value twice (10 and 10.0 are equal, one cell)"),
    (["--grid", "sigma=1e1,10"], "--grid 'sigma=1e1,10' gives one value twice (10.0 and 10 are equal, one cell)"),
])
def test_command_line_gaps_are_one_line(tmp_path, monkeypatch, words, expected):
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli("run", "circles_tradeoffs", *(["--out", str(tmp_path / "runs")] if words[0] != "--out" else []),
                          *words)
    assert (code, out, err.count("\n")) == (2, "", 1) and expected in err, err
    assert list(tmp_path.iterdir()) == []                               # nothing written, not even in the current folder


def test_a_parameter_whose_default_is_none_and_declares_no_type_takes_only_null(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(str(counting_notebook(tmp_path)), as_version=4)
    nb.cells[0].source += "\ntag = None"
    nbformat.write(nb, str(tmp_path / "untyped.ipynb"))
    code, out, err = _cli("run", str(tmp_path / "untyped.ipynb"), "--out", str(tmp_path / "runs"), "--grid", "tag=$(rm -rf ~)")
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert "--grid tag=$(rm -rf ~): tag takes only null: its default in untyped.ipynb is None and its parameters cell declares no type" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_list_with_several_elements_is_one_value():
    exp, cells = batch.plan_grid("circles_tradeoffs", grid=batch.parse_grid(['losses=["ce","topk_grouping"],["ce"]']))
    assert [c["losses"] for c in cells] == [["ce", "topk_grouping"], ["ce"]]


# --- a checkpoint with a sound header and the wrong content -------------------------------------------------------------
def test_a_checkpoint_without_the_training_state_is_refused_in_one_line(tmp_path):
    run = tmp_path / "run"
    save_checkpoint({"epoch": 1, "weights": torch.zeros(3)}, run / "checkpoint.pt")   # sound file, another program's state
    with pytest.raises(CheckpointError) as info:
        _fit(run, 2)
    message = str(info.value)
    assert message.startswith(f"checkpoint {run / 'checkpoint.pt'}: its content lacks 'config', ") and "\n" not in message
    assert "delete it to start the run over" in message
    code, err = _train_cli(*TRAIN_OK, f"out_dir={run}")
    assert code == 2 and err.count("\n") == 1 and "its content lacks 'config'" in err, err
