"""The sync-free path of every registered loss, checked on a CPU: no operator that reads a value back to the
host (what would synchronise a GPU), and `torch.compile(fullgraph=True)` traces forward and backward and
equals eager mode."""
import pytest
import torch
import torch._inductor.config
from torch.utils._python_dispatch import TorchDispatchMode

from topk_nb.base.core import force_sync_free
from topk_nb.loss.registry import LOSSES, get_loss

# aten operators that read device memory back to the host, or whose output shape depends on the data
READ_BACK = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
             "unique_dim", "is_nonzero", "equal", "allclose"}


class ReadBackOps(TorchDispatchMode):
    "Collects the aten operators dispatched inside it that read back to the host (boolean-mask indexing included)."

    def __init__(self):
        super().__init__()
        self.found, self.count = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.count += 1
        if name in READ_BACK:
            self.found.append(name)
        if name in ("index", "index_put", "index_put_") and len(args) > 1:
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
                self.found.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


def build(name, **kw):
    entry = LOSSES[name]
    if entry.needs_class_counts: kw["class_counts"] = torch.arange(1, 41)
    return get_loss(name, check_finite=False, **kw)


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(16, 40, generator=g), torch.randint(0, 40, (16,), generator=g)


def test_the_detector_sees_read_backs():
    x = torch.randn(5)
    with ReadBackOps() as ops:
        x[x > 0].sum().item()
    assert "index with a boolean mask" in ops.found and "_local_scalar_dense" in ops.found


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("targets", ["indices", "probabilities"])
def test_no_read_back_on_the_sync_free_path(name, targets):
    s, y = problem(1)
    t = y if targets == "indices" else 0.7 * torch.eye(40)[y] + 0.3 * torch.eye(40)[(y + 1) % 40]
    crit = build(name, max_support=2) if targets == "probabilities" else build(name)
    x = s.clone().requires_grad_()
    with force_sync_free(), ReadBackOps() as ops:
        crit(x, t).backward()
    assert ops.found == [], f"{name}: {sorted(set(ops.found))}"
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", list(LOSSES))
def test_sync_free_path_equals_host_path(name):
    s, y = problem(2)
    if LOSSES[name].stochastic:
        pytest.skip("different routes draw different noise; both are checked against the exact law in test_perturbed")
    host, free = s.clone().requires_grad_(), s.clone().requires_grad_()
    build(name)(host, y).backward()
    with force_sync_free():
        loss = build(name)(free, y)
        loss.backward()
    torch.testing.assert_close(loss, build(name)(s, y))
    torch.testing.assert_close(free.grad, host.grad)


@pytest.mark.parametrize("name", list(LOSSES))
def test_compiles_as_one_graph_and_equals_eager(name):
    s, y = problem(3)
    crit = build(name)

    def run(fn):
        torch.manual_seed(0)
        x = s.clone().requires_grad_()
        loss = fn(x, y)
        loss.backward()
        return loss.detach(), x.grad

    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):     # compiled code draws eager's random numbers
        compiled = run(torch.compile(lambda x, t: crit(x, t), fullgraph=True))
    with force_sync_free():                                  # eager on the path that compiled code takes
        eager = run(lambda x, t: crit(x, t))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ce", "smooth_svm", "noised_bal", "topk_transition"])
def test_compiled_label_out_of_range_names_the_target(name):
    # compiled, a bad label meets the loss's own assert ("target must hold class indices in [0, n - 1]"), not the
    # generated code's index bounds check ("index out of bounds: 0 <= tmp6 < 40L")
    s, y = problem(4)
    y[3] = 40
    torch._dynamo.reset()
    compiled = torch.compile(build(name, ignore_index=-1), fullgraph=True)
    with pytest.raises(RuntimeError, match=r"class indices in \[0, 39\]|Target 40 is out of bounds"):
        compiled(s, y)
