"""RefAlign's sampler and DiT forward, written out step by step from its code (read, not imported: a DiffSynth fork
that needs CUDA and its own model classes), to compare a2's refalign kind with. It drives the modules of a diffusers
WanTransformer3DModel (its original-Wan weights as a2 reads them, default processors) and a diffusers
AutoencoderKLWan; the text encoder is fed as its outputs (the 512-token UMT5 states), the same tensors a2 gets.

Read: gudaochangsheng/RefAlign @ 6f91526 (2026-05): examples/wanvideo/model_inference/Wan2.1-T2V-1.3B_subject.py
(framing, seed 0, cfg_scale 5, Wan's negative prompt), diffsynth/pipelines/wan_video_new3.py (__call__ :771-948,
WanVideoUnit_Subject :1192-1252, model_fn_wan_video :2297-2720, generate_noise :188), diffsynth/models/
wan_video_dit.py (DiTBlock.forward with cond_size :603-630), diffsynth/schedulers/flow_match.py; and its training
loss's alignment term from diffsynth/pipelines/wan_video_new6.py, the pipeline its examples/wanvideo/model_training/
train.py imports (gate_from_timestep :273-293, WanVideoPipeline.training_loss :501-523,
cosine_margin_pos_inter_subject_neg_flat :1928-1981, the per-block loop of model_fn_wan_video :2645-2697).
"""

from __future__ import annotations

import numpy as np
import torch

from tests.their_samplers import fit_pad_white, normalise

REFALIGN_TEXT_SCALE = 7.5  # hard-coded in its __call__: nega + cfg * (posi_noref - nega) + 7.5 * (posi - posi_noref)


def preprocess(image) -> torch.Tensor:
    """preprocess_image (wan_video_new3.py:81-87): float32 pixels * (2 / 255) - 1, (3, H, W)."""
    return (torch.Tensor(np.array(image, dtype=np.float32)) * (2 / 255) - 1).permute(2, 0, 1)


def flowmatch_sigmas(steps: int, shift: float = 5.0) -> torch.Tensor:
    """FlowMatchScheduler(shift=5, sigma_min=0.0, extra_one_step=True).set_timesteps(steps): linspace(1, 0, steps + 1)
    without its last, shifted."""
    s = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    return shift * s / (1 + (shift - 1) * s)


def forward(tr, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
            subject: torch.Tensor) -> torch.Tensor:
    """model_fn_wan_video with subject_latents: the video's tokens, then the references' (patchify_ip: the same patch
    embedding) at RoPE frames f .. f + f_ip with rows and columns from 0 (freqs_ip), one time embedding for all; each
    DiTBlock with cond_size: self-attention over all tokens, the text cross-attention added to the video tokens alone
    (x_ip = x[:, -cond_size:] untouched), the FFN over all; the head, the reference tokens cut, unpatchify."""
    b, _, f, h, w = latents.shape
    p_t, p_h, p_w = tr.config.patch_size
    video = tr.patch_embedding(latents).flatten(2).transpose(1, 2)
    ip = tr.patch_embedding(subject).flatten(2).transpose(1, 2)
    cond_size = ip.shape[1]
    x = torch.cat([video, ip], dim=1)
    rotary = tr.rope(torch.cat([latents, subject], dim=2))  # frames 0 .. f + f_ip - 1 of the same (h, w) grid
    temb, proj, text, _ = tr.condition_embedder(timestep, context, None)
    proj = proj.unflatten(1, (6, -1))
    for block in tr.blocks:
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = (block.scale_shift_table + proj.float()).chunk(6, 1)
        y = (block.norm1(x.float()) * (1 + scale_msa) + shift_msa).type_as(x)
        x = (x.float() + block.attn1(y, None, None, rotary) * gate_msa).type_as(x)
        x_video, x_ip = x[:, :-cond_size], x[:, -cond_size:]
        x_video = x_video + block.attn2(block.norm2(x_video.float()).type_as(x_video), text, None, None)
        x = torch.cat([x_video, x_ip], dim=1)
        y = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        x = (x.float() + block.ffn(y).float() * c_gate).type_as(x)
    shift, scale = (tr.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    x = (tr.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
    x = tr.proj_out(x)[:, :-cond_size]  # x = x[:, :-x_ip.shape[1]]
    x = x.reshape(b, f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


@torch.no_grad()
def refalign_sample(tr, vae, refs, text: torch.Tensor, text_null: torch.Tensor, num_frames: int, height: int,
                    width: int, steps: int = 50, seed: int = 0, cfg_scale: float = 5.0,
                    dtype: torch.dtype = torch.float32) -> dict:
    """WanVideoPipeline.__call__ as its example calls it: each reference framed by the example's
    short_resize_and_crop_pil (Lanczos fit, white pad: Phantom's fit_pad_white), then resized to (width, height) by
    the pipeline (a no-op at that size), alone as a 1-frame clip (preprocess_video), its VAE mean (WanVideoVAE.encode's
    mu, normalised); noise N(0, 1) from a CPU generator
    seeded `seed` for the video frames only; per step the timestep cast to the pipeline dtype (bf16 in its example:
    937.5 becomes 936), three passes (C: prompt + references; U: negative prompt, references * 0; I: negative
    prompt + references), U + cfg (I - U) + 7.5 (C - I), Euler to the next sigma (0 after the last)."""
    subject = []
    for image in refs:
        x = preprocess(fit_pad_white(image, width, height).resize((width, height)))[None, :, None]  # (1, 3, 1, H, W)
        subject.append(normalise(vae, vae.encode(x).latent_dist.mean))
    subject = torch.cat(subject, dim=2)  # (1, 16, N, h, w)
    shape = (1, 16, (num_frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    initial = latents.clone()
    sigmas = flowmatch_sigmas(steps)
    for i, t in enumerate(sigmas * 1000):
        timestep = t.unsqueeze(0).to(dtype)
        posi = forward(tr, latents, timestep, text, subject)
        nega = forward(tr, latents, timestep, text_null, subject * 0.0)
        posi_noref = forward(tr, latents, timestep, text_null, subject)
        pred = nega + cfg_scale * (posi_noref - nega) + REFALIGN_TEXT_SCALE * (posi - posi_noref)
        after = sigmas[i + 1] if i + 1 < len(sigmas) else 0.0
        latents = latents + pred * (after - sigmas[i])
    return dict(condition=subject, initial=initial, latents=latents)


# ---------------------------------------------------------------- its training loss's alignment term


def gate_from_timestep(t, t_first, t_last, beta=1.0, descending=True, min_val=0.0, max_val=1.0):
    """wan_video_new6.py:273-293, as written (training_loss calls it as (timestep, 0, 1000, beta=3.0))."""
    eps = 1e-8
    x = (t - t_last) / (t_first - t_last + eps) if descending else (t - t_first) / (t_last - t_first + eps)
    x = x.clamp(0, 1)
    return min_val + (max_val - min_val) * (1.0 - x).pow(beta)


def pos_neg(student: torch.Tensor, teacher: torch.Tensor, tokens_per_subject: int) -> torch.Tensor:
    """cosine_margin_pos_inter_subject_neg_flat (:1928-1981) at its defaults (pos_margin 0, neg_margin 1, neg_weight 1):
    (N, C) students and teachers of N / tokens_per_subject references -> total = pos + neg."""
    n = student.shape[0]
    s, t = torch.nn.functional.normalize(student, dim=-1), torch.nn.functional.normalize(teacher, dim=-1)
    pos = torch.relu(1.0 - (s * t).sum(-1)).mean()
    if n // tokens_per_subject <= 1:
        return pos
    block = torch.arange(n) // tokens_per_subject
    mask = block.view(n, 1).ne(block.view(1, n))
    mask.fill_diagonal_(False)
    return pos + torch.relu(1.0 - (1.0 - s @ t.t())[mask]).mean()


def training_align_loss(features: dict, targets: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """training_loss's align_loss1 for one sample (their batch is 1): per aligned block (model_fn_wan_video's loop over
    blocks 0..8: block.input_mlp on the block's reference tokens, `rearrange(x_ip, 'b l c -> (b l) c')`) the pos + neg
    against the DINOv3 targets, the mean over the blocks, times gate_from_timestep(timestep, 0, 1000, beta=3.0).
    features: {block: (N, L, D)} projected reference tokens, targets (N, L, D), timestep: the sample's (1,)."""
    per_block = [pos_neg(f.flatten(0, 1), targets.flatten(0, 1), f.shape[1]) for _, f in sorted(features.items())]
    return gate_from_timestep(timestep, 0, 1000, beta=3.0) * torch.stack(per_block).mean()
