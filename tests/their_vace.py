"""Wan VACE's two public samplers and ComfyUI's VACE model, written out from their code (read, not imported: Wan's
repo needs CUDA and flash-attn, ComfyUI is an application), to compare a2's VACE code with, and diffusers'
WanVACEPipeline run as its users run it. All drive a diffusers WanVACETransformer3DModel and AutoencoderKLWan; the
text encoder is fed as its outputs (the 512-token UMT5 states, zero past the prompt), the same tensors a2 gets.

Read: Wan-Video/Wan2.1 @ 9737cba (2026-03-05): wan/vace.py (WanVace.prepare_source :212-278, vace_encode_frames
:139-172, vace_encode_masks :174-207, generate :295-475), wan/modules/vace_model.py (VaceWanModel: hints :136-153,
each block in vace_layers adds hints * context_scale :58-62), generate.py (vace defaults :76-81: --sample_shift 16,
--sample_steps 50, --sample_guide_scale 5.0 :242, --base_seed -1 = random :91, n_prompt "" = the config's
sample_neg_prompt, wan/vace.py:353), wan/configs/shared_config.py (sample_neg_prompt, sample_fps 16);
ali-vilab/VACE @ 48eb44f (vace/models/wan/wan_vace.py: the same code; vace/vace_wan_inference.py: --base_seed 2025
:158-162, --sample_shift 16 :49-50, --size 480p :74-78 = SIZE_CONFIGS (480, 832), which its prepare_source reads as
(width, height): a portrait video); diffusers 0.42.1 pipelines/wan/pipeline_wan_vace.py (preprocess_conditions
:415-513, prepare_video_latents :515-580, prepare_masks :582-632, __call__ :692-1047) and
models/transformers/transformer_wan_vace.py; comfyanonymous/ComfyUI comfy/ldm/wan/model.py (VaceWanModel: the
context blocks run interleaved, after block i on the patch-embedded input x_orig, x += c_skip * strength),
comfy/model_base.py (WAN21_Vace.extra_conds: vace_frames normalised, cat with vace_mask, one strength per context),
comfy/lora.py (model_lora_keys_unet: every `diffusion_model.<module>` weight of the model is a LoRA key;
calculate_weight: W += strength * (alpha / rank, 1 without alpha) * up @ down).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from tests.their_samplers import FlowUniPC, normalise, phantom_sigmas, shifted

WAN_SHIFT, WAN_STEPS, WAN_GUIDE = 16.0, 50, 5.0  # generate.py / vace_wan_inference.py's vace defaults
VACE_SEED = 2025  # vace_wan_inference.py --base_seed (Wan2.1's generate.py: -1, a random seed)


# ---------------------------------------------------------------- Wan's WanVace (wan/vace.py)


def wan_reference(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """prepare_source's reference (:253-277): TF.to_tensor(img).sub_(0.5).div_(0.5); an image not of the video's
    (H, W) is bilinear-resized to int(side * scale), scale = min of the two ratios, centred on a white canvas.
    Returns (3, 1, H, W)."""
    x = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).float().div(255)
    x = x.sub_(0.5).div_(0.5).unsqueeze(1)
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    canvas_h, canvas_w = size
    ref_h, ref_w = x.shape[-2:]
    scale = min(canvas_h / ref_h, canvas_w / ref_w)
    new_h, new_w = int(ref_h * scale), int(ref_w * scale)
    canvas = torch.ones(3, 1, canvas_h, canvas_w)
    resized = F.interpolate(x.squeeze(1).unsqueeze(0), size=(new_h, new_w), mode="bilinear", align_corners=False)
    top, left = (canvas_h - new_h) // 2, (canvas_w - new_w) // 2
    canvas[:, :, top:top + new_h, left:left + new_w] = resized.squeeze(0).unsqueeze(1)
    return canvas


def _encode(vae, x: torch.Tensor) -> torch.Tensor:
    """WanVAE.encode of one (3, F, H, W) clip: the posterior mean, normalised (mu - mean) * (1 / std)."""
    return normalise(vae, vae.encode(x[None]).latent_dist.mean)[0]


def wan_context(vae, frames: torch.Tensor, mask: torch.Tensor, refs: list[torch.Tensor] | None) -> torch.Tensor:
    """vace_encode_frames + vace_encode_masks + vace_latent for one sample: frames (3, F, H, W), mask (3 or 1, F, H,
    W), refs (3, 1, H, W) each or None. Returns z (96, N + F // 4 + 1, h, w)."""
    m = torch.where(mask > 0.5, 1.0, 0.0)
    inactive, reactive = _encode(vae, frames * (1 - m) + 0 * m), _encode(vae, frames * m + 0 * (1 - m))
    latent = torch.cat([inactive, reactive], dim=0)
    if refs is not None:
        ref_latents = [_encode(vae, r) for r in refs]
        latent = torch.cat([*[torch.cat([u, torch.zeros_like(u)], dim=0) for u in ref_latents], latent], dim=1)
    _, depth, height, width = mask.shape
    new_depth = (depth + 3) // 4
    height, width = 2 * (height // 16), 2 * (width // 16)
    masks = mask[0].view(depth, height, 8, width, 8).permute(2, 4, 0, 1, 3).reshape(64, depth, height, width)
    masks = F.interpolate(masks.unsqueeze(0), size=(new_depth, height, width), mode="nearest-exact").squeeze(0)
    if refs is not None:
        masks = torch.cat([torch.zeros_like(masks[:, :len(refs)]), masks], dim=1)
    return torch.cat([latent, masks], dim=0)


def _predict(transformer, x, t, text, z, scale):
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, control_hidden_states=z[None],
                       control_hidden_states_scale=torch.full((len(transformer.config.vace_layers),), scale),
                       return_dict=False)[0]


@torch.no_grad()
def wan_sample(transformer, vae, refs: list[Image.Image], text: torch.Tensor, text_null: torch.Tensor,
               num_frames: int, height: int, width: int, steps: int = WAN_STEPS, shift: float = WAN_SHIFT,
               guide: float = WAN_GUIDE, seed: int = VACE_SEED, context_scale: float = 1.0,
               video: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> dict:
    """WanVace.generate (:295-475) after prepare_source: R2V when video is None (zeros of (3, F, H, W) and a mask of
    ones, :237-242); else video (3, F, H, W) in [-1, 1] and mask (1, F, H, W) in [0, 1] (its clamp((m + 1) / 2)
    done). The noise (16, N + T, h, w) from a generator seeded with `seed`; FlowUniPC from sigma 0.999 shifted;
    both passes with the same context; the first N frames dropped (decode_latent). Returns context, initial,
    latents (N + T frames) and video (the last T)."""
    if video is None:
        video, mask = torch.zeros(3, num_frames, height, width), torch.ones(3, num_frames, height, width)
    framed = [wan_reference(r, (height, width)) for r in refs] or None
    z = wan_context(vae, video, mask, framed)
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(16, *z.shape[1:], generator=g, dtype=torch.float32)[None]
    initial = latents.clone()
    sigmas, timesteps = shifted(phantom_sigmas(steps), shift)
    solver = FlowUniPC(sigmas)
    for t in timesteps:
        t = torch.stack([t])
        cond = _predict(transformer, latents, t, text, z, context_scale)
        uncond = _predict(transformer, latents, t, text_null, z, context_scale)
        latents = solver.step(uncond + guide * (cond - uncond), latents)
    n = len(refs)
    return dict(context=z[None], initial=initial, latents=latents, video=latents[:, :, n:], timesteps=timesteps)


# ---------------------------------------------------------------- diffusers' WanVACEPipeline, as its users call it


@torch.no_grad()
def diffusers_sample(pipe, refs: list[Image.Image], prompt: str, negative_prompt: str | None, num_frames: int,
                     height: int, width: int, seed: int, steps: int = 50, sigmas: np.ndarray | None = None,
                     video=None, mask=None) -> dict:
    """WanVACEPipeline(...)(reference_images=refs, ...) with output_type="latent" (which keeps the reference frames:
    its own decode drops them, :1025). sigmas: the unshifted grid handed to its scheduler's set_timesteps (None: the
    scheduler's own). Returns latents (N + T frames) and video (the last T)."""
    scheduler = pipe.scheduler
    if sigmas is not None:
        own = scheduler.set_timesteps
        scheduler.set_timesteps = partial(own, sigmas=np.asarray(sigmas))
    try:
        latents = pipe(prompt=prompt, negative_prompt=negative_prompt, reference_images=list(refs) or None,
                       video=video, mask=mask, height=height, width=width, num_frames=num_frames,
                       num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                       output_type="latent").frames
    finally:
        if sigmas is not None:
            del scheduler.set_timesteps
    return dict(latents=latents, video=latents[:, :, len(refs):])


# ---------------------------------------------------------------- ComfyUI's VACE model


def comfy_lora_keys(original_parameters) -> set[str]:
    """What comfy/lora.py model_lora_keys_unet maps for a WAN21_Vace model: every `diffusion_model.<module>` of its
    state dict that ends in .weight, as the key `diffusion_model.<module>` (its generic format), whose LoRA load_lora
    then reads as `<key>.lora_up.weight` / `<key>.lora_down.weight` (+ `.alpha`). original_parameters: the model's
    parameter names without the prefix (ComfyUI's VaceWanModel keeps Wan's: blocks.N.self_attn.q, vace_blocks.N.
    before_proj, vace_patch_embedding ...)."""
    return {f"diffusion_model.{k.removesuffix('.weight')}" for k in original_parameters if k.endswith(".weight")}


def comfy_patch(original: dict[str, torch.Tensor], lora: dict[str, torch.Tensor],
                strength: float = 1.0) -> tuple[dict[str, torch.Tensor], set[str]]:
    """ComfyUI's LoraLoader on original-key weights: each LoRA key `<key>.lora_up/.lora_down.weight` whose `<key>` is
    one of comfy_lora_keys patches `<key>.weight` += strength * (alpha / rank or 1) * up @ down (calculate_weight's
    "lora" patch). Returns the patched weights and the LoRA file keys that were NOT loaded (ComfyUI's "lora key not
    loaded" warnings)."""
    keys = comfy_lora_keys(original)
    out = {k: v.clone() for k, v in original.items()}
    loaded = set()
    for key in keys:
        up, down = lora.get(f"{key}.lora_up.weight"), lora.get(f"{key}.lora_down.weight")
        if up is None:
            continue
        alpha = lora.get(f"{key}.alpha")
        alpha = 1.0 if alpha is None else alpha.item() / down.shape[0]
        weight = key.removeprefix("diffusion_model.") + ".weight"
        out[weight] = out[weight] + (strength * alpha) * torch.mm(up.flatten(1), down.flatten(1)).reshape(
            out[weight].shape).to(out[weight].dtype)
        loaded |= {f"{key}.lora_up.weight", f"{key}.lora_down.weight", f"{key}.alpha"}
    return out, set(lora) - loaded


@torch.no_grad()
def comfy_forward(transformer, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, vace_context: torch.Tensor,
                  strength: float = 1.0) -> torch.Tensor:
    """VaceWanModel.forward_orig's order of work on the weights of `transformer` (diffusers' modules: the block
    arithmetic is Wan's in both): patch-embed x (x_orig) and the context; then for each block i: the block, and when
    i is a VACE layer its context block on (c, x_orig), x += c_skip * strength. vace_context (B, 96, F, h, w)."""
    p_t, p_h, p_w = transformer.config.patch_size
    b, _, f, h, w = x.shape
    rotary = transformer.rope(x)
    x = transformer.patch_embedding(x).flatten(2).transpose(1, 2)
    c = transformer.vace_patch_embedding(vace_context).flatten(2).transpose(1, 2)
    temb, proj, text, _ = transformer.condition_embedder(t, text, None)
    proj = proj.unflatten(1, (6, -1))
    x_orig = x
    mapping = {layer: n for n, layer in enumerate(transformer.config.vace_layers)}
    for i, block in enumerate(transformer.blocks):
        x = block(x, text, proj, rotary)
        if i in mapping:
            c_skip, c = transformer.vace_blocks[mapping[i]](x_orig, text, c, proj, rotary)
            x = x + c_skip * strength
    shift, scale = (transformer.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    x = transformer.proj_out((transformer.norm_out(x.float()) * (1 + scale) + shift).type_as(x))
    x = x.reshape(b, f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)
