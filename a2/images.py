"""Element images: read, framed to a size, and MAGREF's canvas; a clip's frames framed alike (resize_frames). The
bottom of the image path: the conditioning (reference_pixels), the pipeline, the data and the metrics all frame
element images with these functions."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from a2.elements import PREPROCESS_MODES

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")  # what a dataset reads as an image


def framing_border(image_size: tuple[int, int], size: tuple[int, int], mode: str) -> tuple[int, int, int, int]:
    """The border (left, top, right, bottom; negative: cut) that brings an image of image_size=(H, W) to the aspect of
    size=(height, width) before its one resize, as A2 frames: center_crop cuts the middle, pad_white and letterbox
    pad both sides the same, so an odd remainder leaves the aspect off by a pixel (A2's rounding); crop and pad sizes
    truncated to whole pixels. Any other mode (resize): no border."""
    (ih, iw), (h, w) = image_size, size
    wider = ih / iw < h / w  # the image is wider than the target aspect
    if mode == "center_crop":
        cut = iw - int(ih / h * w) if wider else ih - int(iw / w * h)
        return (-(cut // 2), 0, -(cut - cut // 2), 0) if wider else (0, -(cut // 2), 0, -(cut - cut // 2))
    if mode in ("pad_white", "letterbox"):
        pad = int(((h / w) * iw - ih) / 2.0) if wider else int(((w / h) * ih - iw) / 2.0)
        return (0, pad, 0, pad) if wider else (pad, 0, pad, 0)
    return 0, 0, 0, 0


def preprocess_image(image: Image.Image, mode: str, size: tuple[int, int]) -> Image.Image:
    """Bring an RGB image to size=(height, width), exactly as SkyReels-A2's infer.py for its two modes, and as
    Phantom-Wan and SkyReels-V3 R2V for theirs (fit_pad_white).

    fit_pad_white: Lanczos-resize to fit inside the size (the long side exact, the other truncated to whole pixels),
    then pad with white, the odd pixel right / bottom (Phantom's and V3's references: resize first, then pad).
    resize: stretch. center_crop: crop the middle to the target aspect, then resize (A2's backgrounds).
    pad_white: pad to the target aspect with white, the image centred, then resize (A2's subjects, objects and
    every CLIP image, at 512x512). letterbox: the same with black padding. Crop and pad sizes are truncated to
    whole pixels as A2 does, and every resize is PIL bicubic (PIL's default, which A2 uses)."""
    if mode not in PREPROCESS_MODES:
        raise ValueError(f"unknown preprocess mode {mode!r}; choose one of {PREPROCESS_MODES}")
    image = image.convert("RGB")
    h, w = size
    iw, ih = image.size
    if mode == "fit_pad_white":
        nw, nh = (w, int(w / (iw / ih))) if iw / ih > w / h else (int(h * (iw / ih)), h)
        image = image.resize((nw, nh), Image.LANCZOS)
        return ImageOps.expand(image, ((w - nw) // 2, (h - nh) // 2, w - nw - (w - nw) // 2,
                                       h - nh - (h - nh) // 2), fill=(255, 255, 255))  # left, top, right, bottom
    left, top, right, bottom = framing_border((ih, iw), size, mode)
    canvas = Image.new("RGB", (iw + left + right, ih + top + bottom), (0, 0, 0) if mode == "letterbox" else
                       (255, 255, 255))
    canvas.paste(image, (left, top))  # a negative border cuts
    return canvas.resize((w, h), Image.BICUBIC)


# MAGREF's canvas grids: the smallest that holds the references, as (rows, columns), blocks filled row by row
MAGREF_GRIDS = {1: (1, 1), 2: (1, 2), 3: (1, 3), 4: (2, 2), 6: (2, 3), 8: (2, 4)}
MAGREF_MIN_SIDE = 16  # px: one transformer token (VAE stride 8 x patch 2); a thinner reference is no token wide


def magref_blocks(n: int, size: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """The blocks (x0, y0, x1, y1) of MAGREF's canvas of size=(height, width) for 1-8 references, row by row: the
    smallest grid of MAGREF_GRIDS with a block per reference, the last row and column taking the remainder."""
    height, width = size
    rows, cols = MAGREF_GRIDS[min(k for k in MAGREF_GRIDS if k >= n)]
    bw, bh = width // cols, height // rows
    return [(c * bw, r * bh, width if c == cols - 1 else (c + 1) * bw, height if r == rows - 1 else (r + 1) * bh)
            for r in range(rows) for c in range(cols)]


def magref_fit(image_size: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """An image's (width, height) fitted into a (width, height) block, aspect kept, sides truncated (MAGREF's)."""
    (iw, ih), (w, h) = image_size, block
    ratio = iw / ih
    return (w, int(w / ratio)) if ratio > w / h else (int(h * ratio), h)


def magref_places(sizes: list[tuple[int, int]], size: tuple[int, int], rng=None, names: list[str] | None = None,
                  min_side: int = MAGREF_MIN_SIDE) -> list[tuple[int, int, int, int, int]]:
    """Where MAGREF's canvas of size=(height, width) puts references of these (width, height) sizes: (reference
    index, left, top, width, height) per reference. The canvas is cut into the smallest grid of MAGREF_GRIDS with a
    block per reference (the last row and column take the remainder of the integer division); each reference is
    fitted to its block (aspect kept, sides truncated to whole pixels) and centred in it. rng: a random.Random that
    shuffles the reference order, then the blocks, as MAGREF does (random.Random(s) places as MAGREF does after
    random.seed(s)); None keeps reference i in block i. Raises a one-line ValueError for no references, more than the
    largest grid holds, or a reference thinner than min_side pixels once placed (names, default "reference <i>", say
    which): what training checks of a clip before step 1, from its images' sizes alone."""
    n = len(sizes)
    names = names or [f"reference {i}" for i in range(n)]
    height, width = size
    if not 0 < n <= max(MAGREF_GRIDS):
        raise ValueError(f"{', '.join(names) or 'no references'}: MAGREF's canvas places 1 to {max(MAGREF_GRIDS)} "
                         f"references (a 2x4 grid at most), got {n}: pass at most {max(MAGREF_GRIDS)}")
    blocks = magref_blocks(n, size)
    order = list(range(n))
    if rng is not None:
        rng.shuffle(order)
        rng.shuffle(blocks)
    places = []
    for i, (x0, y0, x1, y1) in zip(order, blocks):
        w, h = x1 - x0, y1 - y0
        nw, nh = magref_fit(sizes[i], (w, h))
        if min(nw, nh) < min_side:
            raise ValueError(f"{names[i]}: a {sizes[i][0]}x{sizes[i][1]} reference is {nw}x{nh} px in its {w}x{h} "
                             f"block of MAGREF's {width}x{height} canvas ({n} references), under {min_side} px: "
                             "crop it nearer the block's aspect or pass fewer references")
        places.append((i, x0 + (w - nw) // 2, y0 + (h - nh) // 2, nw, nh))
    return places


def canvas_refusal(layout, sizes: list[tuple[int, int]], size: tuple[int, int], names=None) -> str | None:
    """Why MAGREF's canvas at the video's size=(H, W) cannot hold one sample's element images of these (width,
    height) sizes, in position order (magref_places: a reference under a token once placed), else None; None for the
    other kinds (`layout`: a2.kinds.conditioning.Layout), which frame each image to the video's size. `names` (the
    files) say which."""
    if not layout.takes_region:
        return None
    rng = None if layout.placement_seed is None else random.Random(layout.placement_seed)
    try:
        magref_places(sizes, size, rng, names)
    except ValueError as e:
        return str(e)
    return None


def magref_canvas(images: list[Image.Image], size: tuple[int, int], rng=None, names: list[str] | None = None,
                  min_side: int = MAGREF_MIN_SIDE) -> tuple[Image.Image, torch.Tensor]:
    """MAGREF's reference canvas: every reference on one white image of the video's size=(height, width), placed by
    magref_places (its ValueErrors too) and resized there with PIL's Lanczos, and the region mask (H, W) bool that is
    True where a reference's pixels are (False on the white around them). Images are RGB (read_image composites
    transparency on white)."""
    images = [image.convert("RGB") for image in images]
    height, width = size
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    mask = torch.zeros(height, width, dtype=torch.bool)
    for i, left, top, nw, nh in magref_places([image.size for image in images], size, rng, names, min_side):
        canvas.paste(images[i].resize((nw, nh), Image.LANCZOS), (left, top))
        mask[top:top + nh, left:left + nw] = True
    return canvas, mask


def vace_frame(image: Image.Image, size: tuple[int, int], multiple: int | None = None) -> torch.Tensor:
    """A reference image as VACE frames it: (3, H, W) in [-1, 1] for size=(H, W), the image scaled to fit (bilinear,
    on the [-1, 1] tensor, int() of each side) and centred on white. Wan's prepare_source (wan/vace.py:249-277),
    which leaves an image of exactly the video's size as it is. multiple=8: diffusers' WanVACEPipeline
    (preprocess_conditions), which first resizes the image to its sides rounded down to a multiple of 8 (PIL
    Lanczos, VaeImageProcessor) and normalises as 2x - 1 (Wan: (x - 0.5) / 0.5)."""
    image = image.convert("RGB")
    if multiple:
        w, h = image.width - image.width % multiple, image.height - image.height % multiple
        image = image.resize((w, h), Image.LANCZOS) if (w, h) != image.size else image
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)
    x = x.permute(2, 0, 1).float() / 255.0
    x = 2.0 * x - 1.0 if multiple else x.sub(0.5).div(0.5)
    height, width = size
    if not multiple and (image.height, image.width) == (height, width):
        return x
    scale = min(height / image.height, width / image.width)
    h, w = int(image.height * scale), int(image.width * scale)
    canvas = torch.ones(3, height, width)
    top, left = (height - h) // 2, (width - w) // 2
    canvas[:, top:top + h, left:left + w] = F.interpolate(x[None], size=(h, w), mode="bilinear",
                                                          align_corners=False)[0]
    return canvas


FRAMINGS = ("element", "face", "fit_white", "canvas")  # Kind.framing: how a kind frames its reference images


def reference_pixels(layout, images, elements, size: tuple[int, int], clip_size: tuple[int, int],
                     names: list[str] | None = None):
    """Element images (RGB, read_image's, in position order) as `layout`'s kind frames them (Kind.framing, the one
    place): (vae (N, 3, H, W) and clip (N, 3, h, w) in [-1, 1], region (H, W) bool or None), by training (data.py)
    and sampling (load_references) alike. `elements`: their a2.elements.Element rows; size=(H, W) the video's.

    element (and layout None): each image framed to the video's size by its element's VAE preprocess, no region.
    face: Stand-In's reference as its FaceProcessor crop, fit_pad_white (white pad to square, Lanczos) at the
      layout's reference_size (512x512) whatever the video's size and the element's vae_preprocess.
    fit_white: each image framed by VACE's own arithmetic (vace_frame; diffusers' with the layout's
      reference_multiple), whatever its element's vae_preprocess.
    canvas: MAGREF places each image as it is (aspect kept) on its canvas, so vae is the one canvas (1, 3, H, W)
      made from the images themselves, no element preprocess (magref_canvas, layout.placement_seed), and region
      where their pixels are on it. A reference thinner than a token once placed is a one-line ValueError naming it
      (`names`, e.g. the files).
    clip: each element's CLIP-path image (clip_preprocess), whatever the framing (magref's CLIP tokens are the
    canvas', these are what the metrics compare the video with)."""
    framing = "element" if layout is None else layout.definition.framing
    clip = [pil_to_tensor(preprocess_image(image, e.clip_preprocess, clip_size)) for image, e in zip(images, elements)]
    clip = torch.stack(clip) if clip else torch.zeros(0, 3, *clip_size)
    if framing == "canvas":
        rng = None if layout.placement_seed is None else random.Random(layout.placement_seed)
        canvas, region = magref_canvas(list(images), size, rng, names)
        return pil_to_tensor(canvas)[None], clip, region
    if framing == "fit_white":
        vae = [vace_frame(image, size, layout.reference_multiple) for image in images]
    elif framing == "face":
        vae = [pil_to_tensor(preprocess_image(image, "fit_pad_white", layout.reference_size)) for image in images]
    else:
        vae = [pil_to_tensor(preprocess_image(image, e.vae_preprocess, size)) for image, e in zip(images, elements)]
    return torch.stack(vae) if vae else torch.zeros(0, 3, *size), clip, None


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL -> (3, H, W) float in [-1, 1] (the VAE's pixel range)."""
    # /255 then 2x-1 in float32, exactly as diffusers' VaeImageProcessor (bit-parity with its I2V pipeline)
    x = torch.from_numpy(np.asarray(image.convert("RGB")).astype(np.float32) / 255.0)
    return (2.0 * x - 1.0).permute(2, 0, 1).contiguous()


def read_image(path) -> Image.Image:
    """An image file as the RGB picture it means: fully decoded (a truncated file fails here, not mid-run), EXIF
    orientation applied, transparency composited on white (A2's references are white-background cut-outs; black
    would show inside pad_white's white padding), 16-bit brought to 8 bits (PIL's own convert clips it to white).
    The one image reader of training, validation and inference. Raises ValueError saying what is wrong."""
    try:
        with Image.open(path) as im:
            im.load()
            image = ImageOps.exif_transpose(im)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error... for damaged files
        raise ValueError(f"not a readable image ({type(e).__name__}: {e})") from e
    if image.mode.startswith("I"):  # I;16 / I: 16-bit samples, 0..65535
        image = Image.fromarray((np.asarray(image, np.float64) / 257).round().clip(0, 255).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")  # L, P, CMYK, YCbCr, 1: PIL's conversions keep their brightness


def tensor_to_uint8(x: torch.Tensor) -> np.ndarray:
    """(..., 3, H, W) in [-1, 1] -> (..., H, W, 3) uint8 (inverse of pil_to_tensor on uint8 images)."""
    x = ((x.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return x.movedim(-3, -1).numpy()


def resize_frames(frames: np.ndarray, mode: str, size: tuple[int, int]) -> torch.Tensor:
    """(F, H, W, 3) uint8 -> (3, F, h, w) float in [-1, 1], framed like a2.images.preprocess_image.

    Resizes in uint8, channels-last: PyTorch's vectorised uint8 bicubic kernel is ~50x faster than the float one
    (81 frames to 480x832: 0.1 s vs 4-5 s on one core) and differs from it only by the final rounding."""
    h, w = size
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)  # (F, 3, H, W) uint8, channels-last in memory
    ih, iw = x.shape[-2:]
    # preprocess_image's framing: crop or pad to the target aspect first, then one resize
    left, top, right, bottom = framing_border((ih, iw), size, mode)
    if left or top or right or bottom:  # (a copy) a negative pad cuts
        x = F.pad(x, (left, right, top, bottom), value=0 if mode == "letterbox" else 255)
    x = x.contiguous(memory_format=torch.channels_last)  # the fast uint8 kernel's layout
    x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    x = x.permute(1, 0, 2, 3).contiguous()  # (3, F, h, w), rearranged while still 1 byte per value
    return x.to(torch.float32).mul_(2 / 255).sub_(1)


def load_references(items, size: tuple[int, int], clip_size: tuple[int, int] = (512, 512), layout=None):
    """[(Element, image path), ...] -> (vae (1, N, 3, H, W), clip (1, N, 3, h, w), repeats, region), in position
    order, as `layout`'s kind takes them (reference_pixels; None: each element framed to the size):
    the magref kind's vae is its one canvas (N = 1) and region (1, H, W) where the images are on it, else None.

    Errors name the file: a missing or unreadable image, or one MAGREF's canvas cannot hold, stops here, before any
    model is loaded."""
    items = sorted(items, key=lambda it: it[0].position)
    images = []
    for element, path in items:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{path}: element '{element.name}' is a dir, not an image: give image files (e.g. "
                             f"{next(iter(sorted(path.glob('*.png'))), path / 'subject.png')})")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: element '{element.name}' image not found")
        try:
            images.append(read_image(path))
        except ValueError as e:
            raise ValueError(f"{path}: element '{element.name}' is {e}") from e
    vae, clip, region = reference_pixels(layout, images, [e for e, _ in items], size, clip_size,
                                         [str(p) for _, p in items])
    repeats = tuple(e.repeat for e, _ in items)
    return vae[None], clip[None], repeats, None if region is None else region[None]


def load_first_frame(path, size: tuple[int, int]) -> torch.Tensor:
    """An image file as the (1, 3, H, W) first frame of 5B image-to-video, resized to size=(H, W) with Lanczos as
    diffusers' VideoProcessor does. Raises ValueError naming the file."""
    try:
        image = read_image(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: first frame image is {e}") from e
    return pil_to_tensor(image.resize((size[1], size[0]), Image.LANCZOS))[None]
