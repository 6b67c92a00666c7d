"""The GPU check: its command without CUDA and with bad flags, a dry run of every section on the CPU, and that it can fail."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from topk_nb.perf import gpucheck
from topk_nb.perf.gpucheck import SECTIONS, TOLERANCE, check_correctness, gpu_check, main, render_markdown
from topk_nb.loss.registry import LOSSES
from topk_nb.loss.svm import TopkHinge

ROOT = Path(__file__).resolve().parent.parent
NOT_ON_A_BARE_GPU_MACHINE = ("nbdev", "fastcore", "papermill", "nbformat", "nbclient", "execnb", "IPython", "ipykernel",
                             "tqdm", "hypothesis", "pytest")
# Runs the command as `python -m` would, with the notebook tools and test libraries absent (None in sys.modules).
RUN_WITHOUT_DEV_TOOLS = f"""
import runpy, sys
sys.modules.update(dict.fromkeys({NOT_ON_A_BARE_GPU_MACHINE!r}))
sys.argv[0] = "gpucheck"
runpy.run_module("topk_nb.perf.gpucheck", run_name="__main__", alter_sys=True)
"""


def run_command(*args, cuda_visible=""):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": cuda_visible,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", RUN_WITHOUT_DEV_TOOLS, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_without_cuda_one_line_and_exit_1():
    res = run_command("--quick")
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no CUDA device is available"), res.stderr
    assert "make gpu-check" in lines[0] and "--device cpu" in lines[0]
    assert res.stdout == ""


def test_bad_flags_exit_2(capsys):
    res = run_command("--quik")
    assert res.returncode == 2 and res.stderr.startswith("usage: python -m topk_nb.perf.gpucheck"), res.stderr
    for args in (["--device", "tpu"], ["--device", "cuda:x"], ["--out"], ["--sections", "host,sped"], ["--sections", ","]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2, args
        assert "usage: python -m topk_nb.perf.gpucheck" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--sections", "host,sped"])      # a typo stops the command before any section runs
    assert "must be among environment, correctness" in capsys.readouterr().err


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    "gpu_check on the CPU: every section at tiny size."
    out = tmp_path_factory.mktemp("gpu")
    report, json_path, md_path = gpu_check("cpu", quick=True, out=out, log=lambda line: None)
    return report, json.loads(json_path.read_text()), md_path.read_text(), json_path


def test_dry_run_writes_every_section(dry_run):
    report, record, md, json_path = dry_run
    assert json_path.name.startswith("cpu-") and json_path.with_suffix(".md").exists()
    assert list(record["sections"]) == list(SECTIONS)
    assert record["failed"] == [] and record["preset"] == "dry"
    assert {s["status"] for s in record["sections"].values()} == {"ok", "skipped"}
    assert record["sections"]["cuda_graphs"] == {"status": "skipped", "reason": "CUDA graphs need a CUDA device",
                                                 "seconds": record["sections"]["cuda_graphs"]["seconds"]}
    assert md == render_markdown(report)
    for name in LOSSES:
        assert f"| {name} |" in md


def test_the_environment_section_is_the_records_description_of_the_device(dry_run):
    # one description of a process for the runner's records and the GPU check: the device's kind, name and capability,
    # torch's threads and the commit with its +dirty mark, as well as the versions, in both
    import platform
    from topk_nb.runner.records import git_commit
    env = dry_run[1]["sections"]["environment"]
    assert (env["status"], env["device"], env["capability"]) == ("ok", "cpu", None)
    assert env["device_name"] == (platform.processor() or platform.machine())
    assert (env["python"], env["platform"], env["torch"]) == (platform.python_version(), platform.platform(), torch.__version__)
    assert env["git_commit"] == git_commit() and "n_threads" in env and "cuda_visible_devices" in env


def test_dry_run_correctness_below_tolerance(dry_run):
    losses = dry_run[1]["sections"]["correctness"]["losses"]
    assert list(losses) == list(LOSSES)
    for name, v in losses.items():
        assert v["ok"] and v["loss_err"] < TOLERANCE and v["grad_err"] < TOLERANCE, (name, v)
        expected = ["epsilon=0", "noise="] if LOSSES[name].stochastic else ["registry"]
        assert [c["variant"] for c in v["checks"]] == expected and all(c["finite"] for c in v["checks"])


def test_dry_run_syncs_speed_epoch_compile(dry_run):
    secs = dry_run[1]["sections"]
    syncs = secs["syncs"]["losses"]
    assert list(syncs) == list(LOSSES)
    for name, v in syncs.items():
        assert set(v) == {"check_finite=False", "default"} and all("aten" in e for e in v.values()), name
    # on the CPU the default checks finiteness on the host; check_finite=False does not
    assert "_local_scalar_dense @ base.core.check_finite" in syncs["smooth_svm"]["default"]["aten"]
    assert "_local_scalar_dense @ base.core.check_finite" not in syncs["smooth_svm"]["check_finite=False"]["aten"]
    speed = secs["speed"]["rows"]
    assert sorted({r["loss"] for r in speed}) == sorted(LOSSES)
    assert all(r["ratio"] > 0 and (r["k"] is None) == ("k" not in LOSSES[r["loss"]].defaults) for r in speed)
    assert [r["loss"] for r in secs["epoch"]["rows"]] == ["ce", "smooth_svm", "noised_bal"]
    assert secs["epoch"]["rows"][0]["overhead"] == 0.0
    compiled = secs["compile"]["losses"]
    assert list(compiled) == list(LOSSES) and secs["compile"]["backend"] == "eager"
    for name, v in compiled.items():
        assert "ok" in (v.get("fullgraph"), v.get("graph_breaks")), (name, v)
        assert LOSSES[name].stochastic or v["err"] <= TOLERANCE, (name, v)


class SkewedHinge(TopkHinge):
    "The top-k hinge with a float32-only bug: same value, gradient 0.1 % too large."

    def forward(self, scores, target):
        if scores.dtype == torch.float32:
            scores = 1.001 * scores - 0.001 * scores.detach()
        return super().forward(scores, target)


def test_correctness_catches_a_wrong_gradient(monkeypatch):
    monkeypatch.setitem(LOSSES, "topk_hinge", dataclasses.replace(LOSSES["topk_hinge"], module=SkewedHinge))
    res = check_correctness("cpu", cases=((8, 20, 3),), names=["ce", "topk_hinge"])
    assert res["status"] == "failed"
    assert res["losses"]["ce"]["ok"] and not res["losses"]["topk_hinge"]["ok"]
    assert res["losses"]["topk_hinge"]["loss_err"] < TOLERANCE < res["losses"]["topk_hinge"]["grad_err"] < 1e-2


class BrokenHinge(TopkHinge):
    "The top-k hinge with a graph break in its forward: right values, but no whole graph under torch.compile."

    def forward(self, scores, target):
        torch._dynamo.graph_break()
        return super().forward(scores, target)


def test_compile_section_fails_a_loss_that_does_not_compile_whole(monkeypatch):
    monkeypatch.setitem(LOSSES, "topk_hinge", dataclasses.replace(LOSSES["topk_hinge"], module=BrokenHinge))
    res = gpucheck.check_compile("cpu", batch=4, features=8, n=20, k=3, names=["ce", "topk_hinge"], backend="eager")
    entry = res["losses"]["topk_hinge"]
    assert res["status"] == "failed" and res["losses"]["ce"]["ok"] and not entry["ok"], res
    assert entry["fullgraph"] != "ok" and entry["graph_breaks"] == "ok", entry     # it compiled, in pieces


def test_compile_section_counts_the_kernels_a_compiled_step_runs():
    kernels = pytest.importorskip("topk_nb.ops.launch")
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    with kernels.force_triton():                      # as on CUDA: the fused kernels, here in Triton's interpreter
        out = gpucheck.check_compile("cpu", batch=4, features=8, n=40, k=3, names=["ce", "smooth_svm", "noised_bal"],
                                     backend="eager")
    launches = {name: entry["kernel_launches"] for name, entry in out["losses"].items()}
    assert out["status"] == "ok" and launches == {"ce": 0, "smooth_svm": 4, "noised_bal": 4}, out   # float32 SVM, rows of one tile: one forward, two backward, the finishing kernel; noised: candidates, merge, finishing, gradient


def test_triton_variants_are_the_launches_each_section_needs():
    "The dry preset's launches, recorded and not run: the float32 smooth SVM's kernels at the preset's k, the noised losses' kernels, the row losses' kernels (modules that import the launch function by name record too), each first needed by a section of the check."
    kernels = pytest.importorskip("topk_nb.ops.launch")
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    variants = gpucheck.triton_variants(gpucheck.PRESETS["dry"])
    names = {key[1] for key in variants}
    assert {"_svm32_tile_kernel", "_svm32_grad_tile_kernel", "_perturbed_candidates_kernel", "_perturbed_grad_kernel"} <= names
    assert {"_row_loss_kernel", "_row_grad_kernel", "_finish_kernel"} <= names      # every kernel module's launches
    assert set(variants.values()) <= set(gpucheck.SECTIONS)
    assert {dict(key[3])["K"] for key in variants if key[1] == "_svm32_tile_kernel"} == {3}
    assert all(dict(key[2])["s_ptr"] == "*fp32" for key in variants if key[1] == "_svm32_tile_kernel")


def test_compile_estimate_times_each_variant_for_sm90():
    kernels = pytest.importorskip("topk_nb.ops.launch")
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    est = gpucheck.compile_estimate(gpucheck.PRESETS["dry"], names=["smooth_svm"])
    assert est["names"] == ["smooth_svm"] and set(est["sections"]) == {"correctness"}   # the first section compiles them all
    s = est["sections"]["correctness"]
    assert s["variants"] >= 3 and s["here_s"] > 0
    assert s["gpu_host_s"] == pytest.approx(s["here_s"] * gpucheck.GPU_HOST_COMPILE[0])
    assert est["total_s"] == pytest.approx(est["triton_s"] + gpucheck.INDUCTOR_SECONDS[0])


def test_recorded_launches_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with gpucheck.recorded_launches({}):
            pass
