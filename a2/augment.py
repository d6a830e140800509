"""Reference-image augmentation (--reference-augment): RefAlign trains with heavily augmented references so that the
model copies the subject, not the photo (its list: blur, colour/brightness jitter, flip, shear, rotation up to 45
degrees, perspective, scale/translate). Its loader ships compiled, so the magnitudes below are ours, stated here:

  flip        horizontal, p 0.5
  affine      p 0.8: rotation U(-45, 45) deg, shear U(-10, 10) deg, scale U(0.8, 1.1), shift U(-0.1, 0.1) of the size
  perspective p 0.3: each corner moved by U(-0.1, 0.1) of the size
  colour      p 0.8: brightness, contrast and saturation factors U(0.8, 1.2)
  blur        p 0.3: Gaussian, sigma U(0.1, 2.0) px

Uncovered pixels are white (the references are cut-outs on white). Every draw comes from the sample's own generator
(a2/flow.py sample_generator, stream AUGMENT_STREAM), so an augmentation is a function of (seed, step, sample) alone:
one process and N ranks, and a resumed run, see the same images. The augmented image is what the VAE encodes and what
the alignment targets (a2/align.py) are computed from. A precompute cache holds latents of the images as read, so
augmentation needs the pixels (train_a2.py refuses it with --cache-dir).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

AUGMENT_STREAM = 1  # sample_generator's stream of the augmentation draws (0: sigma, dropout, noise, posteriors)


def _u(g: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * torch.rand((), generator=g).item()


def _white_fill_warp(image: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """grid_sample of a (3, H, W) image in [-1, 1] at grid (1, H, W, 2), white (1) where the grid leaves it."""
    out = F.grid_sample((image - 1)[None], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out[0] + 1


def _affine(image: torch.Tensor, angle: float, shear: float, scale: float, tx: float, ty: float) -> torch.Tensor:
    _, h, w = image.shape
    a, s = math.radians(angle), math.radians(shear)
    # output -> input map in normalised coordinates with the aspect undone (rotation is in pixels, not squares)
    fwd = torch.tensor([[math.cos(a), -math.sin(a + s)], [math.sin(a), math.cos(a + s)]], dtype=torch.float64) * scale
    aspect = torch.diag(torch.tensor([w / 2, h / 2], dtype=torch.float64))
    inv = torch.linalg.inv(aspect) @ torch.linalg.inv(fwd) @ aspect
    theta = torch.cat([inv, -inv @ torch.tensor([[2 * tx], [2 * ty]], dtype=torch.float64)], dim=1)
    grid = F.affine_grid(theta[None].float(), [1, 3, h, w], align_corners=False)
    return _white_fill_warp(image, grid)


def _perspective(image: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Corners (-1,-1), (1,-1), (1,1), (-1,1) of the output read from the input's corners moved by 2·shifts (4, 2)."""
    _, h, w = image.shape
    dst = torch.tensor([[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]], dtype=torch.float64)
    src = dst + 2 * shifts.double()
    rows = []
    for (x, y), (u, v) in zip(dst.tolist(), src.tolist()):  # homography dst -> src, h33 = 1
        rows.append(([x, y, 1, 0, 0, 0, -u * x, -u * y], u))
        rows.append(([0, 0, 0, x, y, 1, -v * x, -v * y], v))
    a = torch.tensor([r for r, _ in rows], dtype=torch.float64)
    b = torch.tensor([t for _, t in rows], dtype=torch.float64)
    hom = torch.cat([torch.linalg.solve(a, b), torch.ones(1, dtype=torch.float64)]).view(3, 3)
    ys = (torch.arange(h, dtype=torch.float64) + 0.5) / h * 2 - 1
    xs = (torch.arange(w, dtype=torch.float64) + 0.5) / w * 2 - 1
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    pts = torch.stack([xx, yy, torch.ones_like(xx)], dim=-1) @ hom.T  # (H, W, 3)
    grid = (pts[..., :2] / pts[..., 2:]).float()[None]  # (1, H, W, 2)
    return _white_fill_warp(image, grid)


def _colour(image: torch.Tensor, brightness: float, contrast: float, saturation: float) -> torch.Tensor:
    x = (image + 1) / 2  # [0, 1]
    x = (x * brightness).clamp(0, 1)
    gray = (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2])[None]  # (1, H, W)
    x = ((x - gray.mean()) * contrast + gray.mean()).clamp(0, 1)
    gray = (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2])[None]
    x = ((x - gray) * saturation + gray).clamp(0, 1)
    return x * 2 - 1


def _blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    r = max(1, math.ceil(3 * sigma))
    k = torch.exp(-0.5 * (torch.arange(-r, r + 1, dtype=torch.float32) / sigma) ** 2)
    k = (k / k.sum()).to(image.dtype)
    x = F.pad(image[None], (r, r, r, r), mode="replicate")
    x = F.conv2d(x, k.view(1, 1, 1, -1).expand(3, 1, 1, -1), groups=3)
    x = F.conv2d(x, k.view(1, 1, -1, 1).expand(3, 1, -1, 1), groups=3)
    return x[0]


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
    x = image.float()
    if flip:
        x = x.flip(-1)
    if affine[0]:
        x = _affine(x, *affine[1:])
    if warp:
        x = _perspective(x, shifts)
    if colour[0]:
        x = _colour(x, *colour[1:])
    if blur[0]:
        x = _blur(x, blur[1])
    return x.clamp(-1, 1).to(image.dtype)


def augment_references(references: torch.Tensor, generators) -> torch.Tensor:
    """(B, N, 3, H, W) references in [-1, 1] -> augmented, sample b's from generators[b] (each reference its own
    draws, in order)."""
    return torch.stack([torch.stack([augment_image(r, g) for r in refs]) for refs, g in zip(references, generators)])
