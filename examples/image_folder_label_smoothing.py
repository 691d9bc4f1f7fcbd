"""Your own image model and loss on an ImageFolder tree (one sub-folder per class), with a task
of your own: cross-entropy with label smoothing, scored by torchmetrics' accuracy and macro F1.

    python examples/image_folder_label_smoothing.py digits_png     # writes a PNG tree to try it on
    ddplab train model.name=examples/image_folder_label_smoothing.py:model \
        data.name=examples/image_folder_label_smoothing.py:data data.options.root=digits_png \
        training.epochs=5 training.lr=3e-3 --nproc-per-node 2
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ddplab


class SmoothedClassification(ddplab.Task):
    kind = "classification_smoothed"

    def __init__(self, num_classes, smoothing=0.1):
        self.num_classes, self.smoothing = num_classes, smoothing

    def loss(self, output, target):
        return F.cross_entropy(output.float(), target, label_smoothing=self.smoothing)

    def metrics(self):
        import torchmetrics

        return {"accuracy": torchmetrics.Accuracy("multiclass", num_classes=self.num_classes),
                "f1": torchmetrics.F1Score("multiclass", num_classes=self.num_classes, average="macro")}

    def check_output(self, output, target):
        if tuple(output.shape) != (len(target), self.num_classes):
            raise ddplab.UserError(f"expected ({len(target)}, {self.num_classes}) logits, got {tuple(output.shape)}")


def data(cfg):
    from torchvision import datasets, transforms

    side = cfg.options.get("side", 16)
    tf = transforms.Compose([transforms.Grayscale(), transforms.Resize(side), transforms.ToTensor()])
    tree = datasets.ImageFolder(cfg.options.root, transform=tf)
    order = torch.randperm(len(tree), generator=torch.Generator().manual_seed(0)).tolist()
    n_val = len(tree) // 5
    return ddplab.Data(train=torch.utils.data.Subset(tree, order[n_val:]),
                       val=torch.utils.data.Subset(tree, order[:n_val]),
                       task=SmoothedClassification(len(tree.classes), cfg.options.get("smoothing", 0.1)))


def model(cfg, data):
    width, side = cfg.options.get("width", 16), data.train[0][0].shape[-1]
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(width, 2 * width, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(2 * width * (side // 4) ** 2, data.task.num_classes))


def write_digits_tree(root, per_class=None):
    """scikit-learn's 8x8 digits as PNG files, root/<digit>/<i>.png."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    counts = {}
    for image, label in zip(digits.images, digits.target):
        if per_class is not None and counts.get(label, 0) >= per_class:
            continue
        counts[label] = counts.get(label, 0) + 1
        folder = Path(root) / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).astype("uint8")).save(folder / f"{counts[label]}.png")


if __name__ == "__main__":
    write_digits_tree(sys.argv[1] if len(sys.argv) > 1 else "digits_png")
