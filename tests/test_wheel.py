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
    code = "import sys; from topk_nb.batch import main; sys.exit(main(sys.argv[1:]))"
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
