"""The built wheel carries the experiment notebooks, and an installed (not editable) package lists and runs them
from any directory."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "nbs" / "experiments").glob("*.ipynb"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    "The package built as a wheel and installed (without dependencies: they are this environment's) into a folder."
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist")], check=True, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("topk_nb-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp / "site"), str(wheel)],
                   check=True, cwd=tmp)
    return wheel, tmp / "site"


def run_installed(site: Path, cwd: Path, *words: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}              # the installed copy shadows the source tree
    env.pop("TOPK_NB_EXPERIMENTS", None)
    code = "import sys; from topk_nb.runner.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *words], cwd=cwd, env=env, capture_output=True, text=True)


def test_the_wheel_carries_every_experiment_notebook(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert NOTEBOOKS and all(f"topk_nb/experiments/{name}" in names for name in NOTEBOOKS)


def test_installed_package_lists_and_runs_from_any_directory(installed, tmp_path):
    _, site = installed
    listed = run_installed(site, tmp_path, "list")
    assert listed.returncode == 0, listed.stderr
    assert f"notebook: {site / 'topk_nb' / 'experiments' / 'circles_tradeoffs.ipynb'}" in listed.stdout
    ran = run_installed(site, tmp_path, "run", "circles_tradeoffs", "--preset", "smoke", "--out", str(tmp_path / "runs"))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    records = list((tmp_path / "runs").rglob("record.json"))
    assert records and all(json.loads(r.read_text())["status"] == "ok" for r in records)


def test_the_wheel_declares_the_experiments_extra(installed):
    "`pip install \"topk_nb[experiments]\"` brings what `topk-nb run` executes notebooks with."
    import re
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(name).decode().splitlines()
    assert "Provides-Extra: experiments" in lines, lines
    extra = [line.split(":", 1)[1] for line in lines if line.startswith("Requires-Dist:")
             and re.search(r";\s*extra\s*==\s*['\"]experiments['\"]", line)]
    names = {re.match(r"\s*([A-Za-z0-9_.-]+)", req).group(1).lower() for req in extra}
    assert {"papermill", "nbformat", "ipykernel"} <= names, extra


def test_installed_command_runs_a_circles_cell_and_its_report_outside_the_source_tree(installed, tmp_path):
    _, site = installed
    script = site / "bin" / "topk-nb"              # the console script the wheel declares
    assert script.is_file(), sorted(p.name for p in (site / "bin").iterdir()) if (site / "bin").is_dir() else site
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("TOPK_NB_EXPERIMENTS", None)
    out = tmp_path / "runs"

    def topk_nb(*words):
        return subprocess.run([sys.executable, str(script), *words], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
    listed = topk_nb("list", "circles_tradeoffs")
    assert listed.returncode == 0 and f"notebook: {site / 'topk_nb' / 'experiments' / 'circles_tradeoffs.ipynb'}" in listed.stdout
    # the smoke preset cut to one cell: one sigma, one seed, few points and epochs
    ran = topk_nb("run", "circles_tradeoffs", "--preset", "smoke", "--grid", "sigma=15", "epochs=5", "n_per_class=20",
                  "n_test_per_class=20", "--seeds", "1", "--out", str(out), "--no-progress")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (record,) = (out / "circles_tradeoffs").rglob("record.json")
    rec = json.loads(record.read_text())
    assert rec["status"] == "ok" and rec["params"]["sigma"] == 15 and rec["params"]["n_seeds"] == 1, rec["params"]
    assert rec["environment"]["git_commit"] is None     # written by the installed copy, which is in no git checkout
    report = topk_nb("report", "circles_tradeoffs", "--out", str(out))
    assert report.returncode == 0, report.stdout + report.stderr
    md = out / "circles_tradeoffs" / "report" / "report.md"
    assert md.is_file() and "1 successful records, 0 failed, 0 unreadable" in md.read_text(), report.stdout
