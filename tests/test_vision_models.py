"""Image models: the tutorial CNN, the small ViT, torchvision classifiers by name with a new head,
local weights files, freezing; trained for real under 2-process DDP and used by `predict`."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_vision_data import image_tree

import ddplab
from conftest import assert_ok, main
from conftest import ddplab as run_ddplab
from ddplab.errors import UserError
from ddplab.models.vision import CNN, compact
from ddplab.registry import load_config
from ddplab.workload import BuildConfig, Options
from ddplab.workloads import images

QUIET = ["logging.trackers=[]", "logging.progress=false"]


def image_data(classes: int, channels: int, side: int) -> ddplab.Data:
    """What a model function reads of the data: the task and one image's shape."""
    return ddplab.Data(train=[], task=ddplab.Classification(classes), input_shape=(channels, side, side))


def build_model(cfg, data):
    """The image workload's model function for cfg's model.name, as the registry calls it."""
    return images.model(BuildConfig(Options(), cfg), data)


@pytest.fixture(scope="module")
def resnet18_weights(tmp_path_factory):
    """A torchvision resnet18 state dict, as a user would have saved (or downloaded) one."""
    import torchvision

    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), path)
    return path


def test_cnn_shapes():
    for channels, side in ((1, 8), (1, 28), (3, 32)):
        out = CNN(channels, 10, side)(torch.randn(2, channels, side, side))
        assert out.shape == (2, 10)


@pytest.mark.parametrize(
    "name, head",
    [
        ("resnet18", "fc"),
        ("vgg11", "classifier.6"),
        ("squeezenet1_0", "classifier.1"),
        ("vit_b_16", "heads.head"),
        ("googlenet", "fc"),
    ],
)
def test_torchvision_head_replaced_and_freeze(name, head):
    cfg = load_config(None, [f"model.name={name}", "data.name=digits", "model.freeze=true", "data.image_size=32"])
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = build_model(cfg, image_data(7, 3, 32))
        out = model.eval()(torch.empty(2, 3, 32, 32))
    assert out.shape == (2, 7)
    layer = model.get_submodule(head)
    assert (getattr(layer, "out_features", None) or layer.out_channels) == 7
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{head}.weight", f"{head}.bias"}


def test_weights_file_loads_before_the_head_is_replaced(resnet18_weights):
    cfg = load_config(None, ["model.name=resnet18", "data.name=digits", f"model.weights={resnet18_weights}"])
    model = build_model(cfg, image_data(5, 3, 32))
    saved = torch.load(resnet18_weights, weights_only=True)
    assert torch.equal(model.conv1.weight, saved["conv1.weight"])
    assert torch.equal(model.layer4[1].bn2.running_var, saved["layer4.1.bn2.running_var"])
    assert model.fc.out_features == 5  # the 1000-way head is gone
    model(torch.randn(2, 3, 32, 32)).sum().backward()  # mmap-backed parameters train like any other
    assert model.conv1.weight.grad is not None


@pytest.mark.parametrize("channels", [1, 3])
def test_small_vit_trains_on_digit_sized_images(channels):
    cfg = load_config(
        None,
        ["model.name=vit", "data.name=digits", "model.layers=1", "model.dim=32", "model.heads=2", "model.patch_size=4"],
    )
    model = build_model(cfg, image_data(10, channels, 8))
    assert model.conv_proj.in_channels == channels
    x, y = torch.randn(16, channels, 8, 8), torch.arange(16) % 10
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):  # torchvision zero-initialises the head, so the encoder learns from step 2 on
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_unknown_name_lists_ddplab_and_torchvision_models():
    with pytest.raises(UserError) as err:
        load_config(None, ["model.name=resnet19"])
    message = str(err.value)
    assert "\n" not in message and "model.name" in message and "did you mean resnet18" in message
    for valid in ("cnn", "vit", "gpt", "resnet{18,34,50,101,152}", "vgg{11,11_bn,13,13_bn,16,16_bn,19,19_bn}"):
        assert valid in message
    assert compact(["vgg11", "vgg19", "alexnet", "inception_v3"]) == "alexnet, inception_v3, vgg{11,19}"


def test_what_a_torchvision_classifier_cannot_take_is_refused_with_the_config():
    with pytest.raises(UserError, match=r"data.image_size: 20x20 images do not fit model.name=vit_b_16"):
        load_config(None, ["model.name=vit_b_16", "data.name=digits", "data.image_size=20"])
    load_config(None, ["model.name=vit_b_16", "data.name=digits", "data.image_size=32"])


def test_wrong_architecture_weights_is_one_line_exit_2(tmp_path, resnet18_weights, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    code = main(
        "train", "model.name=vgg11", "data.name=digits", "data.image_size=32", f"model.weights={resnet18_weights}"
    )
    err = capfd.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "model.weights" in lines[0] and "does not fit vgg11" in lines[0], err
    assert not (tmp_path / "experiments").exists()


def test_cnn_on_digits_under_ddp_then_predict(tmp_path, capfd):
    proc = run_ddplab(
        "train",
        "--nproc-per-node",
        "2",
        "model.name=cnn",
        "data.name=digits",
        "training.epochs=6",
        "model.dropout=0.25",
        "training.warmup_steps=10",
        "experiment.name=digits",
        *QUIET,
        cwd=tmp_path,
    )
    assert_ok(proc)
    run = tmp_path / "experiments" / "digits"
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["ddp"]["world_size"] == 2 and summary["ddp"]["ranks_identical"]
    assert summary["epochs"][-1]["val_accuracy"] >= 0.9, summary["epochs"][-1]
    assert summary["test"]["samples"] == 180 and summary["test"]["accuracy"] >= 0.9
    assert summary["aggregates"]["best_val_loss"] is not None

    from sklearn.datasets import load_digits

    digits = load_digits()
    paths = []
    for i in range(6):  # the first images of the set, as 8-bit PNGs a user could have drawn
        path = tmp_path / f"digit{i}.png"
        Image.fromarray(np.rint(digits.images[i] * 255 / 16).astype(np.uint8), mode="L").save(path)
        paths.append(str(path))
    capfd.readouterr()
    assert main("predict", str(run), *paths) == 0
    rows = [line.split("\t") for line in capfd.readouterr().out.strip().splitlines()]
    assert [r[2] for r in rows] == paths and all(0 < float(r[1]) <= 1 for r in rows)
    assert sum(r[0] == str(digits.target[i]) for i, r in enumerate(rows)) >= 5


def test_image_folder_resnet18_and_vgg11_under_ddp_from_weights(tmp_path, resnet18_weights):
    import torchvision

    root = image_tree(tmp_path / "tree", per_class=4)
    torch.save(torchvision.models.vgg11().state_dict(), tmp_path / "vgg11.pth")
    common = [
        "data.name=image_folder",
        f"data.root={root}",
        "data.image_size=32",
        "training.max_steps=2",
        "training.batch_size=4",
        "checkpoint.save_best=false",
        *QUIET,
    ]
    runs = {
        "resnet18": [f"model.weights={resnet18_weights}"],
        # Frozen: VGG's 120M classifier parameters would make AdamW steps slow on a CPU.
        "vgg11": [f"model.weights={tmp_path / 'vgg11.pth'}", "model.freeze=true"],
    }
    for name, extra in runs.items():
        proc = run_ddplab(
            "train",
            "--nproc-per-node",
            "2",
            f"model.name={name}",
            *common,
            *extra,
            f"experiment.name={name}",
            cwd=tmp_path,
        )
        assert_ok(proc)
        summary = json.loads((tmp_path / "experiments" / name / "metrics.json").read_text())
        assert summary["aggregates"]["steps"] == 2 and summary["ddp"]["ranks_identical"]
        assert summary["dataset"]["num_classes"] == 3 and summary["epochs"][-1]["val_loss"] > 0
