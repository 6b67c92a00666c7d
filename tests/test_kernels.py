"""The fused Triton kernels (topk_nb.kernels) on small shapes against PyTorch references; without a GPU they
run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
import pytest
import torch
import torch.nn.functional as F

kernels = pytest.importorskip("topk_nb.kernels")
if not kernels.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from topk_nb.noised import noised_bal, noised_imbal, margins_from_counts  # noqa: E402


@pytest.mark.parametrize("n, k, samples", [(2, 1, 3), (13, 2, 2), (64, 5, 3), (257, 9, 2)])
def test_kernel_is_topk_of_the_given_noise(n, k, samples):
    g = torch.Generator().manual_seed(n)
    s, z = 3 * torch.randn(4, n, generator=g), torch.randn(samples, 4, n, generator=g)
    mean, idx = kernels.perturbed_kth_triton(s, k, 0.7, samples, noise=z)
    ref = (s + 0.7 * z).topk(k, dim=-1)
    torch.testing.assert_close(mean, ref.values[..., -1].mean(0), rtol=1e-6, atol=1e-6)
    assert torch.equal(idx, ref.indices[..., -1])


def test_kernel_draws_follow_the_seed():
    s = torch.randn(3, 20)
    a = kernels.perturbed_kth_triton(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(7))
    b = kernels.perturbed_kth_triton(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(7))
    c = kernels.perturbed_kth_triton(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])


@pytest.mark.parametrize("imbalanced", [False, True])
def test_noised_losses_use_the_kernel_and_its_gradient(imbalanced):
    g = torch.Generator().manual_seed(3)
    s, y = torch.randn(8, 30, generator=g, dtype=torch.float64), torch.randint(0, 30, (8,), generator=g)
    counts = torch.randint(1, 50, (30,), generator=g)
    x = s.clone().requires_grad_()
    with kernels.force_triton():
        if imbalanced:
            loss = noised_imbal(x, y, counts, k=3, epsilon=0.4, n_samples=5, scale=2.0, reduction="sum",
                                     generator=torch.Generator().manual_seed(1))
        else:
            loss = noised_bal(x, y, k=3, epsilon=0.4, n_samples=5, reduction="sum",
                                   generator=torch.Generator().manual_seed(1))
    loss.backward()
    mean, idx = kernels.perturbed_kth_triton(s, 4, 0.4, 5, generator=torch.Generator().manual_seed(1))
    margin, scale = (margins_from_counts(counts)[y], 2.0) if imbalanced else (1.0, 1.0)
    hinge = margin + mean.double() - s.gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(loss, scale * F.relu(hinge).sum())
    expected = F.one_hot(idx, 30).double().mean(0) - F.one_hot(y, 30).double()
    torch.testing.assert_close(x.grad, scale * (hinge > 0).double()[:, None] * expected)


def test_rows_too_long_or_k_too_large_take_the_pytorch_path():
    with kernels.force_triton():
        assert kernels.triton_ok(torch.zeros(2, kernels.MAX_ROW), kernels.MAX_KTH)
        assert not kernels.triton_ok(torch.zeros(2, kernels.MAX_ROW + 1), 1)
        assert not kernels.triton_ok(torch.zeros(2, 10), kernels.MAX_KTH + 1)
    assert not kernels.triton_ok(torch.zeros(2, 10), 1)           # CPU tensors outside force_triton
