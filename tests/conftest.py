import os

import pytest
from hypothesis import HealthCheck, settings

# Deterministic, CPU-friendly property tests: the same examples on every machine and in CI.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Without a GPU, Triton's interpreter runs the fused kernels on the CPU (read when triton is first imported).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the tests on several processes (pytest-xdist, `-n auto --dist loadgroup`): each test is a unit of
# work of its own, except the tests of the modules below, which share something that forbids running them side by
# side, or that is worth making once: each of these modules goes to one process, whole, and its tests run in order.
ONE_PROCESS = {
    "test_slurm": "the single-node Slurm cluster: its CPUs are all the jobs of every test have",
    "test_wheel": "the wheel, built once from the source tree (its build/ folder) for the module",
    "test_gpucheck": "the dry run of every section, made once for the module",
}

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:                   # without pytest-xdist the tests run in one process, in order
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    from pathlib import Path

    class ModuleGroups(LoadScopeScheduling):
        """`--dist loadgroup` with the groups of ONE_PROCESS. (pytest-xdist's own groups, `xdist_group` marks, take no
        effect under pytest 9, whose node ids pytest-xdist can no longer suffix with the group.) The largest units go
        first (pytest-xdist's `--loadscope-reorder`)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).stem in ONE_PROCESS else nodeid

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return ModuleGroups(config, log)


# Kernel cases that a chapter's own checks run under Triton's interpreter (nbdev_test, beside these tests in `make test`)
# are marked `@pytest.mark.chapter("03a")`: without a CUDA device they are skipped here, so that the interpreter does
# not run them twice; on a GPU (`make gpu-test`) they run compiled.
def pytest_configure(config):
    config.addinivalue_line("markers", "chapter(name): the chapter whose checks run these cases under Triton's "
                                       "interpreter; here they run on a CUDA device only")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if (mark := item.get_closest_marker("chapter")) is not None:
            item.add_marker(pytest.mark.skip(reason=f"interpreted in chapter {mark.args[0]}'s checks (nbdev_test); "
                                                    "compiled here on a CUDA device"))
