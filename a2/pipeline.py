"""A2Pipeline: Elements-to-Video inference on Wan, and THE conditioning code (`prepare_latents`).

Training imports `prepare_latents`, `preprocess_image` and `element_tensors` from here, so what a
model is trained on and what it is sampled with are built by the same lines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from diffusers.loaders import WanLoraLoaderMixin
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image, ImageOps
from tqdm import tqdm

from a2.transformer import TEXT_TOKENS, expert_for_timestep, is_e2v

VAE_T = 4  # Wan VAE temporal compression: latent t>0 holds pixel frames 4t-3 .. 4t
VAE_S = 8  # and spatial (Wan 2.1's VAE; Wan 2.2's is 16: vae_scale)
PREPROCESS_MODES = ("resize", "center_crop", "pad_white", "letterbox")


# ---------------------------------------------------------------- element images


def preprocess_image(image: Image.Image, mode: str, size: tuple[int, int]) -> Image.Image:
    """Bring an RGB image to size=(height, width), exactly as SkyReels-A2's infer.py for its two modes.

    resize: stretch. center_crop: crop the middle to the target aspect, then resize (A2's backgrounds).
    pad_white: pad to the target aspect with white, the image centred, then resize (A2's subjects, objects and
    every CLIP image, at 512x512). letterbox: the same with black padding. Crop and pad sizes are truncated to
    whole pixels as A2 does, and every resize is PIL bicubic (PIL's default, which A2 uses)."""
    if mode not in PREPROCESS_MODES:
        raise ValueError(f"unknown preprocess mode {mode!r}; choose one of {PREPROCESS_MODES}")
    image = image.convert("RGB")
    h, w = size
    iw, ih = image.size
    wider = ih / iw < h / w  # the image is wider than the target aspect
    if mode == "center_crop":
        if wider:
            cw = int(ih / h * w)
            left = (iw - cw) // 2
            image = image.crop((left, 0, left + cw, ih))
        else:
            ch = int(iw / w * h)
            top = (ih - ch) // 2
            image = image.crop((0, top, iw, top + ch))
    elif mode in ("pad_white", "letterbox"):
        fill = (255, 255, 255) if mode == "pad_white" else (0, 0, 0)
        # the same pad on both sides, so an odd remainder makes the padded aspect off by a pixel (A2's rounding)
        if wider:
            pad = int(((h / w) * iw - ih) / 2.0)
            canvas, at = Image.new("RGB", (iw, ih + 2 * pad), fill), (0, pad)
        else:
            pad = int(((w / h) * ih - iw) / 2.0)
            canvas, at = Image.new("RGB", (iw + 2 * pad, ih), fill), (pad, 0)
        canvas.paste(image, at)
        image = canvas
    return image.resize((w, h), Image.BICUBIC)


# MAGREF's canvas grids: the smallest that holds the references, as (rows, columns), blocks filled row by row
MAGREF_GRIDS = {1: (1, 1), 2: (1, 2), 3: (1, 3), 4: (2, 2), 6: (2, 3), 8: (2, 4)}
MAGREF_MIN_SIDE = 16  # px: one transformer token (VAE stride 8 x patch 2); a thinner reference is no token wide


def magref_canvas(images: list[Image.Image], size: tuple[int, int], rng=None, names: list[str] | None = None,
                  min_side: int = MAGREF_MIN_SIDE) -> tuple[Image.Image, torch.Tensor]:
    """MAGREF's reference canvas: every reference on one white image of the video's size=(height, width), and the
    region mask (H, W) bool that is True where a reference's pixels are (False on the white around them).

    The canvas is cut into the smallest grid of MAGREF_GRIDS with a block per reference (the last row and column
    take the remainder of the integer division); each reference is resized (PIL Lanczos, aspect kept, sides
    truncated to whole pixels) to fit its block and centred in it. rng: a random.Random that shuffles the reference
    order, then the blocks, as MAGREF does (random.Random(s) places as MAGREF does after random.seed(s)); None
    keeps reference i in block i. Images are RGB (read_image composites transparency on white). Raises a one-line
    ValueError for no references, more than the largest grid holds, or a reference thinner than min_side pixels
    once placed (names, default "reference <i>", say which)."""
    n = len(images)
    names = names or [f"reference {i}" for i in range(n)]
    height, width = size
    if not 0 < n <= max(MAGREF_GRIDS):
        raise ValueError(f"{', '.join(names) or 'no references'}: MAGREF's canvas places 1 to {max(MAGREF_GRIDS)} "
                         f"references (a 2x4 grid at most), got {n}: pass at most {max(MAGREF_GRIDS)}")
    rows, cols = MAGREF_GRIDS[min(k for k in MAGREF_GRIDS if k >= n)]
    bw, bh = width // cols, height // rows
    blocks = [(c * bw, r * bh, width if c == cols - 1 else (c + 1) * bw, height if r == rows - 1 else (r + 1) * bh)
              for r in range(rows) for c in range(cols)]  # (x0, y0, x1, y1)
    order = list(range(n))
    if rng is not None:
        rng.shuffle(order)
        rng.shuffle(blocks)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    mask = torch.zeros(height, width, dtype=torch.bool)
    for i, (x0, y0, x1, y1) in zip(order, blocks):
        image = images[i].convert("RGB")
        w, h = x1 - x0, y1 - y0
        ratio = image.width / image.height
        nw, nh = (w, int(w / ratio)) if ratio > w / h else (int(h * ratio), h)
        if min(nw, nh) < min_side:
            raise ValueError(f"{names[i]}: a {image.width}x{image.height} reference is {nw}x{nh} px in its {w}x{h} "
                             f"block of MAGREF's {width}x{height} canvas ({n} references), under {min_side} px: "
                             "crop it nearer the block's aspect or pass fewer references")
        left, top = x0 + (w - nw) // 2, y0 + (h - nh) // 2
        canvas.paste(image.resize((nw, nh), Image.LANCZOS), (left, top))
        mask[top:top + nh, left:left + nw] = True
    return canvas, mask


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL -> (3, H, W) float in [-1, 1] (the VAE's pixel range)."""
    # /255 then 2x-1 in float32, exactly as diffusers' VaeImageProcessor (bit-parity with its I2V pipeline)
    x = torch.from_numpy(np.asarray(image.convert("RGB")).astype(np.float32) / 255.0)
    return (2.0 * x - 1.0).permute(2, 0, 1).contiguous()


def element_tensors(image: Image.Image, element, size: tuple[int, int], clip_size: tuple[int, int]):
    """One element image -> (vae (3, H, W) in [-1, 1], clip (3, h, w) in [-1, 1]).

    `element` needs `.vae_preprocess` and `.clip_preprocess` (config.Element). The CLIP tensor is
    the image at the CLIP resolution before CLIPImageProcessor, which `encode_image` applies."""
    vae = pil_to_tensor(preprocess_image(image, element.vae_preprocess, size))
    clip = pil_to_tensor(preprocess_image(image, element.clip_preprocess, clip_size))
    return vae, clip


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


def load_references(items, size: tuple[int, int], clip_size: tuple[int, int] = (512, 512)):
    """[(Element, image path), ...] -> (vae (1, N, 3, H, W), clip (1, N, 3, h, w), repeats), in position order.

    Errors name the file: a missing or unreadable image stops here, before any model is loaded."""
    items = sorted(items, key=lambda it: it[0].position)
    vae, clip = [], []
    for element, path in items:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: element '{element.name}' image not found")
        try:
            image = read_image(path)
        except ValueError as e:
            raise ValueError(f"{path}: element '{element.name}' is {e}") from e
        v, c = element_tensors(image, element, size, clip_size)
        vae.append(v)
        clip.append(c)
    repeats = tuple(e.repeat for e, _ in items)
    return torch.stack(vae)[None], torch.stack(clip)[None], repeats


def tensor_to_uint8(x: torch.Tensor) -> np.ndarray:
    """(..., 3, H, W) in [-1, 1] -> (..., H, W, 3) uint8 (inverse of pil_to_tensor on uint8 images)."""
    x = ((x.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return x.movedim(-3, -1).numpy()


# ---------------------------------------------------------------- text and image encoders


def encode_prompt(tokenizer, text_encoder, prompts: list[str], max_length: int = TEXT_TOKENS) -> torch.Tensor:
    """T5 embeddings (B, 512, D): real tokens then exact zeros, as Wan was trained.

    Always 512 tokens: diffusers' Wan attention takes the last 512 context tokens as text and the
    rest as image tokens, so a shorter text would silently be read as image tokens."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    prompts = [prompt_clean(p) for p in prompts]
    inputs = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                       add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
    seq_lens = mask.gt(0).sum(dim=1)
    emb = text_encoder(ids, mask).last_hidden_state  # (B, 512, D)
    keep = torch.arange(max_length, device=device)[None, :] < seq_lens[:, None]
    return emb * keep[..., None].to(emb.dtype)


def encode_image(image_encoder, image_processor, clip_pixels: torch.Tensor) -> torch.Tensor:
    """CLIP penultimate hidden states of each element, concatenated in position order.

    clip_pixels: (B, N, 3, h, w) in [-1, 1], already preprocessed to the CLIP resolution.
    Returns (B, N*257, C). The uint8 round trip is exact for images that came from uint8 files, and
    lets CLIPImageProcessor do the same resize/crop/normalise as for a PIL image."""
    b, n = clip_pixels.shape[:2]
    images = list(tensor_to_uint8(clip_pixels.flatten(0, 1)))
    device = next(image_encoder.parameters()).device
    pixel_values = image_processor(images=images, return_tensors="pt").pixel_values
    pixel_values = pixel_values.to(device, next(image_encoder.parameters()).dtype)
    hidden = image_encoder(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-2]
    return hidden.reshape(b, n * hidden.shape[1], hidden.shape[2])  # (B, N*257, C)


# ---------------------------------------------------------------- VAE latents


def latent_stats(vae, device, dtype):
    mean = torch.tensor(vae.config.latents_mean, device=device, dtype=dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device, dtype=dtype).view(1, -1, 1, 1, 1)
    return mean, std


def encode_vae(vae, pixels: torch.Tensor, sample_mode: str = "argmax", generator=None) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> normalised latents (B, 16, (F-1)//4+1, H/8, W/8), float32.

    sample_mode "sample" draws from the posterior with `generator` (SkyReels-A2), "argmax" takes
    its mode (diffusers' Wan I2V)."""
    if sample_mode not in ("sample", "argmax"):
        raise ValueError(f"sample_mode must be 'sample' or 'argmax', got {sample_mode!r}")
    vae_param = next(vae.parameters())
    dist = vae.encode(pixels.to(vae_param.device, vae_param.dtype)).latent_dist
    z = dist.sample(generator) if sample_mode == "sample" else dist.mode()
    z = z.float()
    mean, std = latent_stats(vae, z.device, z.dtype)
    return (z - mean) * (1.0 / std)  # not `/ std`: SkyReels-A2 and diffusers multiply by the reciprocal (1 ulp)


class PosteriorCache:
    """Stands in for the VAE in encode_vae, so that prepare_latents runs unchanged on precomputed latents.

    Recording (`vae` given): encodes as the VAE does and keeps each call's posterior parameters (mean | logvar).
    Replaying (`posteriors` given): hands them out in call order; the pixels are not looked at (they may be
    meta tensors), only their shape is checked against the posterior. Sampling then happens in encode_vae as
    for a live VAE, with the same generators, so training from the cache equals training from pixels."""

    def __init__(self, latents_config: dict, posteriors: list[torch.Tensor] | None = None, vae=None):
        self.config = SimpleNamespace(**latents_config)  # latents_mean, latents_std
        self.vae, self.posteriors, self.calls = vae, list(posteriors or []), 0

    def parameters(self):
        if self.vae is not None:
            return self.vae.parameters()
        return iter([torch.empty(0, device="meta")])  # pixels.to(meta) in encode_vae: a no-op

    def encode(self, pixels: torch.Tensor):
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if self.vae is not None:
            dist = self.vae.encode(pixels).latent_dist
            self.posteriors.append(dist.parameters)
            return SimpleNamespace(latent_dist=dist)
        if self.calls >= len(self.posteriors):
            raise RuntimeError(f"the cache holds {len(self.posteriors)} VAE encodes for this batch; asked for more")
        params = self.posteriors[self.calls]  # (B, 2·16, T, h, w)
        self.calls += 1
        b, _, f, h, w = pixels.shape
        s = vae_scale(self)
        if params.shape[0] != b or params.shape[2:] != (num_latent_frames(f), h // s, w // s):
            raise RuntimeError(f"cached posterior {tuple(params.shape)} does not fit pixels {tuple(pixels.shape)}: "
                               "the cache was built for another layout; rebuild it with --precompute")
        return SimpleNamespace(latent_dist=DiagonalGaussianDistribution(params))


def decode_vae(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, 16, T, h, w) -> pixels (B, 3, 4(T-1)+1, H, W) in [-1, 1]."""
    vae_param = next(vae.parameters())
    mean, std = latent_stats(vae, latents.device, torch.float32)
    z = latents.float() / (1.0 / std) + mean  # diffusers' Wan pipelines: latents / (1 / std) + mean
    return vae.decode(z.to(vae_param.device, vae_param.dtype), return_dict=False)[0].float().clamp(-1, 1)


def vae_scale(vae) -> int:
    """The VAE's spatial compression: 8 (Wan 2.1), 16 (Wan 2.2's patchified VAE, `scale_factor_spatial`)."""
    return getattr(vae.config, "scale_factor_spatial", None) or VAE_S


def num_latent_frames(num_frames: int) -> int:
    return (num_frames - 1) // VAE_T + 1


def frame_mask(cond_frames: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """Per-pixel-frame conditioning flags (B, F) -> the 4-channel latent mask (B, 4, T, h, w).

    Wan's rule: the first frame's flag is repeated 4 times (the causal VAE's first latent holds one
    frame), then the F+3 flags are read as (T, 4): channel c of latent t is pixel frame 4t+c-3."""
    b, f = cond_frames.shape
    flags = torch.cat([cond_frames[:, :1].repeat(1, VAE_T - 1), cond_frames], dim=1).float()  # (B, F+3)
    mask = flags.view(b, -1, VAE_T).transpose(1, 2)  # (B, 4, T)
    return mask[..., None, None].expand(-1, -1, -1, *latent_hw).contiguous()


def num_ref_latents(repeats, combine: str = "before") -> int:
    """Latent frames the elements occupy: the R = sum(repeats) frames encoded together (before), or
    1 + (r-1)//4 latents per element encoded alone (after). A2's 1/4/4 gives 3 either way."""
    if combine == "before":
        return num_latent_frames(sum(repeats))
    return sum(num_latent_frames(r) for r in repeats)


REFERENCE_LAYOUTS = ("channel", "incontext")  # where the reference latents enter the transformer (docs below)
REFERENCE_TIMESTEPS = ("shared", "zero")  # incontext: the timestep of the reference tokens


@dataclass
class Conditioning:
    condition: torch.Tensor | None  # channel: (B, 20, T, h, w) mask (4) | condition latents (16), the extra input
    num_ref_latents: int  # latent frames at the start that hold references (prefix layout), else 0
    ref_latents: torch.Tensor | None  # prefix: (B, C, L_ref, h, w), the start of x0; incontext: the clean latents
    # appended after the video latents (None: no elements)
    layout: str = "channel"  # channel (mask | condition on the channel axis) | incontext (references on the time axis)
    #                          | clean (Wan 2.2 TI2V-5B: clean leading latents in x_t itself)
    reference_timestep: str = "shared"  # incontext: shared (the sample's timestep, Phantom) | zero (0 on their tokens)
    clean: torch.Tensor | None = None  # clean: (B, C, T_c, h, w) the leading frames' latents (ti2v_model_input)


def prepare_latents(
    vae,
    num_frames: int,
    *,
    references: torch.Tensor | None = None,
    repeats: tuple[int, ...] = (),
    combine: str = "before",
    video: torch.Tensor | None = None,
    cond_frame_indices: tuple[int, ...] = (),
    sample_mode: str = "argmax",
    generator=None,
    layout: str = "channel",
    reference_timestep: str = "shared",
) -> Conditioning:
    """THE conditioning of the E2V/I2V transformer, shared by training and inference.

    layout `prefix` (A2): `references` (B, N, 3, H, W) in [-1, 1], in position order; element i
      fills `repeats[i]` pixel frames of a mini-video, zeros fill it up to `num_frames`.
      combine="before": the whole mini-video is VAE-encoded at once (A2's default);
      combine="after": each element's frames are encoded alone, the latents concatenated and
      zero-padded (in normalised latent space) to T latent frames.
    layout `inplace` (Wan I2V / FLF2V): `video` (B, 3, F, H, W) holds the conditioning frames at
      `cond_frame_indices` (other frames are zeroed here), and they are encoded in place.
    The mask marks the conditioning pixel frames by `frame_mask`'s rule. With sample_mode="sample"
    the posterior is sampled with `generator` (A2 draws its noise first, then this).

    layout="incontext" (Phantom-Wan / SkyReels-V3 R2V style, for a model whose input is the latents alone: Wan T2V,
      Wan 2.2 TI2V-5B; no channel widening, so a LoRA trains it): each element is VAE-encoded alone as a clip of
      `repeats[i]` frames (as combine="after"; `combine` does not apply), in position order, giving
      L_ref = sum(1 + (r-1)//4) latent frames (one per element with repeat 1..4, as Phantom and V3 encode one
      frame per reference). Returns them clean as `ref_latents` (B, C, L_ref, h, w); `condition` is None.
      `model_input` appends them AFTER the noisy video latents on the time axis, at every training step and every
      sampling step, never noised (sigma 0); RoPE positions simply continue the time axis (frames T..T+L_ref-1),
      as in both. `num_frames` is the video's alone: the references come on top (Phantom, V3).
      reference_timestep: "shared" (default) gives the reference tokens the sample's timestep, as Phantom and V3 do
      (their transformers take one timestep per sample); "zero" gives them timestep 0 (they are clean), through
      diffusers' per-token timestep (B, seq_len) of Wan 2.2 TI2V. The prediction's last L_ref frames are dropped
      (`video_prediction`): the loss and the sampler see the video latents only.
      Differences from Phantom / V3 (README "In-context references"): element repeats (>4 frames: more latents),
      per-element preprocessing (Phantom and V3 pad_white with Lanczos), no zero padding of the references to 4
      (V3 always appends 4, zeros for missing ones), text-only CFG with the references in both branches (their
      3-pass image+text CFG with guide_scale_img=1), noise drawn for the video latents only (V3; Phantom draws
      T+L_ref frames and overwrites the reference part), and the posterior mode or a sample (Phantom: mode; V3:
      sample, after the noise, with the same generator: sample_mode="sample").

    layout="clean" (Wan 2.2 TI2V-5B's image-to-video): `video` (B, 3, F, H, W) whose leading frames
      `cond_frame_indices` = 0..n-1 (n = 4k+1: 1 is the image of I2V) are the condition, encoded alone as diffusers'
      5B I2V encodes its image; returns them as `clean` (B, C, T_c, h, w), normalised (the causal VAE makes them the
      first T_c latents of the whole video's encoding). `ti2v_model_input` puts them in x_t at timestep 0."""
    if layout == "clean":
        n = len(cond_frame_indices)
        if video is None or tuple(cond_frame_indices) != tuple(range(n)) or n < 1 or (n - 1) % VAE_T \
                or n > video.shape[2]:
            raise ValueError(f"TI2V conditions on 4k+1 leading frames: {tuple(cond_frame_indices)} of "
                             f"{None if video is None else video.shape[2]}")
        return Conditioning(None, 0, None, layout, clean=encode_vae(vae, video[:, :, :n], sample_mode, generator))
    if layout not in REFERENCE_LAYOUTS:
        raise ValueError(f"unknown reference layout {layout!r}; choose one of {REFERENCE_LAYOUTS}")
    if layout == "incontext":
        if references is None:
            raise ValueError("the incontext layout takes references (element images), not video frames")
        if reference_timestep not in REFERENCE_TIMESTEPS:
            raise ValueError(f"unknown reference timestep {reference_timestep!r}; choose one of {REFERENCE_TIMESTEPS}")
        n = references.shape[1]
        if len(repeats) != n or min(repeats, default=1) < 1:
            raise ValueError(f"need one repeat >= 1 per element: {n} elements, repeats {tuple(repeats)}")
        parts = [encode_vae(vae, references[:, i, :, None].expand(-1, -1, k, -1, -1), sample_mode, generator)
                 for i, k in enumerate(repeats)]
        return Conditioning(None, 0, torch.cat(parts, dim=2) if parts else None, layout, reference_timestep)
    if (references is None) == (video is None):
        raise ValueError("prepare_latents takes either references (prefix layout) or video (inplace layout)")
    t = num_latent_frames(num_frames)
    if references is not None:
        b, n, _, h, w = references.shape
        if len(repeats) != n or min(repeats, default=1) < 1:
            raise ValueError(f"need one repeat >= 1 per element: {n} elements, repeats {tuple(repeats)}")
        r = sum(repeats)
        if r >= num_frames:
            raise ValueError(f"{n} elements fill {r} frames (repeats {tuple(repeats)}); num_frames={num_frames} "
                             "leaves no frame to generate")
        refs = [references[:, i, :, None].expand(-1, -1, k, -1, -1) for i, k in enumerate(repeats)]
        if combine == "before":
            zeros = references.new_zeros(b, 3, num_frames - r, h, w)
            latents = encode_vae(vae, torch.cat(refs + [zeros], dim=2), sample_mode, generator)
            num_ref = num_ref_latents(repeats, combine)
        elif combine == "after":
            parts = [encode_vae(vae, x, sample_mode, generator) for x in refs]
            num_ref = sum(p.shape[2] for p in parts)
            if num_ref >= t:
                raise ValueError(f"elements take {num_ref} of {t} latent frames; raise num_frames")
            latents = torch.cat(parts, dim=2)
            latents = torch.cat([latents, latents.new_zeros(*latents.shape[:2], t - num_ref, *latents.shape[3:])], 2)
            r = VAE_T * (num_ref - 1) + 1  # the mask then marks exactly the first num_ref latent frames
        else:
            raise ValueError(f"combine must be 'before' or 'after', got {combine!r}")
        flags = torch.zeros(b, num_frames, device=latents.device)
        flags[:, :r] = 1
        mask = frame_mask(flags, latents.shape[-2:])
        return Conditioning(torch.cat([mask, latents], dim=1), num_ref, latents[:, :, :num_ref])
    b, _, f, h, w = video.shape
    if f != num_frames:
        raise ValueError(f"video has {f} frames, num_frames is {num_frames}")
    flags = torch.zeros(b, num_frames)
    flags[:, list(cond_frame_indices)] = 1
    pixels = video * flags[:, None, :, None, None].to(video.device, video.dtype)
    latents = encode_vae(vae, pixels, sample_mode, generator)
    mask = frame_mask(flags.to(latents.device), latents.shape[-2:])
    return Conditioning(torch.cat([mask, latents], dim=1), 0, None)


def model_input(x_t: torch.Tensor, cond: Conditioning | None, timestep: torch.Tensor,
                patch_size=(1, 2, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's (hidden_states, timestep) for noisy video latents x_t (B, C, T, h, w) at timestep (B,), or
    per video token (B, T·h·w/(p_h·p_w)) as Wan 2.2 TI2V's first-frame conditioning gives it. The one place both
    training (train_a2.forward_loss) and sampling (A2Pipeline) assemble the model input:
    t2v (cond None): x_t; channel: cat([x_t, mask | condition], dim=1); incontext: cat([x_t, clean reference
    latents], dim=2), the reference tokens at the sample's timestep (shared; from a per-token timestep its largest
    value, the unconditioned tokens') or at 0 (zero). A (B,) timestep stays (B,) when shared; otherwise the result is
    per token (B, (T+L_ref)·h·w/(p_h·p_w)), frame-major as diffusers' patch grid."""
    if cond is None:
        return x_t, timestep
    if cond.layout == "channel":
        return torch.cat([x_t, cond.condition.to(x_t.dtype)], dim=1), timestep
    if cond.ref_latents is None:
        return x_t, timestep
    refs = cond.ref_latents.to(x_t.dtype)
    x = torch.cat([x_t, refs], dim=2)
    if cond.reference_timestep == "shared" and timestep.dim() < 2:
        return x, timestep
    p_t, p_h, p_w = patch_size
    per_frame = (x_t.shape[3] // p_h) * (x_t.shape[4] // p_w)
    video, ref = x_t.shape[2] // p_t * per_frame, refs.shape[2] // p_t * per_frame
    if timestep.dim() < 2:
        timestep = timestep.reshape(-1).expand(x_t.shape[0])[:, None].expand(-1, video)
    if timestep.shape[1] != video:
        raise ValueError(f"per-token timestep of {timestep.shape[1]} tokens for {video} video tokens")
    sample = timestep.amax(dim=1, keepdim=True) if cond.reference_timestep == "shared" else timestep.new_zeros(())
    return x, torch.cat([timestep, sample.expand(x_t.shape[0], ref)], dim=1)


def video_prediction(pred: torch.Tensor, cond: Conditioning | None) -> torch.Tensor:
    """The model output for the video latents: in the incontext layout the last L_ref (reference) frames dropped."""
    if cond is None or cond.layout != "incontext" or cond.ref_latents is None:
        return pred
    return pred[:, :, : pred.shape[2] - cond.ref_latents.shape[2]]


# ---------------------------------------------------------------- Wan 2.2 TI2V-5B (issue 14)
# The 5B takes the latents alone (48 channels in and out). Image-to-video replaces the first latent frame of the
# model input by the image's clean latent and gives its tokens timestep 0 (diffusers' WanImageToVideoPipeline
# with expand_timesteps); text-to-video gives every token the step's timestep. Training uses the same code
# (prepare_latents(layout="clean"), ti2v_model_input): the clean frames go into x_t as at inference, their tokens
# get timestep 0, the loss leaves them out.


def load_first_frame(path, size: tuple[int, int]) -> torch.Tensor:
    """An image file as the (1, 3, H, W) first frame of 5B image-to-video, resized to size=(H, W) with Lanczos as
    diffusers' VideoProcessor does. Raises ValueError naming the file."""
    try:
        image = read_image(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: first frame image is {e}") from e
    return pil_to_tensor(image.resize((size[1], size[0]), Image.LANCZOS))[None]


def ti2v_model_input(x_t: torch.Tensor, clean: torch.Tensor | None, timestep: torch.Tensor,
                     patch_size=(1, 2, 2), conditioned: torch.Tensor | None = None):
    """The 5B's (hidden_states, timestep) for latents x_t (B, C, T, h, w) at timestep (B,) or (): x_t with its
    first T_c latent frames replaced by `clean` (B, C, T_c, h, w) (None: T2V), and one timestep per token
    (B, T·h·w / (p_t·p_h·p_w)), frame-major as the patch grid: 0 on the clean frames' tokens, else the timestep.
    conditioned (B,) of 0/1 (training's reference dropout): a 0 sample is left as T2V (x_t, the timestep on all
    its tokens)."""
    b, _, t, h, w = x_t.shape
    p_t, p_h, p_w = patch_size
    n = 0 if clean is None else clean.shape[2]
    cond = torch.ones(b, device=x_t.device) if conditioned is None else conditioned.to(x_t.device, torch.float32)
    x = x_t
    if n:
        first = torch.where(cond.view(-1, 1, 1, 1, 1) > 0, clean.to(x_t.dtype), x_t[:, :, :n])
        x = torch.cat([first, x_t[:, :, n:]], dim=2)
    clean_tokens = torch.zeros(t // p_t, h // p_h, w // p_w, device=x_t.device)
    clean_tokens[: n // p_t] = 1
    noisy = 1 - cond[:, None] * clean_tokens.flatten()[None]  # diffusers' mask[0][0][:, ::2, ::2], per sample
    return x, noisy * timestep.reshape(-1, 1)


def conditioning_frame_indices(mode: str, num_frames: int, index: int = 0, prefix: int = 1,
                               generator: torch.Generator | None = None) -> tuple[int, ...]:
    """Frames conditioned on in the inplace layout: first | first_and_last | index | prefix | random."""
    if mode == "first":
        return (0,)
    if mode == "first_and_last":
        return (0, num_frames - 1)
    if mode == "index":
        if not -num_frames <= index < num_frames:
            raise ValueError(f"frame index {index} outside a {num_frames}-frame clip")
        return (index % num_frames,)
    if mode == "prefix":
        if not 1 <= prefix < num_frames:
            raise ValueError(f"prefix of {prefix} frames needs 1 <= prefix < num_frames={num_frames}")
        return tuple(range(prefix))
    if mode == "random":  # one random frame; a generator keeps it a function of the sample's seed
        return (int(torch.randint(num_frames, (1,), generator=generator)),)
    raise ValueError(f"unknown frame conditioning {mode!r}")


# ---------------------------------------------------------------- the pipeline

A2_NEGATIVE_PROMPT = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, "
    "overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly "
    "drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy "
    "background, three legs, many people in the background, walking backwards"
)


def model_flow_shift(model_dir, default: float = 8.0) -> float:
    """The sampler shift a model dir ships (scheduler_config flow_shift / shift: A2 8, Wan2.1 T2V 3, ...)."""
    path = Path(model_dir) / "scheduler" / "scheduler_config.json"
    if not path.exists():
        return default
    import json

    c = json.loads(path.read_text())
    return float(c.get("flow_shift") or c.get("shift") or default)


def make_scheduler(name: str, flow_shift: float, num_train_timesteps: int = 1000):
    """UniPC (A2 and Wan's default; A2 uses flow_shift 8) or FlowMatchEuler, both in flow-matching mode."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if name == "unipc":
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                       num_train_timesteps=num_train_timesteps, flow_shift=flow_shift)
    if name == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=flow_shift)
    raise ValueError(f"unknown scheduler {name!r}; choose unipc or euler")


def load_encoders(model_dir: Path, image_encoder_dir: Path | None, dtype: torch.dtype):
    """The frozen encoders of a model dir: VAE (always fp32), tokenizer, T5, and CLIP + its processor from
    `image_encoder_dir` (None: no image branch). Returns (vae, tokenizer, text_encoder, image_encoder,
    image_processor), on the CPU, in eval mode, without gradients."""
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    vae = AutoencoderKLWan.from_pretrained(model_dir, subfolder="vae", torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(Path(model_dir) / "tokenizer")
    text_encoder = UMT5EncoderModel.from_pretrained(model_dir, subfolder="text_encoder", torch_dtype=dtype)
    image_encoder = image_processor = None
    if image_encoder_dir is not None:
        image_encoder = CLIPVisionModel.from_pretrained(image_encoder_dir, subfolder="image_encoder", torch_dtype=dtype)
        image_processor = CLIPImageProcessor.from_pretrained(image_encoder_dir, subfolder="image_processor")
    for m in (vae, text_encoder, image_encoder):
        if m is not None:
            m.eval().requires_grad_(False)
    return vae, tokenizer, text_encoder, image_encoder, image_processor


class A2Pipeline(WanLoraLoaderMixin):
    """Prompt + element images -> video, on an E2V (A2 / Wan I2V) or T2V Wan transformer, or a Wan 2.2
    A14B expert pair (`transformer` for the high-noise steps, `transformer_2` below the boundary).

    A plain class (diffusers' WanImageToVideoPipeline takes one image); LoRA loading comes from
    diffusers' Wan loader mixin, so `load_lora_weights` reads diffusers, original-Wan and musubi keys
    (`load_into_transformer_2=True` puts a LoRA on the low-noise expert)."""

    _lora_loadable_modules = ["transformer", "transformer_2"]
    transformer_name = "transformer"
    hf_device_map = None  # read by the LoRA loader mixin (no accelerate device map here)

    def __init__(self, transformer, vae, tokenizer, text_encoder, image_encoder=None, image_processor=None,
                 transformer_2=None, boundary_ratio: float | None = None, flow_shift: float = 8.0,
                 expand_timesteps: bool = False):
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValueError("a Wan 2.2 expert pair needs both transformer_2 and boundary_ratio")
        self.transformer, self.vae = transformer, vae
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.image_encoder, self.image_processor = image_encoder, image_processor
        self.transformer_2, self.boundary_ratio = transformer_2, boundary_ratio
        self.flow_shift = flow_shift  # the sampler shift when a call gives none (from_pretrained: the model's)
        self.expand_timesteps = expand_timesteps  # Wan 2.2 TI2V-5B: per-token timesteps, first frame replaced

    @classmethod
    def from_pretrained(cls, model_dir, dtype: torch.dtype = torch.float32, device="cpu", transformer=None,
                        image_encoder_dir=None, transformer_2=None):
        """Load each component from a diffusers-format dir (`tiny`... = a built-in offline tiny model).

        The dir is checked by `detect_model` (clear error for unsupported ones); a Wan 2.2 A14B dir loads both
        experts. `transformer` / `transformer_2` replace the dir's own (a trained model in memory)."""
        from a2.tiny import model_path
        from a2.transformer import detect_model, load_transformer

        info = detect_model(model_path(model_dir), image_encoder_dir)
        model_dir = info.path
        transformer = transformer if transformer is not None else load_transformer(model_dir, dtype)
        if info.two_experts and transformer_2 is None:
            transformer_2 = load_transformer(model_dir, dtype, subfolder="transformer_2")
        if transformer.config.image_dim is not None and info.image_encoder_dir is None:
            raise FileNotFoundError(f"{model_dir}: the transformer has an image branch but there is no "
                                    "image_encoder/; pass --image-encoder DIR")
        vae, tokenizer, text_encoder, image_encoder, image_processor = load_encoders(
            model_dir, info.image_encoder_dir if transformer.config.image_dim is not None else None, dtype)
        pipe = cls(transformer, vae, tokenizer, text_encoder, image_encoder, image_processor,
                   transformer_2 if info.two_experts else None, info.boundary_ratio, model_flow_shift(model_dir),
                   info.expand_timesteps)
        return pipe.to(device)

    def to(self, device):
        for m in (self.transformer, self.transformer_2, self.vae, self.text_encoder, self.image_encoder):
            if m is not None:
                m.to(device).eval()
        return self

    @property
    def device(self):
        return next(self.transformer.parameters()).device

    @property
    def components(self) -> dict:  # read by the LoRA loader mixin
        return dict(transformer=self.transformer, transformer_2=self.transformer_2, vae=self.vae,
                    text_encoder=self.text_encoder, image_encoder=self.image_encoder)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        references: torch.Tensor | None = None,
        clip_references: torch.Tensor | None = None,
        repeats: tuple[int, ...] = (),
        *,
        negative_prompt: str = A2_NEGATIVE_PROMPT,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        guidance_scale_2: float | None = None,
        scheduler: str = "unipc",
        flow_shift: float | None = None,
        combine: str = "before",
        sample_mode: str = "sample",
        generator: torch.Generator | None = None,
        decode: str = "drop_refs",
        progress: bool = True,
        reference_layout: str = "channel",
        reference_timestep: str = "shared",
        guidance_scale_img: float | None = None,
        first_frame: torch.Tensor | None = None,
    ) -> dict:
        """Generate one video.

        references: (1, N, 3, H, W) VAE-path element images in [-1, 1]; clip_references (1, N, 3, h, w)
        the CLIP-path ones (None for models without an image branch). Noise is drawn first, then the
        posterior is sampled with the same generator (A2's order, needed for bit-parity).
        decode: "drop_refs" decodes all latents and drops the 4·L_ref reference frames (A2);
        "video_only" decodes the video latents alone; "all" keeps everything; "none" skips the VAE.
        flow_shift: the sampler's sigma shift; None = the one the model dir ships (`self.flow_shift`).
        Wan 2.2 pair: each step runs `transformer` when its timestep >= boundary_ratio * num_train_timesteps,
        else `transformer_2` with guidance_scale_2 (default: guidance_scale), exactly as diffusers' Wan pipelines.
        reference_layout: channel (A2 / Wan I2V: mask | condition channels, on a 36-channel model) or incontext
        (a T2V-shaped model: the clean reference latents after the video latents, `reference_timestep` shared |
        zero; prepare_latents); the sampler then runs on the video latents alone.
        guidance_scale_img (incontext): reference guidance as Phantom-Wan and SkyReels-V3 R2V sample, three forwards
        a step: u + s_img·(r − u) + s·(c − r) with u = (zero references, negative prompt), r = (references, negative
        prompt), c = (references, prompt), s = guidance_scale (Phantom: s 7.5, s_img 5). None: text CFG only, the
        references in both branches (the same as s_img = 1, one forward fewer).
        first_frame: (1, 3, H, W) in [-1, 1], Wan 2.2 TI2V-5B's image-to-video (ti2v_model_input: its clean latent
        replaces the first latent frame, at timestep 0); references then go in context (reference_layout incontext).
        Returns dict(video (1, 3, F', H, W) in [-1, 1] or None, latents, condition (incontext: the reference
        latents; TI2V-5B first frame without references: its clean latent), num_ref_latents)."""
        transformer = self.transformer  # the only one, or the high-noise expert of a Wan 2.2 pair
        s = vae_scale(self.vae)
        check_size(height, width, num_frames, s * transformer.config.patch_size[1])
        device, dtype = self.device, transformer.dtype
        sched = make_scheduler(scheduler, self.flow_shift if flow_shift is None else flow_shift)
        sched.set_timesteps(num_inference_steps, device=device)

        prompt_embeds = encode_prompt(self.tokenizer, self.text_encoder, [prompt]).to(dtype)
        negative_embeds = None
        if guidance_scale_img is not None and reference_layout != "incontext":
            raise ValueError("guidance_scale_img (reference guidance) is for reference_layout incontext")
        if guidance_scale > 1.0 or guidance_scale_img is not None:
            negative_embeds = encode_prompt(self.tokenizer, self.text_encoder, [negative_prompt]).to(dtype)
        image_embeds = None
        if transformer.config.image_dim is not None:
            if clip_references is None:
                raise ValueError("this model has an image branch: pass CLIP element images (clip_references)")
            image_embeds = encode_image(self.image_encoder, self.image_processor, clip_references).to(dtype)

        shape = (1, transformer.config.out_channels, num_latent_frames(num_frames), height // s, width // s)
        latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
        clean = None  # TI2V-5B: the first frame's clean latent
        if first_frame is not None and not self.expand_timesteps:
            raise ValueError("first_frame is Wan 2.2 TI2V-5B's image-to-video; other I2V models take the image as "
                             "their one reference")
        if self.expand_timesteps and references is not None and reference_layout != "incontext":
            raise ValueError("Wan 2.2 TI2V-5B takes element references in context (reference_layout incontext), not "
                             "as channels; give first_frame for image-to-video")
        if first_frame is not None:  # after the noise, as diffusers' 5B I2V
            clean = prepare_latents(self.vae, 1, video=first_frame.to(device)[:, :, None], cond_frame_indices=(0,),
                                    layout="clean", sample_mode=sample_mode, generator=generator).clean
        cond = None
        if reference_layout == "incontext":
            if is_e2v(transformer):
                raise ValueError("reference_layout incontext is for models that take the latents alone (T2V); this "
                                 f"one takes {transformer.config.in_channels} channels: use the channel layout")
            if references is None:
                raise ValueError("reference_layout incontext needs reference images")
        elif reference_layout != "channel":
            raise ValueError(f"unknown reference layout {reference_layout!r}; choose one of {REFERENCE_LAYOUTS}")
        elif is_e2v(transformer) and references is None:
            raise ValueError("this E2V/I2V model needs reference images")
        if reference_layout == "incontext" or is_e2v(transformer):
            cond = prepare_latents(self.vae, num_frames, references=references.to(device), repeats=repeats,
                                   combine=combine, sample_mode=sample_mode, generator=generator,
                                   layout=reference_layout, reference_timestep=reference_timestep)
        condition = None if cond is None else cond.condition if cond.layout == "channel" else cond.ref_latents
        num_ref = 0 if cond is None else cond.num_ref_latents

        if self.boundary_ratio is None and guidance_scale_2 is not None:
            raise ValueError("guidance_scale_2 is for the low-noise expert of a Wan 2.2 A14B pair")
        guidance_scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        for t in tqdm(sched.timesteps, disable=not progress, desc="denoising"):
            low = expert_for_timestep(t, self.boundary_ratio, sched.config.num_train_timesteps) == "low"
            model, scale = (self.transformer_2, guidance_scale_2) if low else (transformer, guidance_scale)
            video_x, video_t = latents, t.expand(1)
            if self.expand_timesteps:  # TI2V-5B: the clean first frame at timestep 0, one timestep per token
                video_x, video_t = ti2v_model_input(latents, clean, t, model.config.patch_size)
            x, timestep = model_input(video_x, cond, video_t, model.config.patch_size)
            x = x.to(dtype)
            noise_pred = video_prediction(model(hidden_states=x, timestep=timestep, encoder_hidden_states=prompt_embeds,
                                                encoder_hidden_states_image=image_embeds, return_dict=False)[0], cond)
            if negative_embeds is not None:  # CFG on text only: the same image tokens and references in both (A2)
                noise_uncond = video_prediction(model(
                    hidden_states=x, timestep=timestep, encoder_hidden_states=negative_embeds,
                    encoder_hidden_states_image=image_embeds, return_dict=False)[0], cond)
                if guidance_scale_img is not None:  # Phantom / V3: the unconditional has zero references
                    empty = replace(cond, ref_latents=torch.zeros_like(cond.ref_latents))
                    x0, timestep0 = model_input(video_x, empty, video_t, model.config.patch_size)
                    noise_none = video_prediction(model(
                        hidden_states=x0.to(dtype), timestep=timestep0, encoder_hidden_states=negative_embeds,
                        encoder_hidden_states_image=image_embeds, return_dict=False)[0], empty)
                    noise_pred = noise_none + guidance_scale_img * (noise_uncond - noise_none) \
                        + scale * (noise_pred - noise_uncond)
                else:
                    noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)
            latents = sched.step(noise_pred.float(), t, latents, return_dict=False)[0]
        if clean is not None:  # the sampler also moved the clean frames: put them back
            latents = torch.cat([clean, latents[:, :, clean.shape[2]:]], dim=2)
        if clean is not None and cond is None:
            condition = clean

        video = None
        if decode == "drop_refs":
            video = decode_vae(self.vae, latents)[:, :, VAE_T * num_ref:]
        elif decode == "video_only":
            video = decode_vae(self.vae, latents[:, :, num_ref:])
        elif decode == "all":
            video = decode_vae(self.vae, latents)
        elif decode != "none":
            raise ValueError(f"unknown decode mode {decode!r}")
        return dict(video=video, latents=latents, condition=condition, num_ref_latents=num_ref)


def check_size(height: int, width: int, num_frames: int, multiple: int = 16) -> None:
    """The shapes a Wan model can take: H, W multiples of `multiple` = VAE x patch (Wan 2.1: 8 x 2 = 16, Wan 2.2
    TI2V-5B: 16 x 2 = 32), F = 4k+1."""
    if height % multiple or width % multiple or height <= 0 or width <= 0:
        raise ValueError(f"height and width must be positive multiples of {multiple}, got {height}x{width}")
    if num_frames < 1 or (num_frames - 1) % VAE_T:
        raise ValueError(f"num_frames must be 4k+1 (e.g. 17, 49, 81), got {num_frames}")


def save_video(path, video: torch.Tensor, fps: int = 15, references: torch.Tensor | None = None) -> Path:
    """Write (3, F, H, W) in [-1, 1] as mp4; with references (N, 3, H, W), each frame gets the
    references to its left, as A2's infer.py does."""
    import imageio.v3 as iio

    frames = tensor_to_uint8(video.permute(1, 0, 2, 3))  # (F, H, W, 3)
    if references is not None and len(references):
        refs = np.concatenate(list(tensor_to_uint8(references)), axis=1)  # (H, N*W, 3)
        frames = np.stack([np.concatenate([refs, f], axis=1) for f in frames])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, frames, fps=fps, codec="libx264", plugin="pyav")
    return path
