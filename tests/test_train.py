"""Training and evaluation (topk_nb.training.loop): configuration checks, metrics, multi-crop, checkpoints and exact
resume, DDP with two CPU processes, a smoke run of every registered loss, and the fused head (the same training as
the unfused loss, its refusals, the experiments' parameter)."""
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st
from torch.utils.data import DataLoader, Dataset, TensorDataset

from topk_nb.base.core import macro_topk_accuracy, topk_accuracy
from topk_nb.loss.registry import LOSSES, get_loss
from topk_nb.training.loop import (PRESETS, ShardSampler, TrainConfig, atomic_write, derive_seed, evaluate,
                           fit, get_rng_state, load_checkpoint, lr_at, make_optimizer, make_scheduler, parse_args, run,
                           save_checkpoint, seed_everything, set_rng_state)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def one_thread():
    "The models here are tiny: one thread is as fast, and does not stall when other jobs share the CPU."
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- configuration -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, error, match", [
    (dict(lr=-0.1), ValueError, r"lr must be a finite number in \(0.0, inf\], got -0.1"),
    (dict(lr=0.0), ValueError, r"lr must be a finite number in \(0.0"),
    (dict(lr=float("nan")), ValueError, "lr must be a finite number"),
    (dict(epochs=0), ValueError, r"epochs must be an integer in \[1, inf\]"),
    (dict(batch_size=0), ValueError, "batch_size must be an integer in"),
    (dict(momentum=-0.5), ValueError, "momentum must be a finite number in"),
    (dict(momentum=0.0), ValueError, "nesterov=True needs momentum"),
    (dict(weight_decay=-1e-4), ValueError, "weight_decay must be"),
    (dict(milestones=(30, 10)), ValueError, "milestones must be strictly increasing"),
    (dict(milestones=(0, 10)), ValueError, r"each entry of milestones must be an integer in \[1, inf\]"),
    (dict(gamma=0), ValueError, "gamma must be"),
    (dict(ks=()), ValueError, "ks must name at least one k"),
    (dict(ks=(0, 5)), ValueError, "each entry of ks must be an integer"),
    (dict(select_metric="val_top3"), ValueError, r"select_metric must be one of \['val_top1', 'val_top5', 'val_macro_top1'"),
    (dict(select_metric="test_top5"), ValueError, "select_metric must be one of"),
    (dict(mixup_alpha=-1.0), ValueError, "mixup_alpha must be"),
    (dict(device="tpu:zero"), ValueError, "device must be 'auto' or a torch device string"),
    (dict(amp="yes"), TypeError, "amp must be True or False or None"),
    (dict(amp_dtype="float32"), ValueError, "amp_dtype must be one of"),
    (dict(multicrop="vote"), ValueError, r"multicrop must be one of \('marginals', 'softmax', 'scores'\)"),
    (dict(num_workers=-1), ValueError, "num_workers must be an integer in"),
    (dict(seed=-3), ValueError, "seed must be an integer in"),
    (dict(out_dir=3), TypeError, "out_dir must be a path or None"),
])
def test_bad_configuration_is_rejected(bad, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**bad)


def test_configuration_defaults_and_presets():
    c = TrainConfig()
    assert (c.momentum, c.nesterov, c.ks, c.select_metric) == (0.9, True, (1, 5), "val_top5")
    assert TrainConfig(ks=(3, 1)).select_metric == "val_top3"
    for name in PRESETS:
        TrainConfig.preset(name)
    p = TrainConfig.preset("garcin_cifar100")
    assert (p.epochs, p.batch_size, p.lr, p.milestones, p.gamma, p.weight_decay) == (300, 64, 0.1, (150, 225), 0.1, 1e-4)
    with pytest.raises(TypeError, match="unknown training option"):
        TrainConfig.from_dict({"learning_rate": 0.1})
    assert json.loads(json.dumps(TrainConfig(milestones=(2, 4)).to_dict()))["milestones"] == [2, 4]


SMOKE_DATA = dict(n_classes=10, n_per_class=8, n_val_per_class=2, n_test_per_class=2, noise=0.5)
SMOKE = dict(dataset="synthetic_images", dataset_params=SMOKE_DATA, model="densenet_tiny", loss="ce",
             epochs=2, batch_size=16, lr=0.05, progress=False)


@pytest.mark.parametrize("override, match", [
    (dict(dataset="cifar1000"), r"unknown dataset 'cifar1000'; valid names: cifar100, "),
    (dict(model="densenet_huge"), r"unknown model 'densenet_huge'; valid names: "),
    (dict(loss="softmax_svm"), r"unknown loss 'softmax_svm'; valid names: ce, focal"),
    (dict(lr=-0.1), r"lr must be a finite number in \(0.0, inf\], got -0.1"),
    (dict(ks=(1, 12)), r"ks=\(1, 12\) asks for k larger than the 10 classes of synthetic_images"),
    (dict(loss=None), "run needs loss"),
])
def test_run_rejects_bad_configuration(override, match):
    with pytest.raises(ValueError, match=match):
        run(SMOKE, **override)


def test_run_rejects_unknown_options():
    with pytest.raises(TypeError, match=r"unknown training option\(s\) learning_rate"):
        run(SMOKE, learning_rate=0.1)
    with pytest.raises(TypeError, match="loss_params must be a dict"):
        run(SMOKE, loss_params=[5])


def test_parse_args(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"dataset": "circles", "lr": 0.5}))
    assert parse_args([str(tmp_path / "spec.json"), "lr=0.25", "loss=ce", "milestones=[3, 6]"]) == \
        {"dataset": "circles", "lr": 0.25, "loss": "ce", "milestones": [3, 6]}
    with pytest.raises(ValueError, match="neither key=value nor a JSON file"):
        parse_args(["nowhere.json"])


# --- optimiser and schedule -----------------------------------------------------------------------------------

@given(milestones=st.lists(st.integers(1, 12), max_size=3, unique=True), gamma=st.sampled_from([0.1, 0.2, 0.5]))
def test_schedule_is_the_closed_form(milestones, gamma):
    cfg = TrainConfig(lr=0.3, milestones=sorted(milestones), gamma=gamma)
    opt = make_optimizer(nn.Linear(1, 1), cfg)
    sched = make_scheduler(opt, cfg)
    for epoch in range(14):
        expected = 0.3 * gamma ** sum(m <= epoch for m in milestones)
        assert math.isclose(opt.param_groups[0]["lr"], expected, rel_tol=1e-12)
        assert math.isclose(lr_at(cfg, epoch), expected, rel_tol=1e-12)
        opt.step()
        sched.step()


def test_nesterov_step_by_hand():
    w = nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    opt = make_optimizer(nn.ParameterList([w]), TrainConfig(lr=0.5, momentum=0.8, weight_decay=0.1))
    ref, buf = w.detach().clone(), None
    for _ in range(3):
        opt.zero_grad()
        (w ** 3).sum().backward()
        opt.step()
        g = 3 * ref ** 2 + 0.1 * ref
        buf = g if buf is None else 0.8 * buf + g
        ref = ref - 0.5 * (g + 0.8 * buf)
    torch.testing.assert_close(w.detach(), ref, rtol=0, atol=1e-12)


# --- evaluation -----------------------------------------------------------------------------------------------

@given(n=st.integers(2, 12), size=st.integers(1, 40), batch=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_evaluate_equals_metrics_on_the_whole_set(n, size, batch, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(size, n, generator=g).round(decimals=1)       # rounded: ties happen
    target = torch.randint(0, n, (size,), generator=g)
    ks = tuple(sorted({1, min(2, n), n}))
    model = nn.Identity()
    model.dummy = nn.Parameter(torch.zeros(()))
    got = evaluate(model, DataLoader(TensorDataset(scores, target), batch_size=batch), ks=ks)
    micro, macro = topk_accuracy(scores, target, ks), macro_topk_accuracy(scores, target, ks)
    assert got["n"] == size
    for k in ks:
        assert math.isclose(got[f"top{k}"], micro[k], rel_tol=1e-6)
        assert math.isclose(got[f"macro_top{k}"], macro[k], rel_tol=1e-6)


def _brute_marginals(s, k):
    "Berrada 2018, eq. (63), by enumerating k-subsets in float64, normalised to sum to one."
    p = torch.zeros(len(s), dtype=torch.float64)
    for subset in itertools.combinations(range(len(s)), k):
        w = math.exp(sum(float(s[j]) for j in subset))
        for i in subset:
            p[i] += w
    return p / p.sum()


class ReadScores(nn.Module):
    "The inputs are the scores: images (C=1, H=1, W=n) flattened."
    def __init__(self):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x.flatten(1) + 0 * self.dummy


@pytest.mark.parametrize("method", ["marginals", "softmax", "scores"])
def test_multicrop_evaluation_is_eq_63_averaged_over_crops(method):
    g = torch.Generator().manual_seed(1)
    crops = torch.randn(12, 4, 7, generator=g, dtype=torch.float64) * 2          # 12 images, 4 crops, 7 classes
    labels = torch.randint(0, 7, (12,), generator=g)
    ks = (1, 2, 4)
    got = evaluate(ReadScores(), DataLoader(TensorDataset(crops.view(12, 4, 1, 1, 7), labels), batch_size=5),
                   ks=ks, multicrop=method)
    for k in ks:
        if method == "marginals":
            combined = torch.stack([torch.stack([_brute_marginals(c, k) for c in img]).mean(0) for img in crops])
        else:
            combined = (torch.softmax(crops, -1) if method == "softmax" else crops).mean(1)
        hits = (combined.topk(k, dim=1).indices == labels[:, None]).any(1).double()
        assert got[f"top{k}"] == pytest.approx(hits.mean().item(), abs=1e-12)
        per_class = [hits[labels == c].mean().item() for c in labels.unique()]
        assert got[f"macro_top{k}"] == pytest.approx(sum(per_class) / len(per_class), abs=1e-12)


def test_multicrop_evaluation_uses_marginals():
    # two crops that disagree on the top-1 class and agree that class 1 is second (see the notebook)
    crops = torch.tensor([[10.0, 9.0, 0.0, 0.0], [0.0, 9.0, 10.5, 0.0]]).view(1, 2, 1, 1, 4)
    for label, marg, soft in [(1, 1.0, 0.0), (0, 0.0, 1.0), (2, 1.0, 1.0), (3, 0.0, 0.0)]:
        batch = [(crops, torch.tensor([label]))]
        assert evaluate(ReadScores(), batch, ks=(2,), multicrop="marginals")["top2"] == marg
        assert evaluate(ReadScores(), batch, ks=(2,), multicrop="softmax")["top2"] == soft


def test_shards_partition_without_padding():
    for n, world in itertools.product(range(0, 9), range(1, 5)):
        shards = [list(ShardSampler(n, r, world)) for r in range(world)]
        assert sorted(sum(shards, [])) == list(range(n))
        assert [len(ShardSampler(n, r, world)) for r in range(world)] == [len(s) for s in shards]


# --- seeds and checkpoints ------------------------------------------------------------------------------------

def test_rng_state_round_trip():
    import random

    import numpy as np
    seed_everything(11)
    state = get_rng_state()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    seed_everything(12)
    set_rng_state(state)
    assert (random.random(), float(np.random.rand())) == first[:2]
    assert torch.equal(torch.rand(3), first[2])
    assert derive_seed(0, "train", 0) == derive_seed(0, "train", 0) != derive_seed(0, "train", 1)


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"epoch": 1}, path)

    def crash(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, crash)
    assert load_checkpoint(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


# --- the training loop ----------------------------------------------------------------------------------------

def _blobs(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = 3 * torch.eye(4)[y] + 2 * torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


TRAIN, VAL, TEST = _blobs(96, 1), _blobs(40, 2), _blobs(37, 3)


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 4)


class FailAt(Dataset):
    "Raises at the `fail_at`-th item read, as a crash in the middle of an epoch would."
    def __init__(self, ds, fail_at):
        self.ds, self.reads, self.fail_at = ds, 0, fail_at

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.fail_at:
            raise RuntimeError("simulated crash")
        return self.ds[i]


def _noisy_fit(out_dir, epochs, train=TRAIN):
    # stochastic loss, Mixup and a milestone: every random stream and every piece of state matters
    loss = get_loss("noised_bal", k=2, epsilon=0.5, n_samples=3, generator=torch.Generator().manual_seed(9))
    model = _model()
    res = fit(model, loss, train, VAL, TEST, epochs=epochs, batch_size=16, lr=0.05, milestones=(2,), ks=(1, 2),
              mixup_alpha=0.4, progress=False, out_dir=str(out_dir))
    return model, res


def _strip(history):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in history]


def test_exact_resume(tmp_path):
    m_ref, r_ref = _noisy_fit(tmp_path / "ref", 3)
    _noisy_fit(tmp_path / "split", 2)
    m_res, r_res = _noisy_fit(tmp_path / "split", 3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _noisy_fit(tmp_path / "crash", 3, FailAt(TRAIN, 2 * len(TRAIN) + 50))
    assert load_checkpoint(tmp_path / "crash" / "checkpoint.pt")["epoch"] == 2
    m_crash, r_crash = _noisy_fit(tmp_path / "crash", 3)
    ref_ckpt = load_checkpoint(tmp_path / "ref" / "checkpoint.pt")
    for name, model, res in [("split", m_res, r_res), ("crash", m_crash, r_crash)]:
        assert res["resumed_from"] == 2
        assert _strip(res["history"]) == _strip(r_ref["history"])
        assert (res["best_epoch"], res["val"], res["test"], res["final"]["test"]) == \
            (r_ref["best_epoch"], r_ref["val"], r_ref["test"], r_ref["final"]["test"])
        for p, q in zip(model.parameters(), m_ref.parameters()):
            assert torch.equal(p, q)
        ckpt = load_checkpoint(tmp_path / name / "checkpoint.pt")
        for key in ref_ckpt["model"]:
            assert torch.equal(ckpt["model"][key], ref_ckpt["model"][key])
        for a, b in zip(ckpt["optimizer"]["state"].values(), ref_ckpt["optimizer"]["state"].values()):
            assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert _strip(json.loads(line) for line in lines) == _strip(r_ref["history"])


def test_resume_refuses_another_configuration(tmp_path):
    fit(_model(), nn.CrossEntropyLoss(), TRAIN, VAL, None, epochs=1, batch_size=16, ks=(1, 2), progress=False,
        out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="lr: 0.1 in the checkpoint, 0.2 now"):
        fit(_model(), nn.CrossEntropyLoss(), TRAIN, VAL, None, epochs=2, batch_size=16, ks=(1, 2), lr=0.2,
            progress=False, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="another architecture"):
        fit(nn.Sequential(nn.Linear(4, 4)), nn.CrossEntropyLoss(), TRAIN, VAL, None, epochs=2, batch_size=16,
            ks=(1, 2), progress=False, out_dir=str(tmp_path))
    res = fit(_model(), nn.CrossEntropyLoss(), TRAIN, VAL, None, epochs=2, batch_size=16, ks=(1, 2), lr=0.2,
              progress=False, out_dir=str(tmp_path), resume=False)
    assert res["resumed_from"] is None and len(res["history"]) == 2


def test_best_epoch_selection_and_test_at_the_best_epoch(tmp_path):
    model = _model()
    res = fit(model, nn.CrossEntropyLoss(), TRAIN, VAL, TEST, epochs=5, batch_size=16, lr=0.5, ks=(1, 2),
              select_metric="val_macro_top1", progress=False, out_dir=str(tmp_path))
    values = [r["val_macro_top1"] for r in res["history"]]
    assert res["best_epoch"] == values.index(max(values)) + 1 and res["best_value"] == max(values)
    best = _model()
    best.load_state_dict(load_checkpoint(tmp_path / "checkpoint.pt")["best_model"])
    loader = DataLoader(TEST, batch_size=5)
    assert res["test"] == evaluate(best, loader, ks=(1, 2))
    assert res["test"] == evaluate(model, loader, ks=(1, 2))          # fit leaves the best weights in the model
    assert res["final"]["epoch"] == 5 and res["final"]["val"] == {k[4:]: v for k, v in res["history"][-1].items()
                                                                  if k.startswith("val_")}
    assert json.loads((tmp_path / "result.json").read_text())["test"] == res["test"]
    assert [r["lr"] for r in res["history"]] == [0.5] * 5


def test_without_validation_the_last_epoch_is_reported():
    model = _model()
    res = fit(model, nn.CrossEntropyLoss(), TRAIN, None, TEST, epochs=2, batch_size=32, ks=(1, 2), progress=False)
    assert res["best_epoch"] == 2 and res["select_metric"] is None and res["val"] is None
    assert res["test"] == res["final"]["test"] == evaluate(model, DataLoader(TEST, batch_size=8), ks=(1, 2))


def test_batch_size_must_split_over_processes_and_devices_must_exist():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            fit(_model(), nn.CrossEntropyLoss(), TRAIN, VAL, None, epochs=1, device="cuda", ks=(1, 2), progress=False)
    with pytest.raises(ValueError, match="amp_dtype='float16' needs a CUDA device"):
        fit(_model(), nn.CrossEntropyLoss(), TRAIN, VAL, None, epochs=1, device="cpu", amp=True,
            amp_dtype="float16", ks=(1, 2), progress=False)


# --- DDP ------------------------------------------------------------------------------------------------------

def test_ddp_two_processes_match_one(tmp_path):
    spec = dict(dataset="circles", dataset_params=dict(n_per_class=16, n_val_per_class=7, n_test_per_class=9,
                                                       sigma=30.0),
                model="circle_linear", loss="ce", epochs=3, batch_size=16, lr=0.5, milestones=[2], ks=[1, 2],
                progress=False)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "topk_nb.training.loop", str(tmp_path / "spec.json"), f"out_dir={tmp_path / 'two'}"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = run(spec, out_dir=str(tmp_path / "one"))
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["history"]) == len(two["history"]) == 3
    for r1, r2 in zip(one["history"], two["history"]):
        for key in r1:
            if key != "time_s":
                assert r1[key] == pytest.approx(r2[key], rel=1e-6, abs=1e-7), key
    assert two["test"] == one["test"] and two["test"]["n"] == 54
    w1, w2 = (load_checkpoint(tmp_path / d / "checkpoint.pt")["model"] for d in ("one", "two"))
    for key in w1:
        torch.testing.assert_close(w1[key], w2[key], rtol=1e-5, atol=1e-6)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["test"] == two["test"]    # rank 0 printed, once


# --- the smoke run --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mixup_alpha", [0.0, 0.2])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_smoke_run_every_loss(loss, mixup_alpha, tmp_path):
    params = {"k": 5} if "k" in LOSSES[loss].defaults else {}
    res = run(SMOKE, loss=loss, loss_params=params, out_dir=str(tmp_path), mixup_alpha=mixup_alpha)
    assert len(res["history"]) == 2 and res["loss"] == loss
    assert all(math.isfinite(r["train_loss"]) for r in res["history"])
    assert set(res["test"]) == {"top1", "top5", "macro_top1", "macro_top5", "n"} and res["test"]["n"] == 20
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("loss", ["ce", "smooth_svm", "noised_bal"])
def test_autocast_and_channels_last_paths_on_cpu(loss, tmp_path):
    # bfloat16 autocast and NHWC run on a CPU too when asked for; soft targets (Mixup) included
    res = run(SMOKE, loss=loss, loss_params={"k": 5} if loss != "ce" else {}, amp=True, channels_last=True,
              mixup_alpha=0.2, device="cpu", out_dir=str(tmp_path))
    assert res["amp"] and res["channels_last"] and res["device"] == "cpu"
    assert all(math.isfinite(r["train_loss"]) for r in res["history"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="channels-last defaults on only with a CUDA GPU")
def test_gpu_amp_and_channels_last(tmp_path):
    res = run(SMOKE, loss="smooth_svm", loss_params={"k": 5}, out_dir=str(tmp_path / "f32"))
    assert not res["amp"] and res["channels_last"] and res["device"].startswith("cuda")   # float32, as the papers
    res = run(SMOKE, loss="smooth_svm", loss_params={"k": 5}, amp=True, out_dir=str(tmp_path))
    assert res["amp"] and res["channels_last"] and res["device"].startswith("cuda")
    assert all(math.isfinite(r["train_loss"]) for r in res["history"])


# --- the fused head -------------------------------------------------------------------------------------------

# Sawada's circles, twelve classes, and his network with one hidden layer: few ReLU kinks and noise draws near a
# tie, so that float32 rounding stays rounding along a whole run
CIRCLES = dict(dataset="circles", dataset_params=dict(n_classes=12, n_per_class=16, n_val_per_class=8, n_test_per_class=8,
                                                      sigma=20.0),
               model="circle_mlp", model_params=dict(hidden=16, bias=True), epochs=3, batch_size=16, lr=0.2, ks=[1, 2],
               progress=False)
FUSED_PARAMS = {"smooth_svm": dict(k=2, tau=1.0), "noised_bal": dict(k=2, epsilon=0.2, n_samples=10),
                "noised_imbal": dict(k=2, epsilon=0.01, n_samples=5, scale=1.0)}
FIVE = ["plantnet_imbalanced", "imagenet_lt", "imagenet_subsets", "cifar100_noise", "temperature"]


def _relative_gap(a: dict, b: dict) -> float:
    "The largest difference between two state dicts' tensors, relative to the largest entry of each tensor."
    return max(((a[k].double() - b[k].double()).abs().max() / a[k].double().abs().max().clamp_min(1e-30)).item()
               for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("loss, model_params", [
    ("smooth_svm", {}), ("noised_bal", {}), ("noised_imbal", {}),
    ("noised_imbal", dict(head="normalised", scale=1.0)), ("smooth_svm", dict(head="normalised", scale=4.0))])
def test_fused_head_trains_as_the_unfused_loss(loss, model_params, tmp_path):
    params = {**FUSED_PARAMS[loss], **({"scale": 5.0} if loss == "noised_imbal" and model_params else {})}
    spec = dict(CIRCLES, model_params={**CIRCLES["model_params"], **model_params}, loss=loss, loss_params=params)
    plain = run(spec, out_dir=str(tmp_path / "plain"))
    fused = run(spec, fused_head=True, out_dir=str(tmp_path / "fused"))
    assert (plain["config"]["fused_head"], fused["config"]["fused_head"]) == (False, True)
    assert len(fused["history"]) == 3
    for a, b in zip(plain["history"], fused["history"]):
        assert a.keys() == b.keys()
        for key in a:
            if key != "time_s":
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-8), key
    assert (fused["best_epoch"], fused["val"], fused["test"]) == (plain["best_epoch"], plain["val"], plain["test"])
    w_plain, w_fused = (load_checkpoint(tmp_path / d / "checkpoint.pt")["model"] for d in ("plain", "fused"))
    assert w_plain.keys() == w_fused.keys() and _relative_gap(w_plain, w_fused) < 1e-5


@pytest.mark.parametrize("head", ["linear", "normalised"])
@pytest.mark.parametrize("loss", ["smooth_svm", "noised_bal", "noised_imbal"])
def test_fused_step_gives_the_unfused_loss_and_gradients(loss, head):
    import copy
    from topk_nb.training.models import get_model
    from topk_nb.training.loop import FusedHeadStep, fused_loss
    params = {"smooth_svm": dict(k=5, tau=0.5), "noised_bal": dict(k=5, epsilon=0.2, n_samples=10),
              "noised_imbal": dict(k=5, class_counts=torch.arange(1.0, 11.0), scale=5.0)}[loss]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    torch.manual_seed(0)
    model = get_model("densenet_tiny", 10, head=head)
    for amp_dtype in (None, torch.bfloat16):
        nets = [copy.deepcopy(model) for _ in range(2)]
        gens = [torch.Generator().manual_seed(7) for _ in range(2)]
        stochastic = LOSSES[loss].stochastic
        fns = [get_loss(loss, **params, **({"generator": gen} if stochastic else {})) for gen in gens]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp_dtype is not None):
            scores = nets[0](x)
        plain = fns[0](scores.float(), y)
        fused, (features, weight, bias) = FusedHeadStep(nets[1], fused_loss(fns[1]), amp_dtype=amp_dtype)(x, y)
        assert fused.dtype == plain.dtype == torch.float32
        plain.backward()
        fused.backward()
        if stochastic:
            assert torch.equal(gens[0].get_state(), gens[1].get_state())     # the same number of draws
        gap = max(((p.grad - q.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                  for p, q in zip(nets[0].parameters(), nets[1].parameters()))
        if amp_dtype is None:
            assert fused.item() == pytest.approx(plain.item(), rel=1e-6)
            assert gap < 1e-4, gap
            scores_again = torch.nn.functional.linear(features, weight, bias)
            torch.testing.assert_close(scores_again, scores.detach(), rtol=1e-5, atol=1e-5)
        else:   # the head's product rounds to bfloat16 in both, in another order
            assert features.dtype == weight.dtype == torch.bfloat16
            assert fused.item() == pytest.approx(plain.item(), rel=1e-2)


def test_fused_training_accuracy_is_topk_correct_of_the_scores_without_a_sync():
    "The training accuracy the fused step counts chunk by chunk equals `topk_correct` of the whole scores (ties as a tie-break's chance, a NaN row a miss), with labels in every chunk and none in some, and reads nothing back to the host."
    from topk_nb.perf.bench import aten_ops, syncing_ops
    from topk_nb.base.core import topk_correct
    from topk_nb.training.loop import _head_topk_correct
    g = torch.Generator().manual_seed(0)
    B, d, n, chunk = 9, 6, 70, 16                                        # five chunks, the last one short
    x, W, b = torch.randn(B, d, generator=g), torch.randn(n, d, generator=g), torch.randn(n, generator=g)
    W[40:50] = 0.0; b[40:50] = 0.0                                       # ten classes tied at 0 ...
    x[3] = 0.0                                                           # ... and a row where every score is its bias
    b[5] = b[6]; W[5] = W[6]                                             # two classes tied in every row
    y = torch.tensor([0, 5, 6, 42, 15, 16, 69, 45, 33])                 # chunk 3 holds no label
    W[60, 0] = float("nan")                                              # rows with x[:, 0] != 0 have a NaN score
    x[[1, 4], 0] = 0.0; x[3, 0] = 0.0                                    # ... but for these
    ks = (1, 2, 5, 12)
    scores = torch.nn.functional.linear(x, W, b)
    expected = topk_correct(scores, y, ks)
    got = _head_topk_correct(x, W, b, y, ks, chunk=chunk)
    assert expected[:, [1, 3, 4]].isfinite().all() and (expected[:, [0, 2]] == 0).all()   # the NaN rows miss, others count
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not syncing_ops(aten_ops(lambda: _head_topk_correct(x, W, b, y, ks, chunk=chunk)))


def test_fused_head_runs_under_autocast_and_channels_last_on_cpu(tmp_path):
    spec = dict(SMOKE, loss="smooth_svm", loss_params={"k": 5}, amp=True, channels_last=True, device="cpu")
    plain = run(spec, out_dir=str(tmp_path / "plain"))
    fused = run(spec, fused_head=True, out_dir=str(tmp_path / "fused"))
    assert fused["amp"] and fused["channels_last"] and fused["config"]["fused_head"]
    assert all(math.isfinite(r["train_loss"]) for r in fused["history"])
    # the first epoch's mean loss: bfloat16 rounding apart, the same loss of the same network
    assert fused["history"][0]["train_loss"] == pytest.approx(plain["history"][0]["train_loss"], rel=2e-2)


def test_fused_head_resumes_exactly(tmp_path):
    spec = dict(CIRCLES, loss="noised_bal", loss_params=FUSED_PARAMS["noised_bal"], fused_head=True)
    ref = run(spec, out_dir=str(tmp_path / "ref"))
    run(spec, epochs=2, out_dir=str(tmp_path / "split"))
    res = run(spec, out_dir=str(tmp_path / "split"))
    assert res["resumed_from"] == 2 and _strip(res["history"]) == _strip(ref["history"]) and res["test"] == ref["test"]
    w_ref, w_res = (load_checkpoint(tmp_path / d / "checkpoint.pt")["model"] for d in ("ref", "split"))
    assert all(torch.equal(w_ref[k], w_res[k]) for k in w_ref)
    # the fused head is part of the configuration a resume must match
    with pytest.raises(ValueError, match="fused_head: True in the checkpoint, False now"):
        run(spec, epochs=4, fused_head=False, out_dir=str(tmp_path / "split"))
    # a checkpoint written before the field existed was written without the fused head
    plain = dict(spec, fused_head=False)
    run(plain, epochs=2, out_dir=str(tmp_path / "old"))
    ckpt = load_checkpoint(tmp_path / "old" / "checkpoint.pt")
    del ckpt["config"]["fused_head"]
    save_checkpoint(ckpt, tmp_path / "old" / "checkpoint.pt")
    assert run(plain, out_dir=str(tmp_path / "old"))["resumed_from"] == 2
    with pytest.raises(ValueError, match="fused_head: False in the checkpoint, True now"):
        run(spec, epochs=4, out_dir=str(tmp_path / "old"))


class _Doubled(nn.Module):
    "Its scores are twice its last layer's output: nothing to fuse."
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return 2 * self.fc(x)


@pytest.mark.parametrize("call, match", [
    (lambda: run(SMOKE, fused_head=True),
     r"^fused_head=True needs one of the losses with a fused form \(smooth_svm, noised_bal, noised_imbal\), got loss 'ce'$"),
    (lambda: run(SMOKE, loss="smooth_svm", loss_params={"k": {1: 0.5, 5: 0.5}}, fused_head=True),
     "got a mixture over k of smooth_svm"),
    (lambda: run(SMOKE, loss="noised_bal", fused_head=True, wrap_loss=lambda loss_fn, data: loss_fn),
     "wrap_loss, which is given the scores, must be None with it"),
    (lambda: TrainConfig(fused_head=True, mixup_alpha=0.4), "mixup_alpha must be 0 with it, got 0.4"),
    (lambda: TrainConfig(fused_head="yes"), "fused_head must be True or False"),
    (lambda: fit(_model(), get_loss("smooth_svm", k=2, label_smoothing=0.1), TRAIN, VAL, None, epochs=1, ks=(1, 2),
                 progress=False, fused_head=True), "label_smoothing must be 0 with it, got 0.1"),
    (lambda: fit(_model(), get_loss("topk_hinge", k=2), TRAIN, VAL, None, epochs=1, ks=(1, 2), progress=False,
                 fused_head=True), "with a fused form .*, got TopkHinge$"),
    (lambda: fit(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), get_loss("smooth_svm", k=2), TRAIN, VAL, None, epochs=1,
                 ks=(1, 2), progress=False, fused_head=True),
     r"^fused_head=True needs a model whose last layer is an nn.Linear \(or NormalisedLinear\); model Sequential ends in "
     r"ReLU \(1\)$"),
    (lambda: fit(_Doubled(), get_loss("smooth_svm", k=2), TRAIN, VAL, None, epochs=1, ks=(1, 2), progress=False,
                 fused_head=True), "needs model _Doubled to return the output of its last layer fc, made by one call; "
                                   "it returns something else"),
])
def test_fused_head_refusals_are_one_line_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_a_registry_model_whose_last_layer_is_not_linear_is_named(monkeypatch):
    import topk_nb.training.loop as train

    class ReluHead(nn.Module):          # a network whose `fc` ends in a ReLU, in the registry's place
        def __init__(self, n_classes):
            super().__init__()
            self.fc = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, n_classes), nn.ReLU())

        def forward(self, x):
            return self.fc(x)

    monkeypatch.setattr(train, "get_model", lambda name, n_classes, **params: ReluHead(n_classes))
    with pytest.raises(ValueError, match=r"model 'densenet_tiny' ends in ReLU \(fc.2\)$"):
        run(SMOKE, loss="smooth_svm", fused_head=True)


def test_last_layer_of_the_package_models():
    from topk_nb.training.models import MODELS, NormalisedLinear, get_model
    from topk_nb.training.loop import last_layer
    for name in MODELS:
        if name.startswith("resnet"):
            pytest.importorskip("torchvision")
        for head, kind in (("linear", nn.Linear), ("normalised", NormalisedLinear)):
            found, layer = last_layer(get_model(name, 7, head=head))
            assert found == "fc" and type(layer) is kind, (name, head)
    assert last_layer(_model())[0] == ""                                  # the model itself
    assert last_layer(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)))[0] == "1"
    classifier = nn.Module()
    classifier.body, classifier.classifier = nn.Linear(4, 4), nn.Sequential(nn.Dropout(), nn.Linear(4, 3))
    assert last_layer(classifier)[0] == "classifier.1"


def test_ddp_two_processes_with_the_fused_head_match_one_without(tmp_path):
    spec = dict(dataset="circles", dataset_params=dict(n_per_class=16, n_val_per_class=7, n_test_per_class=9, sigma=30.0),
                model="circle_mlp", loss="smooth_svm", loss_params={"k": 2}, epochs=2, batch_size=16, lr=0.5, ks=[1, 2],
                progress=False)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "topk_nb.training.loop", str(tmp_path / "spec.json"), "fused_head=true", f"out_dir={tmp_path / 'two'}"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = run(spec, out_dir=str(tmp_path / "one"))
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    assert (one["world_size"], two["world_size"], two["config"]["fused_head"]) == (1, 2, True)
    for r1, r2 in zip(one["history"], two["history"]):
        for key in r1:
            if key != "time_s":
                assert r1[key] == pytest.approx(r2[key], rel=1e-5, abs=1e-7), key
    assert two["test"] == one["test"]
    w1, w2 = (load_checkpoint(tmp_path / d / "checkpoint.pt")["model"] for d in ("one", "two"))
    assert _relative_gap(w1, w2) < 1e-5


# --- the fused head in the experiments ------------------------------------------------------------------------

def test_experiments_declare_fused_head_and_the_runner_checks_it(tmp_path, capsys):
    from topk_nb.runner.cli import main as cli
    from topk_nb.runner.grid import EXPERIMENTS, notebook_parameters
    from topk_nb.runner.notebook import start
    for name in FIVE:
        assert notebook_parameters(EXPERIMENTS[name].notebook_path())["fused_head"] is False, name
        for preset in EXPERIMENTS[name].presets.values():   # the presets keep their cells: the records stay theirs
            assert "fused_head" not in json.dumps(preset), name
    # the notebooks' training options carry it, as they carry amp
    assert start({"seed": 3, "amp": False, "fused_head": True}).train_config("garcin_plantnet")["fused_head"] is True
    assert "fused_head" not in start({"seed": 3}).train_config("garcin_plantnet")
    # before anything runs: its kind, and a loss without a fused form
    out = str(tmp_path / "runs")
    assert cli(["run", "cifar100_noise", "--grid", "fused_head=yes", "--out", out]) == 2
    assert "--grid fused_head=yes: fused_head takes true or false" in capsys.readouterr().err
    assert cli(["run", "plantnet_imbalanced", "--preset", "smoke", "--grid", "fused_head=true", "--out", out]) == 2
    assert ("fused_head=true with loss=ce: fused_head takes the losses with a fused form only (smooth_svm, noised_bal, "
            "noised_imbal)") in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_records_identity_does_not_change_with_the_fused_head():
    from topk_nb.runner.report import record_settings
    old = {"experiment": "cifar100_noise", "params": {"loss": "smooth_svm", "seed": 0, "amp": False}}
    for value in (False, True):
        new = {**old, "params": {**old["params"], "fused_head": value}}
        assert record_settings(new) == record_settings(old)


@pytest.mark.parametrize("name, params, error", [
    # the flag reaches train.run: run refuses a loss without a fused form, which only it checks when the runner is not asked
    ("cifar100_noise", {"loss": "ce", "fused_head": True}, "needs one of the losses with a fused form"),
    ("imagenet_lt", {"loss": "ce", "fused_head": True}, "needs one of the losses with a fused form"),
    ("cifar100_noise", {"loss": "noised_bal", "fused_head": True, "epochs": 1}, None),
])
def test_the_flag_reaches_train_run_from_an_experiment(name, params, error, tmp_path):
    from topk_nb.runner import batch
    rec = batch.run_cell(batch.EXPERIMENTS[name].notebook_path(), params, tmp_path / "cell", experiment=name)
    if error is None:
        assert rec["status"] == "ok", rec.get("error")
        assert rec["params"]["fused_head"] is True and len(rec["metrics"]["history"]) == 1
    else:
        assert rec["status"] != "ok" and error in rec["error"], rec.get("error")
