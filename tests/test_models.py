"""Networks and the model registry (topk_nb.training.models): shapes, published parameter counts, heads, local weights."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from topk_nb.training.models import (INPUT_SHAPES, MODELS, CifarResNet, DenseNet, NormalisedLinear, circle_linear, circle_mlp,
                            count_parameters, densenet, densenet_bc, get_model, load_weights, set_head)


def meta_count(name, n_classes, **params):
    with torch.device("meta"):
        return count_parameters(get_model(name, n_classes, **params))


@pytest.mark.parametrize("family, depth, growth, published", [
    ("densenet", 40, 12, 1.0), ("densenet", 100, 12, 7.0), ("densenet", 100, 24, 27.2),
    ("densenet_bc", 100, 12, 0.8), ("densenet_bc", 250, 24, 15.3), ("densenet_bc", 190, 40, 25.6)])
def test_densenet_counts_match_huang_table_2(family, depth, growth, published):
    assert abs(meta_count(family, 10, depth=depth, growth=growth) / 1e6 - published) <= 0.05


def test_densenet_bc_count_by_hand():
    # DenseNet-BC 40-12, 100 classes: stem 3*9*24; 6 bottleneck layers per block; transitions 96->48, 120->60
    def layer(m, k=12):
        return 2 * m + 4 * k * m + 8 * k + 36 * k * k
    total = 27 * 24
    total += sum(layer(24 + 12 * j) for j in range(6)) + 2 * 96 + 96 * 48
    total += sum(layer(48 + 12 * j) for j in range(6)) + 2 * 120 + 120 * 60
    total += sum(layer(60 + 12 * j) for j in range(6)) + 2 * 132 + 132 * 100 + 100
    assert meta_count("densenet40_12", 100) == total == 188_092
    assert meta_count("densenet40_40", 100) == meta_count("densenet_bc", 100, depth=40, growth=40) == 1_941_620


@pytest.mark.parametrize("name, n_classes, expected", [
    ("resnet18", 1000, 11_689_512), ("resnet34", 1000, 21_797_672), ("resnet50", 1000, 25_557_032),
    ("resnet50", 1081, 25_557_032 + 81 * 2049),
    # the CIFAR stem (3x3 conv, no max-pool) has 7*7*3*64 - 3*3*3*64 = 7680 fewer parameters
    ("cifar_resnet18", 10, 11_173_962), ("cifar_resnet18", 100, 11_689_512 - 7680 - 900 * 513),
    ("cifar_resnet34", 100, 21_797_672 - 7680 - 900 * 513),
    ("cifar_densenet121", 100, 7_978_856 - 9408 - 128 + 1728 - 900 * 1025),
    ("circle_linear", 6, 12), ("circle_mlp", 6, 72)])
def test_published_and_derived_counts(name, n_classes, expected):
    assert meta_count(name, n_classes) == expected


def test_cifar_resnet18_is_torchvision_with_the_cifar_stem():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ours = get_model("cifar_resnet18", 10).eval()
    theirs = torchvision.models.resnet18(weights=None, num_classes=10)
    theirs.conv1, theirs.maxpool = nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.Identity()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs.eval()(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["densenet_tiny", "densenet40_12", "cifar_resnet18", "circle_linear", "circle_mlp"])
def test_forward_shapes(name):
    torch.manual_seed(0)
    model = get_model(name, 7).eval()
    with torch.no_grad():
        assert model(torch.randn(2, *INPUT_SHAPES[name])).shape == (2, 7)


def test_torchvision_resnet_shape_on_a_small_image():
    with torch.no_grad():
        assert get_model("resnet18", 5).eval()(torch.randn(1, 3, 64, 64)).shape == (1, 5)


def test_densenet_layout_and_dropout():
    net = densenet_bc(100, 40, 12)
    assert net.num_features == 132                    # 24 + 72 -> 48, 48 + 72 -> 60, 60 + 72
    assert densenet(100, 40, 12).num_features == 16 + 3 * 12 * 12
    drop = densenet_bc(10, 10, 4, dropout=0.2)
    assert sum(isinstance(m, nn.Dropout) for m in drop.modules()) == 3 * 2 + 2   # two per layer, one per transition
    assert count_parameters(drop) == count_parameters(densenet_bc(10, 10, 4))


def test_channels_last_gives_the_same_outputs():
    torch.manual_seed(0)
    net, x = get_model("densenet_tiny", 10).eval(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = net(x)
        out_cl = net.to(memory_format=torch.channels_last)(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(out_cl, out, rtol=1e-5, atol=1e-5)


@given(scale=st.floats(0.1, 100.0), log_norm=st.floats(-6.0, 6.0), seed=st.integers(0, 2**31 - 1))
def test_normalised_head_is_a_bounded_cosine(scale, log_norm, seed):
    g = torch.Generator().manual_seed(seed)
    head = NormalisedLinear(6, 4, scale=scale).double()
    h = torch.randn(3, 6, generator=g, dtype=torch.float64) * 10.0 ** log_norm
    w = head.weight.detach()
    expected = scale * (h / h.norm(dim=1, keepdim=True)) @ (w / w.norm(dim=1, keepdim=True)).T
    out = head(h)
    torch.testing.assert_close(out, expected)
    assert out.abs().max() <= scale * (1 + 1e-12)
    assert head(2.0 * w[1:2])[0, 1].item() == pytest.approx(scale)


def test_normalised_head_on_a_network():
    torch.manual_seed(0)
    net = get_model("densenet_tiny", 10, head="normalised", scale=60).eval()
    assert isinstance(net.fc, NormalisedLinear) and net.fc.scale == 60.0 and net.fc.out_features == 10
    with torch.no_grad():
        assert net(100 * torch.randn(2, 3, 32, 32)).abs().max() <= 60.0
    assert get_model("circle_mlp", 6, head="normalized").fc.scale == 30.0      # default scale, both spellings
    with torch.device("meta"):
        assert isinstance(get_model("resnet50", 1081, head="normalised").fc, NormalisedLinear)


@pytest.mark.parametrize("name, head", [("densenet_tiny", "linear"), ("densenet_tiny", "normalised"),
                                        ("circle_mlp", "linear"), ("circle_linear", "linear")])
def test_gradients_reach_every_parameter(name, head):
    torch.manual_seed(0)
    model = get_model(name, 6, head=head)
    F.cross_entropy(model(torch.randn(2, *INPUT_SHAPES[name])), torch.tensor([0, 5])).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_circle_models_follow_sawada():
    torch.manual_seed(0)
    lin = circle_linear()
    assert lin.fc.bias is None and lin.fc.weight.shape == (6, 2)
    x, z = torch.randn(5, 2), torch.randn(5, 2)
    torch.testing.assert_close(lin(3 * x + z), 3 * lin(x) + lin(z))
    mlp = circle_mlp(hidden=16)
    assert mlp.fc.bias is None and mlp.hidden[0].bias is not None
    torch.testing.assert_close(mlp(x), (x @ mlp.hidden[0].weight.T + mlp.hidden[0].bias).relu() @ mlp.fc.weight.T)


def test_local_weights_round_trip(tmp_path):
    torch.manual_seed(0)
    src = get_model("densenet_tiny", 10).eval()
    torch.save(src.state_dict(), tmp_path / "w.pt")
    torch.manual_seed(1)
    dst = get_model("densenet_tiny", 10, weights=tmp_path / "w.pt").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))
    # a checkpoint with DDP / compile prefixes, a missing num_batches_tracked, under "state_dict"
    state = {"_orig_mod." + k: v for k, v in src.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save({"state_dict": state, "epoch": torch.tensor(3)}, tmp_path / "ckpt.pt")
    again = load_weights(get_model("densenet_tiny", 10), str(tmp_path / "ckpt.pt")).eval()
    with torch.no_grad():
        assert torch.equal(again(x), src(x))


def test_head_is_skipped_when_the_classes_differ(tmp_path):
    torch.manual_seed(0)
    src = get_model("densenet_tiny", 1000)
    torch.save(src.state_dict(), tmp_path / "imagenet.pt")
    dst = get_model("densenet_tiny", 7, head="normalised")
    fresh = dst.fc.weight.detach().clone()
    load_weights(dst, tmp_path / "imagenet.pt")
    assert torch.equal(dst.fc.weight, fresh)
    body = {k: v for k, v in src.state_dict().items() if not k.startswith("fc.")}
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in body.items())
    with pytest.raises(ValueError, match="does not fit the model's head"):
        load_weights(get_model("densenet_tiny", 7), tmp_path / "imagenet.pt", load_head=True)
    same = get_model("densenet_tiny", 1000)
    load_weights(same, tmp_path / "imagenet.pt", load_head=False)
    assert not torch.equal(same.fc.weight, src.fc.weight)


def test_weight_errors(tmp_path):
    torch.save(get_model("densenet_tiny", 10).state_dict(), tmp_path / "tiny.pt")
    with pytest.raises(ValueError, match=r"do not match DenseNet: 30 missing \(features.1.1.body.0.bias, .* and 25 more\)"):
        get_model("densenet_bc", 10, depth=16, growth=4, weights=tmp_path / "tiny.pt")
    torch.save(get_model("densenet_bc", 10, depth=16, growth=4).state_dict(), tmp_path / "deeper.pt")
    with pytest.raises(ValueError, match=r"do not match DenseNet: 36 unexpected"):
        get_model("densenet_tiny", 10, weights=tmp_path / "deeper.pt")
    with pytest.raises(ValueError, match=r"shapes differ for features.0.weight \(file \(8, 3, 3, 3\), model \(10, 3, 3, 3\)\)"):
        get_model("densenet_bc", 10, depth=10, growth=5, weights=tmp_path / "tiny.pt")
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        get_model("resnet18", 10, weights="IMAGENET1K_V1")
    with pytest.raises(TypeError, match="weights must be the path of a local file"):
        load_weights(get_model("densenet_tiny", 10), 42)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="could not read a state dict"):
        load_weights(get_model("densenet_tiny", 10), tmp_path / "junk.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="does not hold a state dict"):
        load_weights(get_model("densenet_tiny", 10), tmp_path / "list.pt")
    with pytest.raises(ValueError, match="load_head only applies when weights are given"):
        get_model("densenet_tiny", 10, load_head=False)


def test_registry_names_and_parameters():
    assert set(MODELS) == set(INPUT_SHAPES) >= {"densenet_bc", "densenet40_12", "densenet40_40", "densenet_tiny",
                                                "cifar_resnet18", "cifar_resnet34", "resnet18", "resnet34", "resnet50",
                                                "circle_linear", "circle_mlp"}
    with pytest.raises(ValueError, match=r"unknown model 'densenet40-40' \(did you mean 'densenet40_40'\?\); valid names: densenet"):
        get_model("densenet40-40", 100)
    with pytest.raises(ValueError, match="unknown model 3"):
        get_model(3, 100)
    with pytest.raises(TypeError, match="got unexpected parameter\\(s\\) depht; it accepts: depth, growth, compression, dropout"):
        get_model("densenet_bc", 100, depht=40)
    with pytest.raises(TypeError, match="accepts: none"):
        get_model("cifar_resnet18", 100, depth=18)
    with pytest.raises(ValueError, match="n_classes must be an integer in \\[1, inf\\]"):
        get_model("densenet_tiny", 0)
    with pytest.raises(TypeError, match="n_classes must be an integer"):
        get_model("densenet_tiny", 10.0)


@pytest.mark.parametrize("call, error, match", [
    (lambda: densenet_bc(10, depth=41), ValueError, r"depth must be 6N\+4 for a DenseNet-BC"),
    (lambda: densenet(10, depth=41), ValueError, r"depth must be 3N\+4 for a DenseNet "),
    (lambda: densenet_bc(10, depth=4), ValueError, r"depth must be an integer in \[10, inf\]"),
    (lambda: densenet_bc(10, growth=0), ValueError, "growth must be an integer in"),
    (lambda: densenet_bc(10, compression=1.5), ValueError, "compression must be a finite number in"),
    (lambda: densenet_bc(10, dropout=1.0), ValueError, r"dropout must be a probability in \[0, 1\)"),
    (lambda: DenseNet("666", 12, 10), TypeError, "block_layers must be a non-empty sequence"),
    (lambda: DenseNet([6], 12, 10, stem="big"), ValueError, "stem must be 'cifar'"),
    (lambda: CifarResNet([2, 2, 2], 10), TypeError, "blocks must be a sequence of four"),
    (lambda: circle_mlp(hidden=0), ValueError, "hidden must be an integer in"),
    (lambda: NormalisedLinear(4, 3, scale=-1.0), ValueError, "scale must be a finite number in"),
    (lambda: NormalisedLinear(4, 3, scale=math.inf), ValueError, "scale must be a finite number in"),
    (lambda: set_head(circle_mlp(), "cosine"), ValueError, "head must be one of"),
    (lambda: set_head(circle_mlp(), "linear", scale=30), ValueError, "scale only applies to head='normalised'"),
    (lambda: set_head(nn.Sequential(nn.Linear(2, 3)), "normalised"), TypeError, "last layer is a linear `fc`"),
])
def test_bad_configurations(call, error, match):
    with pytest.raises(error, match=match):
        call()


# The numbered parts of "Stochastic smoothing of the top-K calibrated hinge loss for deep imbalanced classification"
# (Garcin 2022): the final version (sections 1-5, appendices A-D) and the draft, which splits 4.5 into 4.5.1
# (Pl@ntNet-300K) and 4.5.2 (ImageNet-LT) and adds appendix E. Section 5 is the conclusion: no set-up is there.
GARCIN_SECTIONS = {"1", "2", "3", "3.1", "3.2", "3.3", "3.4", "4", "4.1", "4.2", "4.3", "4.4", "4.5", "4.5.1", "4.5.2",
                   "5", "A", "B", "B.1", "B.2", "B.3", "C", "D", "E"}


def garcin_citations(text: str) -> list[tuple[str, str]]:
    "(section, the line) for each section cited after 'Garcin 2022' on a line, up to the next paper's name."
    import re
    found = []
    for line in text.splitlines():
        for part in line.split("Garcin 2022")[1:]:
            part = re.split(r"Berrada|Sawada|Huang et al|He et al", part)[0]
            found += [(m, line.strip()[:120]) for m in re.findall(r"(?:§ ?|[Ss]ection |[Aa]ppendix )([A-E0-9](?:\.\d+)*)", part)]
    return found


def test_the_model_chapter_cites_sections_of_the_garcin_paper_that_exist():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    texts = {p: p.read_text(encoding="utf-8") for p in (root / "nbs" / "11_models.ipynb", root / "topk_nb" / "training" / "models.py")}
    cited = [(p.name, s, line) for p, text in texts.items() for s, line in garcin_citations(text)]
    assert {s for _, s, _ in cited} >= {"4.5", "4.5.2", "4.1"}, cited      # the set-ups of Tab. 5, Tab. 6 and Tab. 2-4
    wrong = [c for c in cited if c[1] not in GARCIN_SECTIONS or c[1] == "5"]
    assert not wrong, wrong
    assert garcin_citations("Garcin 2022, section 5.3 |") == [("5.3", "Garcin 2022, section 5.3 |")]
