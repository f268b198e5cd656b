"""Image classifiers of the paper: VGG-19 and ResNet-50 (bottleneck blocks, no torchvision).

Both default to the paper's ImageNet sizes (224 x 224, 1000 classes); ``image_size``,
``width`` (channel multiplier) and ``num_classes`` shrink them for CPU runs. Inputs are
N(0, 1) images, targets random classes. VGG-19 has no dropout (deterministic runs). ResNet-50
uses batch norm in training mode, so a layer's output for one sample depends on the other
samples of its (micro-)batch - as in the paper's runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.models.zoo.common import Flatten, generator

__all__ = ["Bottleneck", "resnet50", "vgg19"]

_VGG19: tuple[int, ...] = (64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0)
_VGG19 += (512, 512, 512, 512, 0)


def _image_batch(image_size: int, num_classes: int) -> partial[tuple[torch.Tensor, torch.Tensor]]:
    return partial(_make_images, image_size, num_classes)


def _make_images(
    image_size: int, num_classes: int, batch_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(seed)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    return x, torch.randint(0, num_classes, (batch_size,), generator=g)


def _check(name: str, image_size: int, width: float, num_classes: int, min_size: int) -> None:
    if image_size < min_size or image_size % 32 or width <= 0 or num_classes < 1:
        raise ValidationError(
            f"{name}: image_size must be a multiple of 32 >= {min_size}, width > 0, "
            f"num_classes >= 1; got image_size={image_size} width={width} num_classes={num_classes}"
        )


def _vgg_conv(cin: int, cout: int, pool: bool) -> nn.Module:
    mods: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
    if pool:
        mods.append(nn.MaxPool2d(2))
    return nn.Sequential(*mods)


def _vgg_fc(n_in: int, n_out: int, flatten: bool, relu: bool) -> nn.Module:
    mods: list[nn.Module] = [Flatten()] if flatten else []
    mods.append(nn.Linear(n_in, n_out))
    if relu:
        mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def vgg19(
    image_size: int = 224, width: float = 1.0, num_classes: int = 1000, fc_dim: int = 4096
) -> Workload:
    """VGG-19: 16 conv layers (max-pool folded into the conv before it) + 3 fc = 19 layers.

    Args:
        image_size: input resolution (multiple of 32).
        width: multiplier of the conv channel counts (64..512).
        num_classes: classifier outputs.
        fc_dim: width of the two hidden fc layers.
    """
    _check("vgg19", image_size, width, num_classes, 32)
    factories: list[Callable[[], nn.Module]] = []
    names: list[str] = []
    cin = 3
    for i, c in enumerate(_VGG19):
        if c == 0:
            continue
        cout = max(1, round(c * width))
        pool = i + 1 < len(_VGG19) and _VGG19[i + 1] == 0
        factories.append(partial(_vgg_conv, cin, cout, pool))
        names.append(f"conv{len(names) + 1}")
        cin = cout
    side = image_size // 32
    dims = [cin * side * side, fc_dim, fc_dim, num_classes]
    for k in range(3):
        factories.append(partial(_vgg_fc, dims[k], dims[k + 1], k == 0, k < 2))
        names.append(f"fc{k + 1}")
    return Workload(
        name="vgg19",
        layer_factories=factories,
        make_batch=_image_batch(image_size, num_classes),
        loss_fn=F.cross_entropy,
        layer_names=names,
    )


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout)]


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (x4), plus the (projected) input."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(cin, mid, 1),
            nn.ReLU(),
            *_conv_bn(mid, mid, 3, stride),
            nn.ReLU(),
            *_conv_bn(mid, 4 * mid, 1),
        )
        self.down = (
            nn.Sequential(*_conv_bn(cin, 4 * mid, 1, stride))
            if stride != 1 or cin != 4 * mid
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.down(x))


def _stem(c: int) -> nn.Module:
    return nn.Sequential(*_conv_bn(3, c, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1))


def _resnet_head(n_in: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(n_in, classes))


def resnet50(image_size: int = 224, width: float = 1.0, num_classes: int = 1000) -> Workload:
    """ResNet-50: stem, 16 bottleneck blocks (3, 4, 6, 3), head = 18 layers.

    Args:
        image_size: input resolution (multiple of 32).
        width: multiplier of the channel counts (stem 64, bottleneck widths 64..512).
        num_classes: classifier outputs.
    """
    _check("resnet50", image_size, width, num_classes, 32)
    c0 = max(1, round(64 * width))
    factories: list[Callable[[], nn.Module]] = [partial(_stem, c0)]
    names = ["stem"]
    cin = c0
    for stage, blocks in enumerate((3, 4, 6, 3)):
        mid = max(1, round(64 * width * 2**stage))
        for blk in range(blocks):
            stride = 2 if blk == 0 and stage > 0 else 1
            factories.append(partial(Bottleneck, cin, mid, stride))
            names.append(f"layer{stage + 1}.{blk}")
            cin = 4 * mid
    factories.append(partial(_resnet_head, cin, num_classes))
    names.append("fc")
    return Workload(
        name="resnet50",
        layer_factories=factories,
        make_batch=_image_batch(image_size, num_classes),
        loss_fn=F.cross_entropy,
        layer_names=names,
    )
