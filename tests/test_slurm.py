"""`topk-nb run --executor slurm` against a real Slurm: a single-node cluster that `tools/slurm.sh start` runs on this
machine (CI starts it). Without one the module is skipped with one line; in CI (the environment variable CI set) a
missing cluster fails."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from topk_nb.runner.batch import JOB_LOG, RECORD, cell_dir, get_experiment, record_stamp
from topk_nb.runner.slurm import slurm_available, slurm_folder, task_log

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONF = Path(os.environ.get("TOPK_NB_SLURM_DIR", "/tmp/topk-nb-slurm")) / "slurm.conf"


def cluster_problem() -> str | None:
    "None if the cluster of `tools/slurm.sh start` (its slurm.conf, unless SLURM_CONF names another) answers; else why not."
    if "SLURM_CONF" not in os.environ and DEFAULT_CONF.is_file():
        os.environ["SLURM_CONF"] = str(DEFAULT_CONF)
    problem = slurm_available()
    return problem and f"no Slurm cluster ({problem}); start one with tools/slurm.sh start"


PROBLEM = cluster_problem()
if PROBLEM and not os.environ.get("CI"):
    pytest.skip(PROBLEM, allow_module_level=True)           # a laptop: one line


@pytest.fixture(scope="module", autouse=True)
def cluster():
    "In CI a missing cluster fails every test here (elsewhere the module is skipped above)."
    if PROBLEM: pytest.fail(PROBLEM)


@pytest.fixture(scope="module")
def fast_poll(tmp_path_factory):
    "A --slurm-config file: the runner looks at the queue every second (5 s by default)."
    path = tmp_path_factory.mktemp("config") / "slurm.json"
    path.write_text(json.dumps({"poll_s": 1, "time_min": 10}))
    return str(path)


@pytest.fixture(autouse=True)
def cancel_leftovers(tmp_path):
    "After each test, cancel the Slurm jobs it submitted (its ledgers) and wait until they have left the node: a failed test leaves no task behind to hold the node's CPUs while the next test's job waits."
    yield
    jobs = [c["job"] for p in tmp_path.rglob(".slurm/submissions/*.json") for c in json.loads(p.read_text())["cells"]]
    if not jobs: return
    subprocess.run(["scancel", *jobs], capture_output=True, timeout=60)
    arrays = sorted({j.split("_")[0] for j in jobs})
    live = lambda: {j: s for a in arrays for j, s in squeue(a).items() if s in ("PENDING", "RUNNING", "COMPLETING")}
    wait_until(lambda: not live(), limit=90, what="the end of this test's Slurm jobs")


def topk_nb(*words, timeout=300):
    "Exit status, stdout, stderr of the `topk-nb` command in a fresh process (as a user runs it)."
    p = subprocess.run([sys.executable, "-m", "topk_nb.runner.cli", *words], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def cell_logs(directory: Path, folder: Path, job: str) -> str:
    "The last lines of a cell's job log and of its Slurm task's log, for the message of a failed assertion."
    parts = []
    for path in (directory / JOB_LOG, task_log(folder, job)):
        text = path.read_text(errors="replace") if path.exists() else "(no file)"
        parts.append(f"--- {path}:\n" + "\n".join(text.splitlines()[-30:]))
    return "\n".join(parts)


def summary_of(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def squeue(array: str) -> dict:
    out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j", array], capture_output=True, text=True)
    return dict(line.split("|") for line in out.stdout.split())


def wait_until(predicate, limit=120.0, what="the condition"):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate(): return
        time.sleep(0.3)
    raise AssertionError(f"{what} did not happen within {limit} s")


# A notebook whose cells write, in their folder, a line per start and per finish, and stall while a `hold` file is in
# the experiment's folder (hold-X for the cell x=X); it checkpoints its steps (progress.json) and resumes from them, like topk_nb.training.loop.
BODY = """\
import json, time
from pathlib import Path
from topk_nb.runner.records import atomic_write_json, write_record
cell = Path(record_path).parent
hold = cell.parent / f"hold-{x}"
with open(cell / "runs.log", "a") as f: f.write("start\\n")
progress = cell / "progress.json"
step = json.loads(progress.read_text())["step"] if progress.exists() else 0
resumed_from = step
while step < steps:
    while hold.exists() and step == stall_at:
        time.sleep(0.1)
    step += 1
    atomic_write_json(progress, {"step": step})
write_record(record_path, {"x": x, "steps": steps, "stall_at": stall_at},
             {"final": [{"y": 10 * x, "resumed_from": resumed_from}]}, seed=0)
with open(cell / "runs.log", "a") as f: f.write("done\\n")
"""


def slow_notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("x = 1\nsteps = 6\nstall_at = -1\nrecord_path = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(BODY)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def comparable(record: dict) -> dict:
    "A record without what differs between two runs of the same cell: times, paths, the process's environment."
    return {k: v for k, v in record.items() if k not in ("wall_time_s", "finished", "environment", "checksum", "path")}


def test_circles_smoke_cell_on_slurm_gives_the_local_record(tmp_path, fast_poll):
    words = ["circles_tradeoffs", "--preset", "smoke", "--grid", "sigma=15", "epochs=5", "n_per_class=20",
             "n_test_per_class=20", "--seeds", "1", "--no-progress"]
    code, out, err = topk_nb("run", *words, "--out", str(tmp_path / "local"))
    assert code == 0, err
    code, out, err = topk_nb("run", *words, "--out", str(tmp_path / "slurm"), "--executor", "slurm",
                             "--slurm-config", fast_poll, "--sbatch", "comment=topk-nb-test")
    assert code == 0, err
    s = summary_of(out)
    assert (s["total"], s["ok"], s["submitted"], s["failed"], s["missing"]) == (1, 1, 1, 0, 0), s
    (local,) = (tmp_path / "local").rglob(RECORD)
    (remote,) = (tmp_path / "slurm").rglob(RECORD)
    assert local.relative_to(tmp_path / "local") == remote.relative_to(tmp_path / "slurm")     # the same cell folder
    a, b = json.loads(local.read_text()), json.loads(remote.read_text())
    assert a["status"] == b["status"] == "ok"
    assert comparable(a) == comparable(b)
    assert a["environment"]["n_threads"] == b["environment"]["n_threads"]
    # the same command again: nothing left to submit, the state of every cell from disk and Slurm
    code, out, err = topk_nb("run", *words, "--out", str(tmp_path / "slurm"), "--executor", "slurm")
    assert code == 0 and summary_of(out)["submitted"] == 0 and summary_of(out)["skipped"] == 1, (out, err)
    code, out, err = topk_nb("status", "--out", str(tmp_path / "slurm"))
    assert code == 0, err
    assert out.splitlines()[0].split()[:2] == ["ok", s["slurm_job"]], out      # one cell: one job, no array
    assert json.loads(out.splitlines()[-1]) == {"ok": 1, "queued": 0, "running": 0, "failed": 0, "missing": 0}


def test_scancel_mid_cell_then_rerun_loses_and_duplicates_nothing(tmp_path, fast_poll):
    nb = slow_notebook(tmp_path / "slow.ipynb")
    out = tmp_path / "runs"
    exp = get_experiment(str(nb))
    (out / exp.name).mkdir(parents=True)
    (out / exp.name / "hold-3").write_text("")      # the cell x=3 stalls half-way while this file is there
    words = ["run", str(nb), "--grid", "x=1,2,3", "stall_at=3", "--out", str(out), "--executor", "slurm",
             "--no-progress", "--slurm-config", fast_poll]
    code, stdout, err = topk_nb(*words, "--no-wait")
    assert code == 0, err
    first = summary_of(stdout)
    assert first["submitted"] == 3 and first["queued"] + first["running"] + first["ok"] == 3, first
    # submitted again at once: every cell is queued, running or done, so nothing is submitted twice
    code, stdout, err = topk_nb(*words, "--no-wait")
    assert summary_of(stdout)["submitted"] == 0, (stdout, err)
    dirs = {x: cell_dir(out, exp, {"x": x, "stall_at": 3}) for x in (1, 2, 3)}
    wait_until(lambda: all((dirs[x] / RECORD).exists() for x in (1, 2)) and (dirs[3] / "progress.json").exists()
               and json.loads((dirs[3] / "progress.json").read_text())["step"] == 3, what="cells 1, 2 done, 3 at step 3")
    stamps = {x: record_stamp(dirs[x]) for x in (1, 2)}
    subprocess.run(["scancel", first["slurm_job"]], check=True)
    wait_until(lambda: all(s not in ("PENDING", "RUNNING", "COMPLETING") for s in squeue(first["slurm_job"]).values()),
               what="the array job's end")
    code, stdout, err = topk_nb("status", str(nb), "--out", str(out))
    states = {line.split()[-1].split("/")[-1]: line.split()[0] for line in stdout.splitlines()
              if line[:1].isalpha()}
    assert states == {dirs[1].name: "ok", dirs[2].name: "ok", dirs[3].name: "missing"}, stdout
    assert f"log: {slurm_folder(out, exp)}" in stdout, stdout                  # the missing cell's Slurm log
    assert not (dirs[3] / RECORD).exists() and not list(dirs[3].glob(".record.*")), sorted(dirs[3].iterdir())
    (out / exp.name / "hold-3").unlink()
    code, stdout, err = topk_nb(*words)
    assert code == 0, err
    second = summary_of(stdout)
    assert (second["submitted"], second["skipped"], second["ok"]) == (1, 2, 1), second
    assert {x: record_stamp(dirs[x]) for x in (1, 2)} == stamps                 # the done cells were not run again
    runs = {x: (dirs[x] / "runs.log").read_text().split() for x in (1, 2, 3)}
    assert runs == {1: ["start", "done"], 2: ["start", "done"], 3: ["start", "start", "done"]}, runs
    rec = json.loads((dirs[3] / RECORD).read_text())
    assert rec["status"] == "ok" and rec["metrics"]["final"][0]["resumed_from"] == 3, rec
    ledger = sorted((json.loads(p.read_text()) for p in (slurm_folder(out, exp) / "submissions").glob("*.json")),
                    key=lambda sub: sub["submitted"])
    assert [[c["params"]["x"] for c in sub["cells"]] for sub in ledger] == [[1, 2, 3], [3]]


def test_a_time_limit_warning_and_a_requeue_each_restart_the_task_which_resumes_its_cell(tmp_path):
    nb = slow_notebook(tmp_path / "slow.ipynb")
    out = tmp_path / "runs"
    exp = get_experiment(str(nb))
    (out / exp.name).mkdir(parents=True)
    (out / exp.name / "hold-1").write_text("")                   # every attempt stalls at step 2 while it is there
    code, stdout, err = topk_nb("run", str(nb), "--grid", "stall_at=2", "--out", str(out), "--executor", "slurm",
                                "--no-wait", "--time", "10")
    assert code == 0, err
    job = summary_of(stdout)["slurm_job"]                  # one cell: one job, no array
    directory = cell_dir(out, exp, {"stall_at": 2})
    progress, runs = directory / "progress.json", directory / "runs.log"
    wait_until(lambda: progress.exists() and json.loads(progress.read_text())["step"] == 2, what="step 2")
    # what Slurm sends ahead of the time limit (--signal=USR2@...): submitit requeues the task
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_until(lambda: runs.read_text().split() == ["start", "start"], limit=180, what="the restart after SIGUSR2")
    # what Slurm does for a lost node or a preemption with requeue
    subprocess.run(["scontrol", "requeue", job], check=True)
    wait_until(lambda: runs.read_text().split() == ["start", "start", "start"], limit=180, what="the restart after requeue")
    assert not (directory / RECORD).exists()
    (out / exp.name / "hold-1").unlink()
    wait_until(lambda: (directory / RECORD).exists(), limit=180, what="the requeued cell's record")
    rec = json.loads((directory / RECORD).read_text())
    assert rec["status"] == "ok" and rec["metrics"]["final"][0]["resumed_from"] == 2, rec   # from the checkpoint
    assert runs.read_text().split() == ["start", "start", "start", "done"]
    assert not list(directory.glob(".record.*")) and not list(directory.glob(".notebook.*")), sorted(directory.iterdir())
    ledger = list((slurm_folder(out, exp) / "submissions").glob("*.json"))
    assert len(ledger) == 1                                            # requeued by Slurm, not submitted again


# the runner must stop on a signal whatever SIGINT disposition it inherits: a background job of a shell script, and
# every process it starts, has SIGINT ignored, and Python then installs no KeyboardInterrupt handler of its own
INHERITED = {"default": signal.SIG_DFL, "ignored": signal.SIG_IGN}


@pytest.mark.parametrize("signum,inherited", [(signal.SIGINT, "default"), (signal.SIGINT, "ignored"),
                                              (signal.SIGTERM, "default")], ids=["SIGINT", "SIGINT-ignored", "SIGTERM"])
def test_ctrl_c_of_the_runner_cancels_what_it_submitted_after_saying_so(tmp_path, fast_poll, signum, inherited):
    nb = slow_notebook(tmp_path / "slow.ipynb")
    out = tmp_path / "runs"
    exp = get_experiment(str(nb))
    (out / exp.name).mkdir(parents=True)
    (out / exp.name / "hold-1").write_text("")
    runner = subprocess.Popen([sys.executable, "-m", "topk_nb.runner.cli", "run", str(nb), "--grid", "stall_at=2", "--out",
                               str(out), "--executor", "slurm", "--slurm-config", fast_poll],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, INHERITED[inherited]))
    directory = cell_dir(out, exp, {"stall_at": 2})
    progress = directory / "progress.json"
    try:
        wait_until(lambda: progress.exists() and json.loads(progress.read_text())["step"] == 2, what="step 2")
    finally:
        runner.send_signal(signum)
        sent = time.monotonic()
        try:
            stdout, stderr = runner.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            runner.kill()                                            # no runner outlives the test
            stdout, stderr = runner.communicate()
            raise AssertionError(f"the runner had not exited 120 s after {signum.name}; its stderr:\n{stderr}") from None
    took = time.monotonic() - sent
    assert runner.returncode == 128 + signum, stderr
    assert took < 60, f"the runner took {took:.0f} s to exit after {signum.name}"   # one scancel and one squeue
    job = summary_of(stdout)["slurm_job"]
    assert summary_of(stdout)["stopped"] == f"interrupted by {signum.name}", stdout
    assert f"interrupted: cancelling Slurm job {job}, which this run submitted (1 cell)" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    wait_until(lambda: squeue(job).get(job) == "CANCELLED", what="the job's cancellation")
    left = sorted(p.name for p in directory.iterdir())          # left resumable: no record, no attempt's files
    assert RECORD not in left and not [n for n in left if n.startswith((".record.", ".notebook."))], \
        (left, cell_logs(directory, slurm_folder(out, exp), job))
