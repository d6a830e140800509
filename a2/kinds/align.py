"""RefAlign's reference-alignment loss (arXiv 2603.25743, code gudaochangsheng/RefAlign), a training option for the
kinds whose references are tokens of the sequence.

After each chosen block (RefAlign: 0..8) the reference tokens of the block's output go through that block's projector
Linear(dim -> dim/2) -> SiLU -> Linear(-> D), no biases, and are compared with the DINOv3 patch features (D wide) of
the same reference image on the same token grid:

    pos   = mean over the tokens of relu(1 - cos(P(h_i), f_i))                  (same reference, same position)
    neg   = mean over token pairs of different references of relu(cos(P(h_i), f_j))   (0 with one reference)
    align = gate(t) · mean over the blocks of (pos + neg),  gate(t) = floor + (1 - floor) · (t / 1000)^power

RefAlign's gate (its training_loss's gate_from_timestep(t, 0, 1000, beta=3.0), whose min_val is 0: diffsynth/
pipelines/wan_video_new6.py, the pipeline its train.py imports) is (t/1000)^3: floor 0, power 3. A sample
whose references were dropped contributes 0 (RefAlign multiplies its loss by 0). The targets are the last layer's
patch tokens before the final norm (RefAlign reads hidden_states[-1]), CLS and register tokens dropped.

Which kinds: refalign, phantom, v3 and incontext append the references' latent frames after the video's on the
time axis, and standin adds its reference tokens after the video's; every block's output holds their tokens. The
channel kinds (prefix, inplace, magref) put a reference into the channels of video tokens (no token of its own to
align) and t2v and clean take no reference image.

The projectors hang on the transformer (`align_projectors`), so the optimizer, DDP's gradient reduction, the
checkpoint and the memory plan see them as trainable weights; export leaves them out (without_projectors): they are
no part of the model.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torch import nn
from torchvision.transforms import InterpolationMode

from a2.kinds.kinds import KIND_DEFS
from a2.model.transformer import VideoOnlyCrossAttnProcessor

REFALIGN_BLOCKS = tuple(range(9))  # the blocks RefAlign aligns
ATTRIBUTE = "align_projectors"  # the transformer's submodule holding the projectors
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # DINOv3's processor defaults


class Projectors(nn.Module):
    """One projector per aligned block: Linear(dim, dim/2) -> SiLU -> Linear(dim/2, target_dim), no biases (RefAlign's
    MLP3). While `spans` is set (capture), each aligned block's forward hook projects its output's reference tokens
    into `features[block]` (B, N, L, target_dim)."""

    def __init__(self, dim: int, target_dim: int, blocks=REFALIGN_BLOCKS):
        super().__init__()
        self.blocks = tuple(blocks)
        self.mlps = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(dim, dim // 2, bias=False), nn.SiLU(),
                                                         nn.Linear(dim // 2, target_dim, bias=False))
                                   for i in self.blocks})
        self.spans: tuple | None = None  # (starts, tokens): where the references are in a block's output
        self.features: dict[int, torch.Tensor] = {}

    def hook(self, index: int):
        def project(_module, _args, output):
            if self.spans is None:  # validation, eval loss, sampling: nothing to align
                return
            hidden = output[0] if isinstance(output, tuple) else output  # (B, L, dim)
            self.features[index] = self.mlps[str(index)](reference_tokens(hidden, *self.spans))
        return project


def install(transformer, target_dim: int, blocks=REFALIGN_BLOCKS, seed: int = 0) -> Projectors:
    """Attach fp32 projectors (initialised from `seed`, trainable) to `transformer` and hook its blocks. A ValueError
    names a block the model lacks."""
    n = len(transformer.blocks)
    if not blocks or any(not 0 <= i < n for i in blocks):
        raise ValueError(f"--align-blocks {tuple(blocks)}: this model has blocks 0..{n - 1}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        projectors = Projectors(transformer.config.num_attention_heads * transformer.config.attention_head_dim,
                                target_dim, blocks)
    projectors.requires_grad_(True)
    setattr(transformer, ATTRIBUTE, projectors)
    for i in projectors.blocks:
        transformer.blocks[i].register_forward_hook(projectors.hook(i))
    return projectors


def projectors_of(model) -> Projectors | None:
    return getattr(getattr(model, "module", model), ATTRIBUTE, None)


@contextmanager
def capture(model, spans):
    """Within, the aligned blocks project the reference tokens at `spans` (reference_spans); yields the features."""
    projectors = projectors_of(model)
    projectors.spans, projectors.features = spans, {}
    try:
        yield projectors.features
    finally:
        projectors.spans = None


@contextmanager
def without_projectors(model):
    """The transformer without its projectors (export: save_pretrained and the ComfyUI file hold the model alone)."""
    module = getattr(model, "module", model)
    projectors = module._modules.pop(ATTRIBUTE, None)
    try:
        yield module
    finally:
        if projectors is not None:
            module._modules[ATTRIBUTE] = projectors


def strip(state: dict) -> dict:
    """A state dict without the projectors' entries (a gathered --fsdp state)."""
    return {k: v for k, v in state.items() if not k.startswith(ATTRIBUTE + ".")}


# ---------------------------------------------------------------- where the reference tokens are


def video_only_cross_attention(transformer, ref_latents: int) -> None:
    """RefAlign's blocks: the text cross-attention for the video tokens only, the reference tokens (the last
    `ref_latents` latent frames of hidden_states) passed through unchanged (its DiTBlock adds cross_attn to x_video
    alone): the video-only processor on every attn2; a pre-hook counts the reference tokens of each call from
    its input's shape."""
    transformer.reference_latents = ref_latents  # this call's (a sampling call may take another count)
    if getattr(transformer, "video_only_hook", None) is not None:
        return

    def count(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (B, C, T + L_ref, H, W)
        p_t, p_h, p_w = module.config.patch_size
        n = module.reference_latents // p_t * (x.shape[3] // p_h) * (x.shape[4] // p_w)
        for block in module.blocks:
            block.attn2.processor.num_reference = n

    for block in transformer.blocks:
        block.attn2.set_processor(VideoOnlyCrossAttnProcessor())
    transformer.video_only_hook = transformer.register_forward_pre_hook(count, with_kwargs=True)


def reference_spans(layout, video_grid: tuple[int, int], patch_size=(1, 2, 2)):
    """(starts, tokens, grid): each reference's first token counted from the end of a block's output (negative), its
    token count and its (rows, cols) token grid. video_grid: the video's tokens per frame (rows, cols).

    refalign / phantom / v3: one latent frame per reference after the video (v3: its first len(repeats) of 4 slots);
    incontext: each element's latent frames after the video, its first frame aligned (the others repeat the image);
    standin: its reference tokens after the video's, a reference_grid over the patch."""
    if not layout.reference_tokens:
        raise ValueError(f"the {layout.kind} kind has no reference tokens in the sequence; --align-loss takes "
                         f"{', '.join(aligned_kinds())}")
    if layout.reference_grid is not None:  # Stand-In's own reference tokens, after the video's
        grid = (layout.reference_grid[0] // patch_size[1], layout.reference_grid[1] // patch_size[2])
        return (-grid[0] * grid[1],), grid[0] * grid[1], grid
    per = video_grid[0] * video_grid[1]  # reference latent frames after the video's: each element's first frame
    frames = layout.reference_frames  # (1 each in the released layouts; v3: then empty slots)
    firsts = [sum(frames[:i]) for i in range(len(frames))]
    return tuple(-(layout.ref_latents - f) * per for f in firsts), per, tuple(video_grid)


def aligned_kinds() -> list[str]:
    """The kinds whose references are tokens of the sequence (Layout.reference_tokens)."""
    return [k for k, d in KIND_DEFS.items() if d.reference_tokens]


def reference_tokens(hidden: torch.Tensor, starts, tokens: int) -> torch.Tensor:
    """(B, L, D) block output -> (B, N, tokens, D): the tokens of each reference."""
    return torch.stack([hidden[:, s:(s + tokens if s + tokens < 0 else None)] for s in starts], dim=1)


# ---------------------------------------------------------------- the targets


def load_target_model(path, device, dtype=torch.float32):
    """The DINOv3 target model from a local dir (transformers' DINOv3ViTModel, e.g. facebook/dinov3-vitb16-pretrain-
    lvd1689m), frozen, with its processor's normalisation: (model, mean, std). A bad dir is one-line ValueError."""
    from transformers import DINOv3ViTModel

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"--align-model {path}: not a DINOv3 model dir (no config.json)")
    model = DINOv3ViTModel.from_pretrained(path, torch_dtype=dtype).to(device).eval().requires_grad_(False)
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    processor = path / "preprocessor_config.json"
    if processor.is_file():
        p = json.loads(processor.read_text())
        mean, std = p.get("image_mean", mean), p.get("image_std", std)
    return model, tuple(mean), tuple(std)


def target_dim(path) -> int:
    """The target model's feature width (its config's hidden_size), read without loading the weights."""
    path = Path(path)
    try:
        return int(json.loads((path / "config.json").read_text())["hidden_size"])
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"--align-model {path}: not a DINOv3 model dir ({type(e).__name__}: {e})") from None


@torch.no_grad()
def dino_targets(target, images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, N, 3, H, W) reference images in [-1, 1] -> (B, N, rows·cols, D) float32: DINOv3's last-layer patch tokens
    of each image resized to the DiT's token grid times DINOv3's patch (RefAlign at 480x832: 30x52 tokens of 16 px,
    no resize); `target` = load_target_model's (model, mean, std)."""
    model, mean, std = target
    b, n = images.shape[:2]
    patch = model.config.patch_size
    size = (grid[0] * patch, grid[1] * patch)
    x = images.flatten(0, 1).float()  # (B·N, 3, H, W)
    if tuple(x.shape[-2:]) != size:
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    x = (x + 1) / 2
    x = (x - x.new_tensor(mean).view(1, 3, 1, 1)) / x.new_tensor(std).view(1, 3, 1, 1)
    param = next(model.parameters())
    hidden = model(pixel_values=x.to(param.device, param.dtype), output_hidden_states=True).hidden_states[-1]
    skip = 1 + model.config.num_register_tokens  # CLS, then the registers
    return hidden[:, skip:].float().unflatten(0, (b, n))  # (B, N, rows·cols, D)


# ---------------------------------------------------------------- the loss


def gate(sigmas: torch.Tensor, floor: float = 0.0, power: float = 3.0) -> torch.Tensor:
    """(B,) -> (B,): floor + (1 - floor) · (t/1000)^power at t = 1000·sigma (RefAlign: (t/1000)^3)."""
    return floor + (1 - floor) * sigmas.float() ** power


def block_loss(features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, N, L, D) projected reference tokens and (B, N, L, D) targets -> (B,) pos + neg of one block."""
    s = F.normalize(features.float(), dim=-1)
    t = F.normalize(targets.float(), dim=-1)
    pos = (1 - (s * t).sum(-1)).relu().mean(dim=(1, 2))  # (B,)
    n = s.shape[1]
    if n < 2:
        return pos
    neg = torch.stack([(s[:, a] @ t[:, c].transpose(1, 2)).relu().mean(dim=(1, 2))  # (B,) per ordered pair
                       for a in range(n) for c in range(n) if a != c]).mean(0)
    return pos + neg


def align_loss(features: dict, targets: torch.Tensor, sigmas: torch.Tensor, kept: torch.Tensor, floor: float = 0.0,
               power: float = 3.0) -> torch.Tensor:
    """The batch's alignment loss (a scalar): mean over samples of kept · gate(sigma) · mean over blocks of block_loss.
    features: {block: (B, N, L, D)} (capture's); kept (B,): 1 where the sample kept its references."""
    per_block = torch.stack([block_loss(features[i], targets.to(features[i].device)) for i in sorted(features)])
    return (kept.float() * gate(sigmas, floor, power) * per_block.mean(0)).mean()


# ---------------------------------------------------------------- reference augmentation (--reference-augment)
# Reference-image augmentation (--reference-augment): RefAlign trains with heavily augmented references so that the
# model copies the subject, not the photo (its list: blur, colour/brightness jitter, flip, shear, rotation up to 45
# degrees, perspective, scale/translate). Its loader ships compiled, so the magnitudes below are ours, stated here:
#
#   flip        horizontal, p 0.5
#   affine      p 0.8: rotation U(-45, 45) deg, shear U(-10, 10) deg, scale U(0.8, 1.1), shift U(-0.1, 0.1) of the size
#   perspective p 0.3: each corner moved by U(-0.1, 0.1) of the size
#   colour      p 0.8: brightness, contrast and saturation factors U(0.8, 1.2)
#   blur        p 0.3: Gaussian, sigma U(0.1, 2.0) px
#
# Applied with torchvision's functional transforms. Uncovered pixels are white (the references are cut-outs on white).
# Every draw comes from the sample's own generator (a2/train/flow.py sample_generator, stream AUGMENT_STREAM), so an
# augmentation is a function of (seed, step, sample) alone: one process and N ranks, and a resumed run, see the same
# images. The augmented image is what the VAE encodes and what
# the alignment targets (above) are computed from. A precompute cache holds latents of the images as read, so
# augmentation needs the pixels (train_a2.py refuses it with --cache-dir).

AUGMENT_STREAM = 1  # sample_generator's stream of the augmentation draws (0: sigma, dropout, noise, posteriors)


def _u(g: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * torch.rand((), generator=g).item()


def augment_image(image: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One (3, H, W) reference in [-1, 1], augmented by the draws of `g` (the comment above); the draws are made in a
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
