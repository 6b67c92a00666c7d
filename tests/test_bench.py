"""Counting the aten operators of a call: names, dtypes, host syncs and who made them."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from topk_nb.perf import bench
from topk_nb.perf.bench import aten_ops, bench_loss, bench_scores, op_table, syncing_ops


def test_aten_ops_counts_a_known_function():
    x = torch.randn(5)
    assert aten_ops(lambda: x.exp().sum()) == Counter({"exp": 1, "sum": 1})
    assert aten_ops(lambda: x.exp().exp().sum()) == Counter({"exp": 2, "sum": 1})
    assert aten_ops(lambda: x.double().exp() + x, dtype=torch.float64) == Counter({"_to_copy": 1, "exp": 1, "add": 1})
    assert aten_ops(lambda: x.exp() + x.double(), dtype=torch.float64) == Counter({"_to_copy": 1, "add": 1})
    assert aten_ops(lambda: x.exp(), dtype=torch.float64) == Counter()


def test_aten_ops_counts_the_backward():
    leaf = torch.randn(5, requires_grad=True)
    ops = aten_ops(lambda: leaf.exp().sum().backward())
    assert ops["exp"] == 1 and ops["mul"] >= 1                  # d exp = exp * grad


def test_syncing_ops():
    x = torch.tensor([1.0, -2.0, 3.0])
    assert syncing_ops(aten_ops(lambda: x[x > 0])) == Counter({"nonzero": 1})
    assert syncing_ops(aten_ops(lambda: x.nonzero())) == Counter({"nonzero": 1})
    assert syncing_ops(aten_ops(lambda: (x.sum().item(), bool(x.max() > 0)))) == Counter({"_local_scalar_dense": 2})
    assert syncing_ops(aten_ops(lambda: torch.unique(x))) == Counter({"_unique2": 1})
    assert syncing_ops(aten_ops(lambda: x.masked_select(x > 0))) == Counter({"masked_select": 1})
    assert syncing_ops(aten_ops(lambda: x.repeat_interleave(torch.tensor([1, 2, 0])))) == \
        Counter({"repeat_interleave (tensor repeats)": 1})
    assert syncing_ops(aten_ops(lambda: x.repeat_interleave(2))) == Counter()
    assert syncing_ops(aten_ops(lambda: (x.exp() * 2).topk(2))) == Counter()


def test_syncing_ops_where():
    scores, target = bench_scores(4, 10)
    hinge = bench_loss("topk_hinge", 10, 3, check_finite=False)
    assert syncing_ops(aten_ops(lambda: hinge(scores, target), where=True)) == \
        Counter({"_local_scalar_dense @ base.core.all_kept": 2})


def test_op_table():
    rows = op_table(["topk_hinge", "smooth_svm"], batch=4, n=10, k=3)
    assert [r["loss"] for r in rows] == ["F.cross_entropy", "topk_hinge", "smooth_svm"]
    ce = rows[0]
    assert ce["syncing"] == {} and ce["float64_ops"] == 0 and ce["ops"] > 0
    assert rows[1]["syncing"] == {}                             # the sync-free path: the label check runs on the device
    host = op_table(["topk_hinge"], batch=4, n=10, k=3, path="host")
    assert host[1]["syncing"] == {"_local_scalar_dense @ base.core.all_kept": 2}   # the labels' range, read once
    with pytest.raises(ValueError, match="path must be"):
        op_table(["topk_hinge"], path="gpu")
    assert rows[2]["float64_ops"] > 0                           # the power path works in float64
    assert ce["launches"] == ce["ops"] - 4                      # three detach and one expand: views launch nothing
    assert rows[2]["triton"] == 0 and rows[2]["launches"] < rows[2]["ops"]


def test_op_table_cuda_path_counts_the_fused_kernels():
    ops = {r["loss"]: r for r in op_table(["smooth_svm", "noised_bal", "topk_hinge"], batch=2, n=40, k=3, path="cuda")}
    assert ops["smooth_svm"]["triton"] == 4 and ops["noised_bal"]["triton"] == 4   # rows of one tile
    assert ops["topk_hinge"]["triton"] == 3                     # the row kernels: forward, finish, gradient
    assert all(not r["syncing"] for r in ops.values())


def test_cost_model_launches_are_the_cuda_paths():
    "The launches a step of the cost model charges (bench.COST_STEPS) are those the CUDA path makes at n = 1000, the label check in the finishing kernel included (no separate assert)."
    ops = {r["loss"]: r for r in op_table(["smooth_svm", "noised_bal"], batch=4, n=1000, k=5, path="cuda")}
    for name in ("F.cross_entropy", "smooth_svm", "noised_bal"):
        assert ops[name]["launches"] == bench.COST_STEPS[name].launches, (name, ops[name])


@pytest.mark.parametrize("conventions", ["none", "weight and ignore_index"])
def test_cuda_path_launches_near_cross_entropy(conventions):
    "Forward+backward (reduction 'mean') on the CUDA path: the modules' label check, mask, weights and reduction run in the kernels, so smooth_svm and the noised losses launch at most 7 kernels in all, F.cross_entropy 6."
    n = 40
    conv = {} if conventions == "none" else {"weight": torch.rand(n, generator=torch.Generator().manual_seed(0)) + 0.5,
                                             "ignore_index": 1}
    ops = {r["loss"]: r for r in op_table(["smooth_svm", "noised_bal", "noised_imbal"], batch=3, n=n, k=3, path="cuda",
                                          conventions=conv)}
    assert ops["F.cross_entropy"]["launches"] <= 6
    for name, kernels in (("smooth_svm", 4), ("noised_bal", 4), ("noised_imbal", 4)):   # Triton: forward, finishing, gradient;
        # noised_imbal's margins are made when its class counts are set, not at each call
        assert ops[name]["triton"] == kernels and ops[name]["launches"] <= 7, ops[name]
        assert not ops[name]["syncing"]


def test_eager_kernels_skip_the_dispatcher_and_compile_keeps_the_operators():
    # eager: a module's kept plan calls one autograd node of its own (Svm32Loss, NoisedHingeLoss) and the functional
    # forms the operators' Python functions under their autograd formulas, so no custom operator is dispatched; the
    # operators, called through the dispatcher, launch the same kernels and give the same value and gradient
    from topk_nb.base.core import force_sync_free
    from topk_nb.ops.launch import _LEAN, _LEAN_LOSS, HAS_TRITON, force_triton
    from topk_nb.ops.svm import smooth_svm_fused, smooth_svm_triton
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    rows = {r["loss"]: r for r in bench.host_table(["smooth_svm", "noised_bal", "noised_imbal"])}
    for name in ("smooth_svm", "noised_bal", "noised_imbal"):
        assert not rows[name]["dispatched"] and rows[name]["launches"] == 4, rows[name]
        assert rows[name]["kernels"] + rows[name]["launches"] <= rows["F.cross_entropy"]["kernels"] + 4, rows[name]
    g = torch.Generator().manual_seed(0)
    s, y = torch.randn(6, 40, generator=g), torch.randint(0, 40, (6,), generator=g)
    xf = s.clone().requires_grad_()
    step = lambda: smooth_svm_triton(xf, y, 5, 1.0).sum().backward()
    kept, kept_loss = dict(_LEAN), dict(_LEAN_LOSS)
    with force_triton():
        direct = bench.host_work(step)
        _LEAN.clear()
        _LEAN_LOSS.clear()
        try:
            through = bench.host_work(step)
        finally:
            _LEAN.update(kept)
            _LEAN_LOSS.update(kept_loss)
    assert not direct["dispatched"] and sum(through["dispatched"].values()) == 2, (direct, through)
    assert through["launches"] == direct["launches"] == 3, (direct, through)   # rows of one tile: the tile kernel, the
                                                                                # backward's two
    crit = bench.get_loss("smooth_svm", k=3)
    x1, x2 = s.clone().requires_grad_(), s.clone().requires_grad_()
    with force_sync_free(), force_triton():
        loss = crit(x1, y)                                             # the kept plan's node
        loss.backward()
    _LEAN.clear()
    _LEAN_LOSS.clear()
    try:
        with force_triton():                                           # the operators, through the dispatcher
            out, _, _ = smooth_svm_fused(x2, y, 3, crit.tau, crit.alpha, None, -100, "mean")
            out.backward()
    finally:
        _LEAN.update(kept)
        _LEAN_LOSS.update(kept_loss)
    torch.testing.assert_close(loss, out); torch.testing.assert_close(x1.grad, x2.grad)
