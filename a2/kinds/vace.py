"""Wan VACE (Wan2.1-VACE 1.3B / 14B, Wan2.2-VACE-Fun A14B): what its conditioning kind needs beside the table.

VACE (ali-vilab/VACE; Wan2.1's wan/vace.py and wan/modules/vace_model.py) is Wan T2V with context blocks: copies of
the transformer block (diffusers' WanVACETransformerBlock, Wan's VaceWanAttentionBlock) that read a 96-channel
context through their own patch embedding and add a hint, times a conditioning scale, after the base blocks listed in
`vace_layers` (1.3B: every 2nd of 30; 14B: every 5th of 40):

  context   = cat([inactive (16) | reactive (16) latents, mask (64)], dim=1)            (B, 96, N + T, h, w)
  inactive  = VAE(video * (1 - m)), reactive = VAE(video * m): m the mask binarised at 0.5, 1 where VACE generates
  mask      = each latent cell's 8x8 pixel block of m as 64 channels, the F pixel frames resampled (nearest-exact)
              to T = (F + 3) // 4 latent frames
  reference = each image framed on a white canvas of the video's size (frame), VAE-encoded alone (one latent frame),
              in the context as cat([its latent, zeros]) with a zero mask, the N of them before the video's T frames,
              in list order
  R2V       = references and no video: video zeros, mask ones (VACE's own prepare_source), so inactive = reactive =
              VAE(zeros)

Every VAE encode is the posterior mean (Wan's WanVAE.encode returns mu; diffusers' pipeline takes argmax). The noised
sequence holds N + T latent frames, noise for the references' too; the context blocks run on the patch-embedded
noised sequence (block 0 adds its input projection of the context to it) and the sampler keeps the last T frames
(wan/vace.py:280-293). Classifier-free guidance drops the text alone: both branches see the same context. Training
(VideoX-Fun's scripts/wan2.2_vace_fun/train.py, the lab's trainer of VACE-Fun) diffuses x0 = cat([reference latents,
clip latents]) and the loss covers every frame, the references' too; a masked clip's context holds the clip outside
the mask (its pixels inside zeroed, so the reactive part is VAE(zeros)).

The vace kind (its Kind row in a2/kinds/kinds.py) reads these pieces: its framing, encode, pack and install.

a2 keeps the transformer's (hidden_states, timestep) interface, as for Stand-In: the context rides after x_t on the
channel axis (pack), and the forward `install` puts on the transformer reads it back (unpack) and runs `forward`,
which is WanVACETransformer3DModel.forward's arithmetic run so that a2's block set-up reaches the context blocks
(configure_blocks recomputes and compiles vace_blocks too) and context parallel splits them (context_parallel). This
module imports no conditioning code: the kind hands it its VAE encode (encode's `encode_vae`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from a2.model.parallel import UlyssesAttnProcessor
from a2.model.transformer import embed, unpatchify

VAE_STRIDE = (4, 8, 8)  # Wan 2.1's VAE (the one every VACE model runs with): frames, height, width

# The blocks a LoRA adapts: the transformer blocks, VACE's context blocks or both. The lab's own is the context
# blocks: VideoX-Fun trains VACE-Fun with `--trainable_modules "vace"` (scripts/wan2.2_vace_fun/train.sh) and
# DiffSynth-Studio its VACE LoRAs with `--lora_base_model "vace"`; VACE's paper tunes them on a frozen base. The
# references reach the model through the context blocks alone, so their fidelity is learnt there, and the base's
# text-to-video prior stays as it was.
LORA_BLOCKS = {"vace": r"vace_blocks\.", "base": r"blocks\.", "both": r"(vace_)?blocks\."}


def lora_target(target: str, blocks: str = "vace") -> str:
    """`target`, a regex over module names (peft's full match, e.g. a2/config/sections.py LORA_TARGETS, whose
    `.*blocks` matches both kinds of block), narrowed to the modules of the `blocks` LORA_BLOCKS names."""
    return rf"(?={LORA_BLOCKS[blocks]})(?:{target})"


# ---------------------------------------------------------------- the context


def context_mask(mask: torch.Tensor, num_references: int) -> torch.Tensor:
    """The context's mask channels: (B, F, H, W) in {0, 1} (1: generate) -> (B, 64, N + T, H / 8, W / 8), each latent
    cell's 8x8 pixel block as channels (row-major), the F frames nearest-exact resampled to T = (F + 3) // 4, zeros
    for the N references before them (Wan's vace_encode_masks, wan/vace.py:174-207)."""
    b, f, height, width = mask.shape
    _, sh, sw = VAE_STRIDE
    h, w = height // sh, width // sw
    m = mask.reshape(b, f, h, sh, w, sw).permute(0, 3, 5, 1, 2, 4).reshape(b, sh * sw, f, h, w)
    m = F.interpolate(m, size=((f + VAE_STRIDE[0] - 1) // VAE_STRIDE[0], h, w), mode="nearest-exact")
    return torch.cat([m.new_zeros(b, sh * sw, num_references, h, w), m], dim=2)


def context(inactive: torch.Tensor, reactive: torch.Tensor, references: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """cat([inactive | reactive], references first (their latent | zeros), then the mask): inactive, reactive
    (B, 16, T, h, w), references (B, 16, N, h, w), mask (B, 64, N + T, h, w) -> (B, 96, N + T, h, w)."""
    refs = torch.cat([references, torch.zeros_like(references)], dim=1)  # (B, 32, N, h, w)
    return torch.cat([torch.cat([refs, torch.cat([inactive, reactive], dim=1)], dim=2), mask.to(inactive)], dim=1)


def encode(encode_vae: Callable[[torch.Tensor], torch.Tensor], references: torch.Tensor, num_frames: int,
           video: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """VACE's context of a batch and its reference latents: (context (B, 96, N + T, h, w), references (B, 16, N, h,
    w)). encode_vae: pixels (B, 3, F, H, W) in [-1, 1] -> normalised posterior means (a2.kinds.conditioning.encode_vae
    with "argmax"). references: (B, N, 3, H, W), framed to the video's size (frame). video (B, 3, F, H, W) and mask
    (B, F, H, W), 1 where VACE generates: the clip to condition on (a masked clip, a control video; a video without a
    mask is all to generate, as Wan's prepare_source sets it); None: R2V (video zeros, mask ones). The VAE calls, in
    this order: each reference alone; then R2V's one VAE(zeros) frames (its inactive and reactive parts are the same
    pixels), or the video's inactive and reactive parts."""
    b, n, _, height, width = references.shape
    refs = torch.cat([encode_vae(references[:, i, :, None]) for i in range(n)], dim=2) if n else None
    if video is None and mask is not None:
        raise ValueError("VACE's mask says where in its video to generate: give the video with it")
    if video is None:
        inactive = reactive = encode_vae(references.new_zeros(b, 3, num_frames, height, width))
    else:
        if video.shape[2] != num_frames or mask is not None and mask.shape[1:] != (num_frames, height, width):
            raise ValueError(f"VACE's video {tuple(video.shape)} and mask {None if mask is None else tuple(mask.shape)}"
                             f": {num_frames} frames of {height}x{width} (the references' size) expected")
        m = 1.0 if mask is None else (mask > 0.5).to(video)[:, None]  # (B, 1, F, H, W) (pixels from a cache: meta)
        inactive, reactive = encode_vae(video * (1 - m)), encode_vae(video * m)
    if mask is None:  # on the latents' device: the pixels may be a precompute cache's meta tensors
        mask = inactive.new_ones(b, num_frames, height, width)
    if refs is None:
        refs = inactive.new_zeros(*inactive.shape[:2], 0, *inactive.shape[-2:])
    return context(inactive, reactive, refs, context_mask((mask > 0.5).to(inactive), n)), refs


# ---------------------------------------------------------------- the transformer


def pack(x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """The transformer's hidden_states: cat([x_t, context], dim=1), (B, 16 + 96, N + T, h, w)."""
    if x.shape[2:] != context.shape[2:]:
        raise ValueError(f"VACE's context {tuple(context.shape)} does not cover the noised sequence {tuple(x.shape)}"
                         " (the references' frames, then the video's)")
    return torch.cat([x, context.to(x.dtype)], dim=1)


def unpack(hidden_states: torch.Tensor, in_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden_states[:, :in_channels], hidden_states[:, in_channels:]


def forward(transformer, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
            context: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """WanVACETransformer3DModel.forward (diffusers' transformer_wan_vace.py): the context blocks' hints first, then
    the blocks, each in vace_layers adding its hint x scale; returns the prediction (B, 16, N + T, h, w). The context
    blocks read the patch-embedded input and each other's state, never a block's output: ComfyUI runs each right
    before its hint is added, the same numbers. That order holds one hint at a time (sampling Wan2.1-VACE-1.3B at
    480x832, 81 frames, 3 references: 1.4 GiB less), but a LoRA step traced at that size (a2/train/trace.py, every block
    recomputed) peaked 1.2 GiB higher in its backward, so training's memory plan keeps the labs' order. Every block
    runs through its own forward (as configure_blocks set it: recomputed, compiled; peft's LoRA in its modules). Under
    context parallel (a2/model/parallel.py; context_parallel below for the context blocks) the context blocks run on
    this rank's tokens, as the blocks do after the first one's input hook splits the sequence, so each hint is the
    rank's part of it."""
    x, rotary, temb, proj, text, grid = embed(transformer, hidden_states, timestep, encoder_hidden_states)
    c = transformer.vace_patch_embedding(context.to(x.dtype)).flatten(2).transpose(1, 2)  # (B, L, D)
    x_c, rotary_c = x, rotary
    split = getattr(transformer, "context_parallel", None)
    if split is not None:
        split.length = x.shape[1]
        x_c, c, rotary_c = split.shard(x), split.shard(c), tuple(split.shard(r) for r in rotary)
    hints = {}
    for layer, block in zip(transformer.config.vace_layers, transformer.vace_blocks):
        hints[layer], c = block(x_c, text, c, proj, rotary_c)
    for i, block in enumerate(transformer.blocks):
        x = block(x, text, proj, rotary)
        if i in hints:
            x = x + hints.pop(i) * scale  # each hint freed once added
    return unpatchify(transformer, x, temb, grid)


def install(transformer, scale: float = 1.0) -> None:
    """Make `transformer(hidden_states=pack(x_t, context), timestep, encoder_hidden_states)` VACE's forward with the
    conditioning scale `scale` (a later call sets the scale, and splits the context blocks once a2.model.parallel's
    context_parallel has split the transformer: the kind's prepare_model runs before every forward)."""
    if not hasattr(transformer, "vace_blocks"):
        raise ValueError(f"a {type(transformer).__name__} has no VACE context blocks: VACE's layout needs a VACE "
                         "model (Wan2.1-VACE, Wan2.2-VACE-Fun)")
    transformer.vace_scale = scale
    if getattr(transformer, "context_parallel", None) is not None and not isinstance(
            transformer.vace_blocks[0].attn1.processor, UlyssesAttnProcessor):
        context_parallel(transformer)
    if "forward" in vars(transformer):
        return

    def vace(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None, return_dict=True,
             attention_kwargs=None):
        if encoder_hidden_states_image is not None:
            raise ValueError("VACE's models take no CLIP image tokens")
        x, c = unpack(hidden_states, transformer.config.in_channels)
        out = forward(transformer, x, timestep, encoder_hidden_states, c, transformer.vace_scale)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    transformer.forward = vace


def context_parallel(transformer) -> None:
    """Ulysses self-attention in the context blocks, on the split a2.model.parallel.context_parallel put on the
    transformer (install calls it after that): their tokens are split as the blocks' are (forward)."""
    split = transformer.context_parallel
    for block in transformer.vace_blocks:
        backend = block.attn1.processor._attention_backend
        processor = UlyssesAttnProcessor()
        processor._attention_backend, processor.split = backend, split
        block.attn1.set_processor(processor)
