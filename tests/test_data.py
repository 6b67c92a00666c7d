"""Data sets (topk_nb.training.data): fabricated trees in the real on-disk formats, loaded through the real code paths."""
import math
import pickle

import pytest
import torch
from hypothesis import given, strategies as st
from torchvision.datasets import CIFAR100, ImageFolder

from topk_nb.base.core import topk_accuracy
from topk_nb.training.data import (DATA_ENV, DATASETS, Cutout, DataBundle, DataError, cifar100, cifar100_label_maps, cifar100_lt,
                          cifar_transforms, circles, circles_posterior, class_counts, fake_cifar100,
                          fake_image_folder, fake_imagenet_lt, get_dataset, imagenet_lt, imagenet_subset,
                          long_tail_counts, make_loader, mixup, per_class_indices, plantnet300k, sample_circles,
                          shot_groups, split_indices, superclass_noise, synthetic_images)


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    return fake_cifar100(tmp_path_factory.mktemp("cifar"), n_train=1000, n_test=200, seed=7)


def _raw(root, split):
    with open(root / "cifar-100-python" / split, "rb") as f:
        return pickle.load(f, encoding="latin1")


# ---------------------------------------------------------------- fabricated CIFAR-100 and the real reader

def test_fake_cifar100_is_read_by_torchvision(cifar_root):
    # torchvision's own reader (md5 check off: the files are fabricated) sees the fabricated labels and images
    class Unverified(CIFAR100):
        train_list = [["train", None]]
        test_list = [["test", None]]
        meta = {**CIFAR100.meta, "md5": None}
    ds = Unverified(cifar_root, train=True)
    raw = _raw(cifar_root, "train")
    assert ds.targets == raw["fine_labels"] and len(ds) == 1000 and ds.data.shape == (1000, 32, 32, 3)
    assert ds.classes == [f"fine_{i:02d}" for i in range(100)]
    img, y = ds[0]
    assert img.size == (32, 32) and y == raw["fine_labels"][0]


def test_label_maps_read_from_the_files(cifar_root):
    f2c, fine, coarse = cifar100_label_maps(cifar_root)
    raw = _raw(cifar_root, "train")
    assert torch.equal(f2c[torch.tensor(raw["fine_labels"])], torch.tensor(raw["coarse_labels"]))
    assert torch.bincount(f2c).tolist() == [5] * 20 and len(fine) == 100 and len(coarse) == 20
    assert not torch.equal(f2c, torch.arange(100) // 5)          # the fabricated grouping is not the index order


def test_label_maps_refuse_inconsistent_files(tmp_path):
    root = fake_cifar100(tmp_path, n_train=200, n_test=10)
    raw = _raw(root, "train")
    raw["coarse_labels"][0] = (raw["coarse_labels"][0] + 1) % 20
    with open(root / "cifar-100-python" / "train", "wb") as f:
        pickle.dump(raw, f, protocol=2)
    with pytest.raises(ValueError, match="not a function of the fine labels"):
        cifar100_label_maps(root)


# ---------------------------------------------------------------- superclass noise

@given(p=st.sampled_from([0.0, 0.1, 0.3, 0.7, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_superclass_noise_properties(p, seed):
    g = torch.Generator().manual_seed(seed)
    f2c = torch.empty(100, dtype=torch.long)
    f2c[torch.randperm(100, generator=g)] = torch.arange(100) // 5
    y = torch.randint(0, 100, (20000,), generator=g)
    noisy, res = superclass_noise(y, f2c, p, torch.Generator().manual_seed(seed))
    n = len(y)
    assert abs(res.double().mean().item() - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12
    changed = (noisy != y).double().mean().item()
    assert abs(changed - 0.8 * p) <= 5 * math.sqrt(0.8 * p * (1 - 0.8 * p) / n) + 1e-12
    assert torch.equal(f2c[noisy], f2c[y]) and torch.equal(noisy[~res], y[~res])
    perfect = (f2c[None, :] == f2c[y][:, None]).float()      # predicts the 5 fine labels of the clean coarse class
    assert topk_accuracy(perfect, noisy, k=5)[5] == 1.0
    again = superclass_noise(y, f2c, p, torch.Generator().manual_seed(seed))
    assert torch.equal(again[0], noisy) and torch.equal(again[1], res)


def test_superclass_noise_is_uniform_within_the_group_and_nested():
    f2c = torch.arange(10) % 2                                   # two groups of 5: {0,2,4,6,8}, {1,3,5,7,9}
    y = torch.zeros(50000, dtype=torch.long)
    low, res_low = superclass_noise(y, f2c, 0.3, torch.Generator().manual_seed(0))
    high, res_high = superclass_noise(y, f2c, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(high, minlength=10).double() / len(y)
    assert torch.all(freq[1::2] == 0)
    assert (freq[0::2] - 0.2).abs().max() < 5 * math.sqrt(0.16 / len(y))
    assert (res_low <= res_high).all() and torch.equal(low[res_low], high[res_low])


def test_superclass_noise_bad_input():
    f2c = torch.arange(100) // 5
    with pytest.raises(ValueError, match=r"p must be a finite number in \[0.0, 1.0\]"):
        superclass_noise(torch.zeros(3, dtype=torch.long), f2c, 1.01)
    with pytest.raises(ValueError, match=r"fine labels in \[0, 99\]"):
        superclass_noise(torch.tensor([100]), f2c, 0.5)


# ---------------------------------------------------------------- the cifar100 builder

def test_cifar100_bundle(cifar_root):
    b = cifar100(cifar_root, noise_p=0.5, seed=1, val_size=100, check_md5=False)
    assert isinstance(b, DataBundle) and b.sizes() == {"train": 900, "val": 100, "test": 200}
    assert b.n_classes == 100 and b.input_shape == (3, 32, 32) and len(b.classes) == 100
    assert not set(b.train.indices.tolist()) & set(b.val.indices.tolist())
    assert sorted(b.train.indices.tolist() + b.val.indices.tolist()) == list(range(1000))
    raw_train, raw_test = _raw(cifar_root, "train"), _raw(cifar_root, "test")
    clean = torch.tensor(raw_train["fine_labels"])
    assert torch.equal(b.info["clean_train_targets"], clean[b.train.indices])
    assert torch.equal(b.val.targets, clean[b.val.indices])                 # validation stays clean by default
    assert torch.equal(b.test.targets, torch.tensor(raw_test["fine_labels"]))
    assert torch.equal(b.fine_to_coarse[b.train.targets], b.fine_to_coarse[clean[b.train.indices]])
    assert abs(b.info["resampled"].double().mean().item() - 0.5) < 5 * math.sqrt(0.25 / 900)
    assert torch.equal(b.class_counts, class_counts(b.train.targets, 100)) and b.class_counts.sum() == 900
    x, y = b.train[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == int(b.train.targets[3])
    xt, _ = b.test[0]                                                      # test: normalised, no augmentation
    raw_img = torch.tensor(raw_test["data"][0], dtype=torch.float32).reshape(3, 32, 32) / 255
    mean, std = torch.tensor(cifar_transforms(False).transforms[-1].mean), torch.tensor(cifar_transforms(False).transforms[-1].std)
    torch.testing.assert_close(xt, (raw_img - mean[:, None, None]) / std[:, None, None])


def test_cifar100_noisy_val_and_determinism(cifar_root):
    a = cifar100(cifar_root, noise_p=1.0, seed=2, val_size=100, noisy_val=True, check_md5=False)
    b = cifar100(cifar_root, noise_p=1.0, seed=2, val_size=100, noisy_val=True, check_md5=False)
    c = cifar100(cifar_root, noise_p=1.0, seed=3, val_size=100, noisy_val=True, check_md5=False)
    assert torch.equal(a.train.targets, b.train.targets) and torch.equal(a.val.targets, b.val.targets)
    assert not torch.equal(a.train.targets, c.train.targets)
    assert torch.equal(a.train.indices, c.train.indices)                  # the split follows split_seed only
    clean = torch.tensor(_raw(cifar_root, "train")["fine_labels"])
    assert (a.val.targets != clean[a.val.indices]).any()
    d = cifar100(cifar_root, val_size=100, split_seed=1, check_md5=False)
    assert not torch.equal(a.val.indices, d.val.indices)
    assert torch.equal(d.train.targets, clean[d.train.indices])           # p = 0: the original labels


def test_cifar100_consecutive_groups_reproduce_the_released_code(cifar_root):
    b = cifar100(cifar_root, noise_p=1.0, val_size=0, noise_groups="consecutive", check_md5=False)
    assert b.val is None
    assert torch.equal(b.train.targets // 5, b.info["clean_train_targets"] // 5)
    with pytest.raises(ValueError, match="has no 'val' split"):
        b.dataset("val")


def test_cifar100_augmentation_keeps_the_label(cifar_root):
    b = cifar100(cifar_root, noise_p=1.0, val_size=100, cutout=8, check_md5=False)
    torch.manual_seed(0)
    views = [b.train[5] for _ in range(6)]
    assert len({y for _, y in views}) == 1
    assert any(not torch.equal(views[0][0], x) for x, _ in views[1:])
    assert isinstance(b.train.transform.transforms[-1], Cutout)


def test_cifar100_errors(cifar_root, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar-100-python/\{train,test,meta\}"):
        cifar100(tmp_path / "missing")
    with pytest.raises(DataError, match="official checksums"):
        cifar100(cifar_root)                                       # fabricated files fail the md5 check
    with pytest.raises(ValueError, match="noise_p must be a finite number"):
        cifar100(cifar_root, noise_p=2.0, check_md5=False)
    with pytest.raises(ValueError, match="noise_groups must be"):
        cifar100(cifar_root, noise_groups="random", check_md5=False)
    with pytest.raises(ValueError, match=r"val_size must be an integer in \[0, 999\]"):
        cifar100(cifar_root, val_size=1000, check_md5=False)
    b = cifar100(cifar_root, val_size=100, check_md5=False)
    with pytest.raises(ValueError, match="split must be one of"):
        b.loader("validation", 4)


@pytest.mark.parametrize("name, content, expected", [
    ("train", b"\x80\x04 not a pickle", "train is not a CIFAR-100 python pickle (UnpicklingError"),
    ("train", pickle.dumps({"labels": [1]}), "train is a pickle without the entries data, fine_labels"),
    ("test", b"", "test is not a CIFAR-100 python pickle (EOFError"),
    ("meta", pickle.dumps([1, 2]), "meta is a pickle without the entries fine_label_names"),
])
def test_cifar100_damaged_files_are_named(cifar_root, tmp_path, name, content, expected):
    import shutil
    root = tmp_path / "bad"
    shutil.copytree(cifar_root, root)
    (root / "cifar-100-python" / name).write_bytes(content)
    with pytest.raises(DataError, match="official checksums"):
        cifar100(root)
    with pytest.raises(DataError) as info:
        cifar100(root, check_md5=False)
    assert str(info.value).startswith(f"cifar100: {root / 'cifar-100-python' / name} ")
    assert expected in str(info.value) and "replace it by the original file" in str(info.value)


def test_split_indices():
    tr, va = split_indices(50, 10, seed=3)
    assert len(va) == 10 and sorted(tr.tolist() + va.tolist()) == list(range(50))
    assert torch.equal(split_indices(50, 10, seed=3)[1], va) and not torch.equal(split_indices(50, 10, seed=4)[1], va)


# ---------------------------------------------------------------- Cutout and Mixup

def test_cutout_hole():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = Cutout(8, g)(torch.ones(3, 32, 32))
        zero = out[0] == 0
        rows, cols = zero.any(1).nonzero()[:, 0], zero.any(0).nonzero()[:, 0]
        assert zero.sum() == len(rows) * len(cols) and 1 <= len(rows) <= 8 and 1 <= len(cols) <= 8
        assert torch.equal(out[1] == 0, zero) and (out[~zero.expand(3, -1, -1)] == 1).all()
    g = torch.Generator().manual_seed(1)
    sides = set()
    for _ in range(300):                     # away from the borders the hole is a full 8 x 8 square
        zero = Cutout(8, g)(torch.ones(1, 32, 32))[0] == 0
        rows, cols = zero.any(1).nonzero()[:, 0], zero.any(0).nonzero()[:, 0]
        if 0 < rows.min() and rows.max() < 31 and 0 < cols.min() and cols.max() < 31:
            sides.add((len(rows), len(cols)))
    assert sides == {(8, 8)}
    with pytest.raises(ValueError, match=r"size must be an integer in \[1, inf\]"):
        Cutout(0)


def test_mixup_formula_and_soft_targets():
    x = torch.arange(6.0)[:, None].repeat(1, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    xm, t = mixup(x, y, 3, lam=0.25, generator=torch.Generator().manual_seed(1))
    partner = ((xm[:, 0] - 0.25 * x[:, 0]) / 0.75).round().long()
    assert sorted(partner.tolist()) == list(range(6))
    torch.testing.assert_close(xm, 0.25 * x + 0.75 * x[partner])
    expected = 0.25 * torch.eye(3)[y] + 0.75 * torch.eye(3)[y[partner]]
    torch.testing.assert_close(t, expected)
    torch.testing.assert_close(t.sum(1), torch.ones(6))
    a = mixup(x, y, 3, 0.3, torch.Generator().manual_seed(9))
    b = mixup(x, y, 3, 0.3, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_mixup_bad_input():
    x, y = torch.zeros(4, 2), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"labels in \[0, 2\]"):
        mixup(x, y, 3)
    with pytest.raises(ValueError, match="4 integer labels"):
        mixup(x, y.float(), 4)
    with pytest.raises(ValueError, match="alpha must be"):
        mixup(x, y, 4, alpha=-0.5)
    with pytest.raises(ValueError, match="lam must be"):
        mixup(x, y, 4, lam=1.5)


# ---------------------------------------------------------------- long tail

def test_long_tail_counts_standard_totals():
    assert [long_tail_counts(100, 500, r).sum().item() for r in (100, 50, 10)] == [10847, 12608, 19573]
    assert long_tail_counts(10, 1000, 10).tolist() == [int(1000 * 0.1 ** (i / 9)) for i in range(10)]
    with pytest.raises(ValueError, match="imbalance_ratio must be"):
        long_tail_counts(10, 100, 0.9)


def test_cifar100_lt(cifar_root):
    b = cifar100_lt(cifar_root, imbalance_ratio=5, val_per_class=2, seed=1, check_md5=False)
    assert torch.equal(b.class_counts, long_tail_counts(100, 8, 5))         # 10 images per class, 2 held out
    assert torch.equal(class_counts(b.val.targets, 100), torch.full((100,), 2))
    assert not set(b.train.indices.tolist()) & set(b.val.indices.tolist())
    assert b.sizes()["test"] == 200
    again = cifar100_lt(cifar_root, imbalance_ratio=5, val_per_class=2, seed=1, check_md5=False)
    other = cifar100_lt(cifar_root, imbalance_ratio=5, val_per_class=2, seed=2, check_md5=False)
    assert torch.equal(again.train.indices, b.train.indices) and not torch.equal(other.train.indices, b.train.indices)
    in_order = cifar100_lt(cifar_root, imbalance_ratio=5, seed=None, n_max=6, check_md5=False)
    first = per_class_indices(torch.tensor(_raw(cifar_root, "train")["fine_labels"]), 100)
    expected = torch.cat([f[:int(k)] for f, k in zip(first, long_tail_counts(100, 6, 5))])
    assert torch.equal(in_order.train.indices, expected)
    with pytest.raises(ValueError, match="leaves no training image"):
        cifar100_lt(cifar_root, val_per_class=10, check_md5=False)
    with pytest.raises(ValueError, match=r"n_max must be an integer in \[1, 10\]"):
        cifar100_lt(cifar_root, n_max=11, check_md5=False)


# ---------------------------------------------------------------- ImageFolder data sets

@pytest.fixture(scope="module")
def imagenet_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    fake_image_folder(root / "train", 3, [24, 30, 27], size=(22, 20))
    fake_image_folder(root / "val", 3, 2, size=(22, 20), seed=1)
    return root


def test_fake_image_folder_is_an_imagefolder(imagenet_root):
    ds = ImageFolder(imagenet_root / "train")
    assert ds.classes == ["n00000000", "n00000001", "n00000002"] and len(ds) == 81
    assert ds[0][0].size == (22, 20) and ds[0][0].mode == "RGB"


def test_imagenet_subsets_balanced_and_nested(imagenet_root):
    kw = dict(val_per_class=4, image_size=16, resize=18)
    subsets = {f: imagenet_subset(imagenet_root, fraction=f, **kw) for f in (0.05, 0.1, 0.25, 0.5, 1.0)}
    for f, b in subsets.items():
        if f < 1:
            assert torch.equal(b.class_counts, torch.full((3,), math.floor(f * 81 / 3)))
        assert torch.equal(class_counts(b.val.targets, 3), torch.full((3,), 4))
        assert torch.equal(b.val.indices, subsets[1.0].val.indices)
        assert not set(b.train.indices.tolist()) & set(b.val.indices.tolist())
    order = sorted(subsets)
    for small, large in zip(order, order[1:]):
        assert set(subsets[small].train.indices.tolist()) < set(subsets[large].train.indices.tolist())
    assert subsets[1.0].class_counts.tolist() == [20, 26, 23]
    assert subsets[1.0].test.targets.tolist() == [0, 0, 1, 1, 2, 2]
    assert subsets[0.5].train[0][0].shape == (3, 16, 16) and subsets[0.5].test[0][0].shape == (3, 16, 16)
    other = imagenet_subset(imagenet_root, fraction=0.25, seed=1, **kw)
    assert not torch.equal(other.val.indices, subsets[0.25].val.indices)


def test_imagenet_subset_errors(imagenet_root, tmp_path):
    with pytest.raises(ValueError, match=r"fraction must be a finite number in \(0.0, 1.0\]"):
        imagenet_subset(imagenet_root, fraction=1.5)
    with pytest.raises(ValueError, match="keeps no image per class"):
        imagenet_subset(imagenet_root, fraction=0.02)
    with pytest.raises(ValueError, match="fewer than the 26 needed"):
        imagenet_subset(imagenet_root, val_per_class=25)
    with pytest.raises(FileNotFoundError, match=r"train/<wnid>/\*\.JPEG"):
        imagenet_subset(tmp_path)
    fake_image_folder(tmp_path / "train", 2, 2)
    with pytest.raises(FileNotFoundError, match=r"val .*not found"):
        imagenet_subset(tmp_path)


def test_plantnet300k(tmp_path):
    images = tmp_path / "plantnet_300K" / "images"
    species = ["1355932", "1355936", "1356257"]
    fake_image_folder(images / "train", species, [6, 3, 1])
    fake_image_folder(images / "val", species, [1, 1, 1], seed=1)
    fake_image_folder(images / "test", species[:2], [2, 1], seed=2)
    b = plantnet300k(tmp_path / "plantnet_300K", image_size=12, resize=14)
    assert b.class_counts.tolist() == [6, 3, 1] and b.classes == species and b.n_classes == 3
    assert b.test.targets.tolist() == [0, 0, 1] and b.sizes() == {"train": 10, "val": 3, "test": 3}
    assert b.train[0][0].shape == (3, 12, 12)
    fake_image_folder(images / "test", ["9999999"], [1], seed=3)
    with pytest.raises(ValueError, match="not classes of the training split"):
        plantnet300k(images)
    with pytest.raises(FileNotFoundError, match=r"images/\{train,val,test\}"):
        plantnet300k(tmp_path / "elsewhere")


def test_imagenet_lt(tmp_path):
    root = fake_imagenet_lt(tmp_path / "imagenet", train_counts=(9, 4, 2), n_val_per_class=1, n_test_per_class=2)
    b = imagenet_lt(root, image_size=12, resize=14)
    assert b.class_counts.tolist() == [9, 4, 2] and b.n_classes == 3
    assert b.sizes() == {"train": 15, "val": 3, "test": 6}
    lines = (root / "ImageNet_LT_test.txt").read_text().splitlines()
    assert b.test.samples[0] == (lines[0].split()[0], int(lines[0].split()[1]))
    assert all(p.startswith("val/") for p, _ in b.test.samples) and all(p.startswith("train/") for p, _ in b.val.samples)
    assert not {p for p, _ in b.train.samples} & {p for p, _ in b.val.samples}
    assert b.train[0][0].shape == (3, 12, 12)
    (root / "ImageNet_LT_val.txt").write_text("train/n00000000/0000.jpg\n")
    with pytest.raises(ValueError, match=r"ImageNet_LT_val.txt:1: expected 'relative/path label'"):
        imagenet_lt(root)
    with pytest.raises(FileNotFoundError, match=r"ImageNet_LT_\{train,val,test\}.txt"):
        imagenet_lt(tmp_path / "none")


def test_shot_groups():
    groups = shot_groups(torch.tensor([1280, 101, 100, 20, 19, 5]))
    assert groups["many"].tolist() == [True, True, False, False, False, False]
    assert groups["medium"].tolist() == [False, False, True, True, False, False]
    assert groups["few"].tolist() == [False, False, False, False, True, True]


# ---------------------------------------------------------------- circles

def test_circles_protocol_defaults():
    b = circles()
    assert b.sizes() == {"train": 1800, "val": None, "test": 1800} and b.n_classes == 6 and b.input_shape == (2,)
    assert b.class_counts.tolist() == [300] * 6
    assert torch.equal(b.test.targets, torch.arange(6).repeat_interleave(300))
    torch.testing.assert_close(b.train.tensors[0].norm(dim=1), torch.ones(1800))
    assert torch.equal(circles(seed=0).train.tensors[0], b.train.tensors[0])
    assert not torch.equal(circles(seed=1).train.tensors[0], b.train.tensors[0])


@pytest.mark.parametrize("sigma", [10.0, 30.0])
def test_circles_angle_statistics(sigma):
    pts, y = sample_circles(4000, sigma=sigma, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    angle = torch.rad2deg(torch.atan2(pts[:, 1], pts[:, 0]))
    for c in range(6):
        d = (angle[y == c] - 60.0 * c + 180) % 360 - 180
        assert abs(d.mean().item()) < 4 * sigma / math.sqrt(4000)
        assert abs(d.std().item() / sigma - 1) < 0.08


def test_circles_minor_mode():
    pts, y, minor = sample_circles(6000, sigma=10.0, minor_shift=45.0, generator=torch.Generator().manual_seed(4),
                                   return_mode=True)
    assert abs(minor.double().mean().item() - 1 / 3) < 4 * math.sqrt(2 / 9 / 36000)
    angle = torch.rad2deg(torch.atan2(pts[:, 1].double(), pts[:, 0].double()))
    for c in range(6):
        d = (angle[(y == c) & minor] - 60.0 * c - 45.0 + 180) % 360 - 180
        assert abs(d.mean().item()) < 1.0
    # without a minor mode, no point is marked minor
    assert not sample_circles(10, return_mode=True)[2].any()


def test_circles_posterior_matches_a_direct_density():
    # independent formula at three hand-picked angles: two wrapped normals per class, weights 2/3 and 1/3
    sigma, d = 15.0, 90.0
    angles = torch.tensor([0.0, 75.0, 200.0], dtype=torch.float64)
    pts = torch.stack([torch.deg2rad(angles).cos(), torch.deg2rad(angles).sin()], 1)
    def phi(delta):
        return sum(math.exp(-0.5 * ((delta + 360 * j) / sigma) ** 2) for j in (-2, -1, 0, 1, 2))
    expected = torch.tensor([[2 / 3 * phi(a - 60 * c) + 1 / 3 * phi(a - 60 * c - d) for c in range(6)]
                             for a in angles.tolist()], dtype=torch.float64)
    expected /= expected.sum(1, keepdim=True)
    torch.testing.assert_close(circles_posterior(pts, sigma, d), expected)
    with pytest.raises(ValueError, match="sigma must be"):
        circles_posterior(pts, -1.0)


def test_circles_errors():
    with pytest.raises(ValueError, match="sigma must be"):
        circles(sigma=0.0)
    with pytest.raises(ValueError, match=r"n_per_class must be an integer in \[1, inf\]"):
        circles(n_per_class=0)


# ---------------------------------------------------------------- synthetic images

def test_synthetic_images_shapes_and_determinism():
    b = synthetic_images(n_classes=4, n_per_class=5, n_val_per_class=2, n_test_per_class=3, seed=2)
    assert b.sizes() == {"train": 20, "val": 8, "test": 12} and b.input_shape == (3, 32, 32)
    assert b.train.targets.tolist() == [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5
    assert [b.train[i][1] for i in range(20)] == b.train.targets.tolist()
    x = b.train[6][0]
    assert x.shape == (3, 32, 32) and torch.equal(x, b.train[6][0]) and torch.equal(x, b.train[-14][0])
    again = synthetic_images(n_classes=4, n_per_class=5, n_val_per_class=2, n_test_per_class=3, seed=2)
    assert torch.equal(again.train[6][0], x) and not torch.equal(b.val[6][0], x)
    assert not torch.equal(synthetic_images(n_classes=4, n_per_class=5, seed=3).train[6][0], x)
    with pytest.raises(IndexError):
        b.train[20]
    big = synthetic_images(n_classes=1000, n_per_class=1281, image_size=224, n_val_per_class=0, n_test_per_class=0)
    assert len(big.train) == 1_281_000 and big.train[1_280_999][0].shape == (3, 224, 224)
    assert big.train[1_280_999][1] == 999 and big.val is None and big.test is None


def test_synthetic_images_are_learnable():
    b = synthetic_images(n_classes=5, n_per_class=20, n_test_per_class=20, n_val_per_class=0, image_size=16)
    xs = torch.stack([b.train[i][0] for i in range(len(b.train))]).flatten(1)
    means = torch.stack([xs[b.train.targets == c].mean(0) for c in range(5)])
    xt = torch.stack([b.test[i][0] for i in range(len(b.test))]).flatten(1)
    assert topk_accuracy(-torch.cdist(xt, means), b.test.targets, k=1)[1] > 0.9


def test_synthetic_images_long_tail():
    b = synthetic_images(n_classes=6, n_per_class=50, imbalance_ratio=10.0)
    assert torch.equal(b.class_counts, long_tail_counts(6, 50, 10.0))
    assert torch.equal(class_counts(b.train.targets, 6), b.class_counts)


# ---------------------------------------------------------------- loaders and the registry

def test_make_loader_seeded_order():
    ds = torch.utils.data.TensorDataset(torch.arange(30))
    def order(seed):
        return torch.cat([b[0] for b in make_loader(ds, 7, shuffle=True, seed=seed)]).tolist()
    assert order(5) == order(5) and order(5) != order(6) and sorted(order(5)) == list(range(30))
    with pytest.raises(ValueError, match=r"num_workers must be an integer in \[0, inf\]"):
        make_loader(ds, 4, num_workers=-1)


def test_bundle_loader_with_workers():
    b = synthetic_images(n_classes=3, n_per_class=4, n_val_per_class=0, n_test_per_class=0)
    batches = [yb.tolist() for _, yb in b.loader("train", batch_size=4, seed=1, num_workers=2)]
    again = [yb.tolist() for _, yb in b.loader("train", batch_size=4, seed=1, num_workers=2)]
    assert batches == again and sorted(sum(batches, [])) == b.train.targets.tolist()


def test_registry(cifar_root, monkeypatch):
    assert list(DATASETS) == ["cifar100", "cifar100_lt", "imagenet_subset", "plantnet300k", "imagenet_lt",
                              "circles", "synthetic_images"]
    assert torch.equal(get_dataset("circles", sigma=20.0, seed=4).train.tensors[0],
                       circles(sigma=20.0, seed=4).train.tensors[0])
    with pytest.raises(ValueError, match="unknown dataset 'cifar10'; available: cifar100, cifar100_lt"):
        get_dataset("cifar10")
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['p'\]"):
        get_dataset("cifar100", p=0.2)
    monkeypatch.delenv(DATA_ENV, raising=False)
    with pytest.raises(ValueError, match="pass root=... or set the TOPK_NB_DATA environment variable"):
        get_dataset("imagenet_subset")
    monkeypatch.setenv(DATA_ENV, str(cifar_root))
    b = get_dataset("cifar100", noise_p=0.2, val_size=50, check_md5=False)
    assert b.sizes() == {"train": 950, "val": 50, "test": 200}
