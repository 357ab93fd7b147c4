"""Internal: the preset networks as torch modules, built on the meta device to read their gradient profiles.

Written from the architectures' papers and torchvision's layer tables (ResNet v1.5, VGG-16,
Inception V3 without its auxiliary head) and BERT (Devlin et al. 2019); tests check each
parameter count against the published one. Only shapes matter here: the planner builds
these on the meta device and never runs them on data.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resnet", "vgg16", "inception_v3", "bert", "gpt"]


def _conv(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
          padding: int | tuple[int, int] = 0) -> nn.Sequential:
    """Convolution without bias, batch norm, ReLU: the unit of ResNet's and Inception's blocks."""
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        # v1.5: the stride sits on the 3×3 convolution, as in torchvision.
        self.body = nn.Sequential(_conv(cin, width, 1), _conv(width, width, 3, stride, 1),
                                  nn.Conv2d(width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != 4 * width:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, 4 * width, 1, stride, bias=False),
                                          nn.BatchNorm2d(4 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet(blocks: tuple[int, int, int, int]) -> nn.Module:
    """A bottleneck ResNet (He et al. 2016) for 224×224 images: (3, 4, 6, 3) is ResNet-50, (3, 4, 23, 3) ResNet-101."""
    layers: list[nn.Module] = [_conv(3, 64, 7, 2, 3), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for stage, count in enumerate(blocks):
        width = 64 << stage
        for index in range(count):
            layers.append(_Bottleneck(cin, width, 2 if index == 0 and stage > 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def vgg16() -> nn.Module:
    """VGG-16 (configuration D, Simonyan & Zisserman 2015) without batch norm, for 224×224 ImageNet."""
    layers: list[nn.Module] = []
    cin = 3
    for width in (64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0):
        if width == 0:
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, width, 3, padding=1), nn.ReLU()]
            cin = width
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
               nn.Linear(4096, 1000)]
    return nn.Sequential(*layers)


class _Branches(nn.Module):
    """Inception's parallel branches, concatenated along channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], 1)


def _pool_branch(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv(cin, cout, 1))


def _inception_a(cin: int, pool: int) -> nn.Module:
    return _Branches(_conv(cin, 64, 1),
                     nn.Sequential(_conv(cin, 48, 1), _conv(48, 64, 5, padding=2)),
                     nn.Sequential(_conv(cin, 64, 1), _conv(64, 96, 3, padding=1), _conv(96, 96, 3, padding=1)),
                     _pool_branch(cin, pool))


def _inception_b(cin: int) -> nn.Module:
    return _Branches(_conv(cin, 384, 3, 2),
                     nn.Sequential(_conv(cin, 64, 1), _conv(64, 96, 3, padding=1), _conv(96, 96, 3, 2)),
                     nn.MaxPool2d(3, 2))


def _inception_c(cin: int, c7: int) -> nn.Module:
    def row(a: int, b: int) -> nn.Module:  # a 1×7 convolution
        return _conv(a, b, (1, 7), padding=(0, 3))

    def column(a: int, b: int) -> nn.Module:  # a 7×1 convolution
        return _conv(a, b, (7, 1), padding=(3, 0))

    return _Branches(_conv(cin, 192, 1),
                     nn.Sequential(_conv(cin, c7, 1), row(c7, c7), column(c7, 192)),
                     nn.Sequential(_conv(cin, c7, 1), column(c7, c7), row(c7, c7), column(c7, c7), row(c7, 192)),
                     _pool_branch(cin, 192))


def _inception_d(cin: int) -> nn.Module:
    return _Branches(nn.Sequential(_conv(cin, 192, 1), _conv(192, 320, 3, 2)),
                     nn.Sequential(_conv(cin, 192, 1), _conv(192, 192, (1, 7), padding=(0, 3)),
                                   _conv(192, 192, (7, 1), padding=(3, 0)), _conv(192, 192, 3, 2)),
                     nn.MaxPool2d(3, 2))


def _inception_e(cin: int) -> nn.Module:
    def split(width: int) -> nn.Module:
        return _Branches(_conv(width, 384, (1, 3), padding=(0, 1)), _conv(width, 384, (3, 1), padding=(1, 0)))

    return _Branches(_conv(cin, 320, 1),
                     nn.Sequential(_conv(cin, 384, 1), split(384)),
                     nn.Sequential(_conv(cin, 448, 1), _conv(448, 384, 3, padding=1), split(384)),
                     _pool_branch(cin, 192))


def inception_v3() -> nn.Module:
    """Inception V3 (Szegedy et al. 2016) for 299×299 ImageNet, without the auxiliary classifier."""
    return nn.Sequential(
        _conv(3, 32, 3, 2), _conv(32, 32, 3), _conv(32, 64, 3, padding=1), nn.MaxPool2d(3, 2),
        _conv(64, 80, 1), _conv(80, 192, 3), nn.MaxPool2d(3, 2),
        _inception_a(192, 32), _inception_a(256, 64), _inception_a(288, 64), _inception_b(288),
        _inception_c(768, 128), _inception_c(768, 160), _inception_c(768, 160), _inception_c(768, 192),
        _inception_d(768), _inception_e(1280), _inception_e(2048),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000),
    )


class _EncoderLayer(nn.Module):
    """Post-norm transformer encoder layer (BERT): attention written out so every matmul is counted."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm1 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.norm2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5, dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        x = self.norm1(x + self.out(attended))
        return self.norm2(x + self.mlp(x))


class _Bert(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocabulary: int, positions: int) -> None:
        super().__init__()
        self.words = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(positions, width)
        self.segments = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width)
        self.layers = nn.Sequential(*(_EncoderLayer(width, heads) for _ in range(layers)))
        self.pooler = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.norm(self.words(tokens) + self.positions(positions) + self.segments(torch.zeros_like(tokens)))
        x = self.layers(x)
        return torch.tanh(self.pooler(x[:, 0]))


def bert(layers: int = 24, width: int = 1024, heads: int = 16) -> nn.Module:
    """BERT's encoder with its pooler (Devlin et al. 2019; 24 × 1024 is BERT-large), 30,522 tokens, 512 positions.

    Pre-training heads are left out: their output layer shares the word embedding.
    """
    return _Bert(layers, width, heads, 30522, 512)


class _Gpt(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocabulary: int, positions: int) -> None:
        super().__init__()
        self.words = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(positions, width)
        self.layers = nn.Sequential(*(_EncoderLayer(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.norm(self.layers(self.words(tokens) + self.positions(positions)))
        return x @ self.words.weight.t()  # the output layer is the word embedding, transposed


def gpt(layers: int, width: int, heads: int, vocabulary: int = 51200, positions: int = 1024) -> nn.Module:
    """A GPT-2-style decoder with a tied output layer (Radford et al. 2019; Megatron-LM pads the vocabulary to
    51,200). The causal mask changes no shape or FLOP count the planner reads, so it is left out."""
    return _Gpt(layers, width, heads, vocabulary, positions)
