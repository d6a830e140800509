"""MAGREF's reference canvas (a2.pipeline.magref_canvas) against MAGREF's own rule, written out here as its
magref/subject2video.py (MAGREF-Video/MAGREF e3c71b2) runs it: process_refimg's grid, shuffles and paste, and
resize_and_pad's fit-and-centre with white padding and its 0/1 mask. On the real photos."""

import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from a2.pipeline import magref_canvas

PHOTOS = ("a2_human.png", "a2_thing.png", "a2_env.png")


def their_canvas(images, height, width):
    """MAGREF's process_refimg + resize_and_pad, step by step, with Python's global random as it uses it."""
    n = len(images)
    scale = min([s for s in [1, 2, 3, 4, 6, 8] if s >= n], default=8)
    W, H = width, height
    if scale == 1:
        layout = [(0, 0, W, H)]
    elif scale == 2:
        layout = [(0, 0, W // 2, H), (W // 2, 0, W, H)]
    elif scale == 3:
        b = W // 3
        layout = [(0, 0, b, H), (b, 0, 2 * b, H), (2 * b, 0, W, H)]
    elif scale == 4:
        bw, bh = W // 2, H // 2
        layout = [(0, 0, bw, bh), (bw, 0, W, bh), (0, bh, bw, H), (bw, bh, W, H)]
    elif scale == 6:
        bw, bh = W // 3, H // 2
        layout = [(0, 0, bw, bh), (bw, 0, 2 * bw, bh), (2 * bw, 0, W, bh),
                  (0, bh, bw, H), (bw, bh, 2 * bw, H), (2 * bw, bh, W, H)]
    else:
        bw, bh = W // 4, H // 2
        layout = [(0, 0, bw, bh), (bw, 0, 2 * bw, bh), (2 * bw, 0, 3 * bw, bh), (3 * bw, 0, W, bh),
                  (0, bh, bw, H), (bw, bh, 2 * bw, H), (2 * bw, bh, 3 * bw, H), (3 * bw, bh, W, H)]
    canvas = Image.new("RGB", (W, H), (255, 255, 255))
    mask = np.zeros((H, W), dtype=np.uint8)
    indices = list(range(n))
    random.shuffle(indices)
    random.shuffle(layout)
    for i, (x0, y0, x1, y1) in zip(indices[:len(layout)], layout):
        img = images[i].convert("RGB")
        tw, th = x1 - x0, y1 - y0
        img_ratio, target_ratio = img.width / img.height, tw / th
        if img_ratio > target_ratio:
            new_w = tw
            new_h = int(new_w / img_ratio)
        else:
            new_h = th
            new_w = int(new_h * img_ratio)
        img = img.resize((new_w, new_h), Image.Resampling.LANCZOS)
        pw, ph = tw - new_w, th - new_h
        padding = (pw // 2, ph // 2, pw - pw // 2, ph - ph // 2)
        block = ImageOps.expand(img, padding, fill=(255, 255, 255))
        block_mask = ImageOps.expand(Image.new("L", (new_w, new_h), color=1), padding, fill=0)
        mask[y0:y1, x0:x1] = np.asarray(block_mask, dtype=np.uint8)
        canvas.paste(block, (x0, y0))
    return canvas, mask


def their_latent_mask(mask, factor=8):
    """process_refimg's downsample_mask: a latent cell is 1 when any pixel of its 8x8 patch is."""
    h, w = mask.shape
    out = np.zeros((h // factor, w // factor), dtype=np.uint8)
    for i in range(h // factor):
        for j in range(w // factor):
            out[i, j] = mask[i * factor:(i + 1) * factor, j * factor:(j + 1) * factor].any()
    return out


@pytest.fixture(scope="module")
def photos(shared_data):
    return [Image.open(shared_data / p).convert("RGB") for p in PHOTOS]


@pytest.mark.parametrize("n,seed", [(1, 0), (2, 1), (3, 2), (3, 7), (5, 3), (8, 4)])
def test_canvas_is_magrefs(photos, n, seed):
    """1-8 references (the three photos repeated) at MAGREF's 480x832: the same canvas pixels and mask as MAGREF's
    rule after random.seed(seed), with random.Random(seed); the latent mask of the spec (max-pool 8) is theirs."""
    images = [photos[i % 3] for i in range(n)]
    random.seed(seed)
    want_canvas, want_mask = their_canvas(images, 480, 832)
    canvas, mask = magref_canvas(images, (480, 832), rng=random.Random(seed))
    assert canvas.size == (832, 480) and mask.shape == (480, 832) and mask.dtype == torch.bool
    assert np.array_equal(np.asarray(canvas), np.asarray(want_canvas))
    assert np.array_equal(mask.numpy(), want_mask.astype(bool))
    assert 0 < mask.sum() < mask.numel() or n == 1  # white margins exist unless one photo fills the canvas
    assert (np.asarray(canvas)[~mask.numpy()] == 255).all()  # outside the references: white
    pooled = torch.nn.functional.max_pool2d(mask[None, None].float(), 8)[0, 0]
    assert np.array_equal(pooled.numpy().astype(np.uint8), their_latent_mask(want_mask))


def test_canvas_without_rng_places_in_order(photos):
    """rng=None: reference i in block i (left to right), which is MAGREF's placement when the shuffles leave the
    order unchanged; at another video size (the grid follows the size)."""
    canvas, mask = magref_canvas(photos, (256, 384))
    third = 384 // 3
    for i, photo in enumerate(photos):
        cols = mask[:, i * third:(i + 1) * third if i < 2 else 384].any(0).nonzero()
        rows = mask[:, i * third:(i + 1) * third if i < 2 else 384].any(1).nonzero()
        w, h = int(cols.max() - cols.min() + 1), int(rows.max() - rows.min() + 1)
        assert abs(w / h - photo.width / photo.height) < 0.05  # aspect kept, each in its own block


def test_canvas_bad_input(photos):
    with pytest.raises(ValueError, match=r"^a\.png, .*at most 8$"):
        magref_canvas([photos[0]] * 9, (480, 832), names=["a.png"] + ["b.png"] * 8)
    with pytest.raises(ValueError, match="no references"):
        magref_canvas([], (480, 832))
    strip = Image.new("RGB", (3000, 100), (10, 20, 30))  # 277 px wide in a third of 832 -> 9 px high
    with pytest.raises(ValueError, match=r"^strip\.png: a 3000x100 reference is 277x9 px in its 277x480 block .*"
                                         r"fewer references$"):
        magref_canvas([photos[0], strip, photos[1]], (480, 832), names=["h.png", "strip.png", "t.png"])
    canvas, mask = magref_canvas([strip], (480, 832))  # alone it has the whole width: 832x27
    assert mask.sum() == 832 * 27
