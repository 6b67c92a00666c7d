"""The static cost model of the Triton kernels (bench chapter, section 7-8): SASS classes, software float64
transcendentals, dynamic counts from declared loop trips, the time bounds, and how a budget is judged. The budgets
themselves are held by chapter 14's check under its cost table (run by `nbdev_test`): the table compiles every
kernel for sm_90, minutes of work that is done once."""
import importlib.util
import textwrap

import pytest

bench = pytest.importorskip("topk_nb.perf.bench")
if not bench.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

_TOY = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def fma_loop(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = x
        for _ in range(n):
            acc = acc * x + 1.0
        tl.store(out_ptr + offs, acc, mask=offs < n)

    @triton.jit
    def exp_log(x_ptr, out_ptr, n, LOG: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        y = tl.exp(x)
        if LOG:
            y = tl.log(1.0 + y)
        tl.store(out_ptr + offs, y, mask=offs < n)
''')
_SIG = dict(x_ptr="*fp32", out_ptr="*fp32", n="i32", BLOCK="constexpr")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy") / "costmodel_toy_kernels.py"
    path.write_text(_TOY)
    spec = importlib.util.spec_from_file_location("costmodel_toy_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ops(sass):
    return {i.opcode.split(".")[0] for i in sass.instructions}


def test_fp32_fma_loop_has_ffma_and_no_fp64(toy):
    sass = bench.kernel_sass(toy.fma_loop, _SIG, dict(BLOCK=128))
    classes = {bench.sass_class(i.opcode) for i in sass.instructions}
    assert "FFMA" in _ops(sass) and "fp64" not in classes and "other" not in classes
    assert bench.f64_transcendentals(sass.instructions) == [] and sass.spill_stores == 0


@pytest.mark.parametrize("log, calls", [(False, 1), (True, 2)])
def test_float64_exp_and_log_are_found(toy, log, calls):
    sig = dict(x_ptr="*fp64", out_ptr="*fp64", n="i32", LOG="constexpr", BLOCK="constexpr")
    sass = bench.kernel_sass(toy.exp_log, sig, dict(LOG=log, BLOCK=128))
    assert "DFMA" in _ops(sass) and "MUFU" not in _ops(sass) or log     # exp in float64: DFMAs, no MUFU
    assert len(bench.f64_transcendentals(sass.instructions)) == calls
    f32 = bench.kernel_sass(toy.exp_log, {**sig, "x_ptr": "*fp32", "out_ptr": "*fp32"}, dict(LOG=log, BLOCK=128))
    assert bench.f64_transcendentals(f32.instructions) == [] and "MUFU" in _ops(f32)


def test_dynamic_count_follows_the_declared_trips(toy):
    sass = bench.kernel_sass(toy.fma_loop, _SIG, dict(BLOCK=128))
    loops = bench.source_loops(toy.fma_loop)
    ffma = [bench.dynamic_counts(sass, loops, [t])["ops"]["FFMA"] for t in (8, 16, 32, 33)]
    assert [b - a for a, b in zip(ffma, ffma[1:])] == [8, 16, 1]          # one FFMA per trip, unrolled or not
    with pytest.raises(ValueError, match="trips must give one count per source loop"):
        bench.dynamic_counts(sass, loops, [])


def test_svm_forward_count_is_linear_in_k():
    from topk_nb.ops import svm as svm_kernels
    km = bench.KERNEL_MODELS["smooth_svm_forward"]
    sass = bench.kernel_sass(km.fn, km.signature, dict(K=5, BLOCK_N=1024, BLOCK_K=8, FAST=True))
    loops = bench.source_loops(svm_kernels._svm_forward_kernel)
    total = [bench.dynamic_counts(sass, loops, [2, k])["total"] for k in (0, 5, 10)]
    assert total[2] - total[1] == pytest.approx(total[1] - total[0]) and total[1] - total[0] > 0
    assert bench.dynamic_counts(sass, loops, [4, 5])["total"] - total[0] == pytest.approx(2 * (total[1] - total[0]), rel=0.01)


def test_bounds_scale():
    base = dict(per_thread={"fp32": 500.0, "mufu": 20.0, "fp64": 8.0}, programs=1000, num_warps=4)
    a, b = bench.estimate_time(**base, bytes_moved=1e8), bench.estimate_time(**base, bytes_moved=2e8)
    assert b["memory"] == pytest.approx(2 * a["memory"])
    c = bench.estimate_time({k: 2 * v for k, v in base["per_thread"].items()}, 1000, 4, 1e8)
    for key in ("issue", "mufu", "fp64", "latency"):
        assert c[key] == pytest.approx(2 * a[key])
    d = bench.estimate_time(**base, bytes_moved=1e8, launches=4)
    assert d["estimate"] - a["estimate"] == pytest.approx(3 * bench.H100["launch_s"][0])
    assert bench.estimate_time(**{**base, "programs": 2000}, bytes_moved=1e8)["issue"] > a["issue"]


def test_within_budget_reports_and_refuses():
    row = {"kernel": "perturbed_kth step", "n": 1000, "k": 5, "ratio": 7.0, "f64_calls_per_element": 0.0, "spill_bytes": 0}
    budgets = {"b": bench.Budget("perturbed_kth", lambda sh: sh["n"] == 1000, 5.0)}
    assert bench.within_budget([row], budgets) == {"b": ["n=1000, k=5: ratio 7.0 > 5.0"]}
    assert bench.within_budget([{**row, "ratio": 4.0}], budgets) == {"b": []}
    with pytest.raises(ValueError, match="selects no step row"):
        bench.within_budget([{**row, "n": 10}], budgets)


def test_pruning_cuts_the_modelled_work():
    "At n = 1e5 the live classes of bench scores fit the tile, and the pruned candidates kernel does under half the unpruned work."
    sh = dict(B=256, n=100_000, k=5)
    assert bench.live_classes(sh) < bench._plan(sh)["CAP"] < bench.live_classes(sh, sigma=0.01)   # close scores: all live
    pruned = bench.kernel_cost("perturbed_candidates", sh)
    full = bench.kernel_cost("perturbed_candidates, unpruned", sh)
    assert bench._tiled(sh) and pruned["instr_per_element"] < full["instr_per_element"] / 2


def test_ilp_is_the_fit_to_the_gpu_record():
    "The latency bound's ilp is a fitted constant, documented with its source."
    value, source = bench.H100["ilp"]
    assert 1.0 < value <= 4.0 and "GPU record" in source
