"""Reference-image augmentation (--reference-augment): RefAlign trains with heavily augmented references so that the
model copies the subject, not the photo (its list: blur, colour/brightness jitter, flip, shear, rotation up to 45
degrees, perspective, scale/translate). Its loader ships compiled, so the magnitudes below are ours, stated here:

  flip        horizontal, p 0.5
  affine      p 0.8: rotation U(-45, 45) deg, shear U(-10, 10) deg, scale U(0.8, 1.1), shift U(-0.1, 0.1) of the size
  perspective p 0.3: each corner moved by U(-0.1, 0.1) of the size
  colour      p 0.8: brightness, contrast and saturation factors U(0.8, 1.2)
  blur        p 0.3: Gaussian, sigma U(0.1, 2.0) px

Applied with torchvision's functional transforms. Uncovered pixels are white (the references are cut-outs on white).
Every draw comes from the sample's own generator (a2/flow.py sample_generator, stream AUGMENT_STREAM), so an
augmentation is a function of (seed, step, sample) alone: one process and N ranks, and a resumed run, see the same
images. The augmented image is what the VAE encodes and what
the alignment targets (a2/align.py) are computed from. A precompute cache holds latents of the images as read, so
augmentation needs the pixels (train_a2.py refuses it with --cache-dir).
"""

from __future__ import annotations

import math

import torch
import torchvision.transforms.v2.functional as TF
from torchvision.transforms import InterpolationMode

AUGMENT_STREAM = 1  # sample_generator's stream of the augmentation draws (0: sigma, dropout, noise, posteriors)


def _u(g: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * torch.rand((), generator=g).item()


def augment_image(image: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One (3, H, W) reference in [-1, 1], augmented by the draws of `g` (module docstring); the draws are made in a
    fixed order whatever is applied, so each transform's parameters do not depend on the others'."""
    flip = _u(g, 0, 1) < 0.5
    affine = (_u(g, 0, 1) < 0.8, _u(g, -45, 45), _u(g, -10, 10), _u(g, 0.8, 1.1), _u(g, -0.1, 0.1),
              _u(g, -0.1, 0.1))
    warp = _u(g, 0, 1) < 0.3
    shifts = torch.rand(4, 2, generator=g) * 0.2 - 0.1
    colour = (_u(g, 0, 1) < 0.8, _u(g, 0.8, 1.2), _u(g, 0.8, 1.2), _u(g, 0.8, 1.2))
    blur = (_u(g, 0, 1) < 0.3, _u(g, 0.1, 2.0))
    _, h, w = image.shape
    # white is 0 through the warps, so their zero padding is white to the edge (torchvision's own `fill` blends the
    # edge pixels with black once more)
    x = image.float() - 1  # (3, H, W)
    if flip:
        x = TF.horizontal_flip(x)
    if affine[0]:
        angle, shear, scale, tx, ty = affine[1:]
        x = TF.affine(x, angle=angle, translate=[tx * w, ty * h], scale=scale, shear=[shear, 0.0],
                      interpolation=InterpolationMode.BILINEAR)
    if warp:  # the output's corners read from the input's corners moved by shifts (of the size)
        corners = [[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]]
        moved = [[cx + dx * w, cy + dy * h] for (cx, cy), (dx, dy) in zip(corners, shifts.tolist())]
        x = TF.perspective(x, moved, corners, interpolation=InterpolationMode.BILINEAR)
    x = x / 2 + 1  # [0, 1]: torchvision's colour range
    if colour[0]:
        x = TF.adjust_saturation(TF.adjust_contrast(TF.adjust_brightness(x, colour[1]), colour[2]), colour[3])
    if blur[0]:
        x = TF.gaussian_blur(x, kernel_size=2 * math.ceil(3 * blur[1]) + 1, sigma=blur[1])
    return (x * 2 - 1).clamp(-1, 1).to(image.dtype)


def augment_references(references: torch.Tensor, generators) -> torch.Tensor:
    """(B, N, 3, H, W) references in [-1, 1] -> augmented, sample b's from generators[b] (each reference its own
    draws, in order)."""
    return torch.stack([torch.stack([augment_image(r, g) for r in refs]) for refs, g in zip(references, generators)])
