"""Phantom-Wan's and SkyReels-V3 R2V's samplers, written out step by step from their code (read, not imported:
their repos need CUDA, flash-attn and xfuser), to compare a2's sampler with. Each sampler's docstring names the
upstream function and the file:lines it writes out, in the files listed below. Both drive a diffusers
WanTransformer3DModel and a diffusers AutoencoderKLWan; their text encoders are fed as their outputs (the 512-token
UMT5 states, zero past the prompt), the same tensors a2 gets.

Read: svjack/Phantom @ 51ef427 (2025-04-26; phantom_wan/subject2video.py, generate.py, utils/fm_solvers_unipc.py)
and SkyworkAI/SkyReels-V3 @ 28c771e (2026-01-30; skyreels_v3/pipelines/reference_to_video_pipeline.py).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageOps

PHANTOM_GUIDE_IMG, PHANTOM_GUIDE_TEXT = 5.0, 7.5  # generate.py --sample_guide_scale_img / _text defaults
PHANTOM_STEPS, PHANTOM_SHIFT = 50, 5.0  # generate.py _validate_args: --sample_steps, --sample_shift for s2v
# phantom_wan/configs/shared_config.py:19 sample_neg_prompt (subject2video.py:213: the negative prompt it samples with)
WAN_NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"  # noqa: RUF001
                "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的"  # noqa: RUF001
                "肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")  # noqa: RUF001
V3_MAX_REFS = 4  # MAX_ALLOWED_REF_IMG_LENGTH
V3_SEED = 42  # generate_video.py --seed
V3_STEPS, V3_GUIDE, V3_GUIDE_IMG = 50, 7.5, 5.0  # WanSkyReelsA2WanT2VPipeline.__call__'s defaults (:400-402)
# what the entry point runs: generate_video.py:289 -> ReferenceToVideoPipeline.generate_video (:768-790): 8 steps,
# guidance 1.0 / 1.0 (one pass: do_classifier_free_guidance is guidance_scale > 1, :367-368), negative ""
V3_DISTILLED_STEPS = 8


def fit_pad_white(image: Image.Image, width: int, height: int) -> Image.Image:
    """Both labs' reference preprocessing: Lanczos-resize to fit inside width x height (the long side exact, the
    other truncated), then pad with white to exactly width x height, the odd pixel right / bottom."""
    image = image.convert("RGB")
    ratio = image.width / image.height
    if ratio > width / height:
        size = (width, int(width / ratio))
    else:
        size = (int(height * ratio), height)
    image = image.resize(size, Image.Resampling.LANCZOS)
    dw, dh = width - image.width, height - image.height
    return ImageOps.expand(image, (dw // 2, dh // 2, dw - dw // 2, dh - dh // 2), fill=(255, 255, 255))


def pixels(image: Image.Image) -> torch.Tensor:
    """TF.to_tensor(image).sub_(0.5).div_(0.5): (3, H, W) in [-1, 1]."""
    x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)
    return x.sub_(0.5).div_(0.5)


def normalise(vae, z: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) * inv_std


# ---------------------------------------------------------------- their flow UniPC (UniPC-2, bh2, x0-predicting)


def phantom_sigmas(steps: int) -> np.ndarray:
    """FlowUniPCMultistepScheduler(shift=1).set_timesteps(steps, shift=...)'s sigmas before the shift: from sigma_max,
    the float32 training sigma 0.999 read back as a Python float, to 0, the last dropped."""
    train = torch.from_numpy(1.0 - np.linspace(1, 1 / 1000, 1000)[::-1].copy()).to(torch.float32)
    return np.linspace(train[0].item(), train[-1].item(), steps + 1).copy()[:-1]


def diffusers034_sigmas(steps: int) -> np.ndarray:
    """diffusers 0.34.0's UniPCMultistepScheduler(use_flow_sigmas).set_timesteps(steps)'s sigmas before the shift
    (SkyReels-V3 pins diffusers==0.34.0; 0.37 changed this default to start at sigma 1 - 1e-6)."""
    return np.flip(1.0 - np.linspace(1, 1 / 1000, steps + 1))[:-1].copy()


def shifted(sigmas: np.ndarray, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Both: sigma -> shift·sigma / (1 + (shift - 1)·sigma) in float64; float32 sigmas with a final 0, and the
    timesteps 1000·sigma truncated to int64 (what the transformer gets)."""
    s = shift * sigmas / (1 + (shift - 1) * sigmas)
    return torch.from_numpy(np.concatenate([s, [0]]).astype(np.float32)), torch.from_numpy(s * 1000).to(torch.int64)


class FlowUniPC:
    """Their solver's step (fm_solvers_unipc.py step / multistep_uni_p_bh_update / multistep_uni_c_bh_update) at
    its defaults: order 2, bh2, x0 prediction x0 = x - sigma * v, lower order at the last step, corrector on."""

    def __init__(self, sigmas: torch.Tensor):
        self.sigmas, self.i = sigmas, 0
        self.x0s: list[torch.Tensor] = []  # converted model outputs, oldest first (at most 2)
        self.last_sample = None
        self.order = 1

    def _lambda(self, i):
        s = self.sigmas[i]
        return torch.log(1 - s) - torch.log(s)

    def _coeffs(self, i_to, i_from):
        h = self._lambda(i_to) - self._lambda(i_from)
        hh = -h
        h_phi_1 = torch.expm1(hh)
        return h, hh, h_phi_1, torch.expm1(hh)  # B(h) = e^hh - 1 (bh2)

    def _b(self, hh, h_phi_1, b_h, order):
        b, h_phi_k, fact = [], h_phi_1 / hh - 1, 1
        for k in range(1, order + 1):
            b.append(h_phi_k * fact / b_h)
            fact *= k + 1
            h_phi_k = h_phi_k / hh - 1 / fact
        return torch.tensor(b)

    def step(self, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        i, s = self.i, self.sigmas
        x0 = x - s[i] * v
        if i > 0 and self.last_sample is not None:  # UniC: correct x with the new model output
            h, hh, h_phi_1, b_h = self._coeffs(i, i - 1)
            m0 = self.x0s[-1]
            if self.order == 1:
                rho = torch.tensor([0.5])
                corr = 0
            else:
                rk = (self._lambda(i - 2) - self._lambda(i - 1)) / h
                d1 = (self.x0s[-2] - m0) / rk
                r = torch.stack([torch.tensor([1.0, 1.0]), torch.tensor([rk.item(), 1.0])])
                rho = torch.linalg.solve(r, self._b(hh, h_phi_1, b_h, 2))
                corr = rho[0] * d1
            x_ = s[i] / s[i - 1] * self.last_sample - (1 - s[i]) * h_phi_1 * m0
            x = x_ - (1 - s[i]) * b_h * (corr + rho[-1] * (x0 - m0))
        self.x0s = (self.x0s + [x0])[-2:]
        self.order = min(2, len(s) - 1 - i, len(self.x0s))
        self.last_sample = x
        h, hh, h_phi_1, b_h = self._coeffs(i + 1, i)  # UniP: predict the next sample
        x_next = s[i + 1] / s[i] * x - (1 - s[i + 1]) * h_phi_1 * x0
        if self.order == 2:
            rk = (self._lambda(i - 1) - self._lambda(i)) / h
            x_next = x_next - (1 - s[i + 1]) * b_h * (0.5 * (self.x0s[-2] - x0) / rk)
        self.i += 1
        return x_next


# ---------------------------------------------------------------- the samplers


def _predict(transformer, x, t, text):
    return transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]


@torch.no_grad()
def phantom_sample(transformer, vae, refs: list[Image.Image], text: torch.Tensor, text_null: torch.Tensor,
                   num_frames: int, height: int, width: int, steps: int, seed: int, shift: float = 5.0,
                   guide_img: float = PHANTOM_GUIDE_IMG, guide_text: float = PHANTOM_GUIDE_TEXT) -> dict:
    """Phantom_Wan_S2V.generate (subject2video.py:151-310) after load_ref_images (generate.py:242-272).
    text / text_null: (1, 512, C), the prompt's and the negative prompt's (Wan's Chinese one when none is given).
    Returns condition (1, 16, L, h, w), initial (1, 16, T + L, h, w), latents (the final T + L frames; the last L
    are never read) and video (the first T, what is decoded)."""
    cond = []
    for image in refs:  # each reference its own 1-frame clip, posterior mean
        x = pixels(fit_pad_white(image, width, height))[None, :, None]  # (1, 3, 1, H, W)
        cond.append(normalise(vae, vae.encode(x).latent_dist.mean))
    cond = torch.cat(cond, dim=2)  # (1, 16, L, h, w)
    n_ref = cond.shape[2]
    t_lat = (num_frames - 1) // 4 + 1
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(16, t_lat + n_ref, height // 8, width // 8, generator=g, dtype=torch.float32)[None]
    initial = latents.clone()
    sigmas, timesteps = shifted(phantom_sigmas(steps), shift)
    solver = FlowUniPC(sigmas)
    for t in timesteps:
        t = torch.stack([t])
        x_ref = torch.cat([latents[:, :, :-n_ref], cond], dim=2)  # the reference slots: the clean references
        x_neg = torch.cat([latents[:, :, :-n_ref], torch.zeros_like(cond)], dim=2)
        pos_it = _predict(transformer, x_ref, t, text)
        pos_i = _predict(transformer, x_ref, t, text_null)
        neg = _predict(transformer, x_neg, t, text_null)
        v = neg + guide_img * (pos_i - neg) + guide_text * (pos_it - pos_i)
        latents = solver.step(v, latents)
    return dict(condition=cond, initial=initial, latents=latents, video=latents[:, :, :-n_ref], timesteps=timesteps)


@torch.no_grad()
def v3_sample(transformer, vae, refs: list[Image.Image], text: torch.Tensor, text_null: torch.Tensor,
              num_frames: int, height: int, width: int, steps: int, seed: int, shift: float = 5.0,
              guidance: float = 1.0, guidance_img: float = 1.0) -> dict:
    """WanSkyReelsA2WanT2VPipeline.__call__ (reference_to_video_pipeline.py:391-657) after resize_ref_images
    (:660-693), under its pinned diffusers 0.34 schedule. guidance 1.0 (ReferenceToVideoPipeline.generate_video's,
    with 8 steps: what its entry point runs, a2's default) runs one pass; > 1 runs three. Returns condition (1, 16,
    4, h, w: the references, then zero slots), initial (1, 16, T, h, w) and latents (the final T frames, all
    decoded)."""
    if len(refs) > V3_MAX_REFS:
        raise ValueError(f"{len(refs)} references; SkyReels-V3 takes at most {V3_MAX_REFS}")
    t_lat, h, w = (num_frames - 1) // 4 + 1, height // 8, width // 8
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, t_lat, h, w, generator=g, dtype=torch.float32)  # the noise first
    initial = latents.clone()
    cond = []
    for image in refs:  # then each reference's posterior *sample*, from the same generator
        dist = vae.encode(pixels(fit_pad_white(image, width, height))[None, :, None]).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g, dtype=dist.mean.dtype)
        cond.append(normalise(vae, z))
    cond += [torch.zeros(1, 16, 1, h, w)] * (V3_MAX_REFS - len(cond))
    cond = torch.cat(cond, dim=2)  # (1, 16, 4, h, w)
    sigmas, timesteps = shifted(diffusers034_sigmas(steps), shift)
    solver = FlowUniPC(sigmas)
    for t in timesteps:
        t = t.expand(1)
        v = _predict(transformer, torch.cat([latents, cond], dim=2), t, text)[:, :, :t_lat]
        if guidance > 1:
            u_t = _predict(transformer, torch.cat([latents, cond], dim=2), t, text_null)[:, :, :t_lat]
            u_ti = _predict(transformer, torch.cat([latents, torch.zeros_like(cond)], dim=2), t, text_null)
            u_ti = u_ti[:, :, :t_lat]
            v = u_ti + guidance_img * (u_t - u_ti) + guidance * (v - u_t)
        latents = solver.step(v, latents)
    return dict(condition=cond, initial=initial, latents=latents, timesteps=timesteps)
