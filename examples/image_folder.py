"""Your own images, one sub-folder per class (torchvision's ImageFolder), scored by ddplab's
Classification; `ddplab predict` opens an image file as the dataset opens its own and applies
the same transform, so nothing about inputs has to be written twice.

    ddplab train model.name=examples/image_folder.py:model data.name=examples/image_folder.py:data \
        data.options.root=my_images training.epochs=5 --nproc-per-node 2
    ddplab predict experiments/image_folder.model-image_folder.data cat.jpg my_images/dog --top-k 2
"""

import torch
import torch.nn as nn

import ddplab


def data(cfg):
    from torchvision import datasets, transforms

    side = cfg.options.get("side", 32)
    tf = transforms.Compose([transforms.Resize((side, side)), transforms.ToTensor()])
    tree = datasets.ImageFolder(cfg.options.root, transform=tf)  # RGB images, labels from folder names
    order = torch.randperm(len(tree), generator=torch.Generator().manual_seed(0)).tolist()
    n_val = max(len(tree) // 5, 1)
    return ddplab.Data(train=torch.utils.data.Subset(tree, order[n_val:]),
                       val=torch.utils.data.Subset(tree, order[:n_val]),
                       task=ddplab.Classification(len(tree.classes), tree.classes))


def model(cfg, data):
    width, side = cfg.options.get("width", 16), data.train[0][0].shape[-1]
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, w, S/2, S/2)
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 2w, S/4, S/4)
        nn.Flatten(), nn.Linear(2 * width * (side // 4) ** 2, data.task.num_classes))
