"""Kaleido's DiT, sampler and training loss, written out step by step from their code (read, not imported: their
repo runs under SAT with DeepSpeed, CUDA-only module construction (`.cuda()` in its RoPE mixin) and a process group),
to compare a2 with (tests/test_kaleido.py). It runs on the SAT checkpoint's own tensors (fused query_key_value and
key_value), so a2's conversion of them is tested, not assumed.

Read: zai-org/Kaleido @ 4c6c757 (2025-10-28):
- dit_video_crossattn.py: DiffusionTransformer.forward (:1189-1309: references prepended on frames, one timestep),
  ImagePatchEmbeddingMixin (:119-146), Rotary3DPositionEmbeddingMixin (:342-563: float32 frequencies, interleaved
  pairs, video rows from time 0, reference i at time i and rows / columns from max_h = max_w = 80), AdaLNMixin
  (:795-975: share_adaln, LayerNorm without affine, RMSNorm q/k over the whole width, every token's text
  cross-attention, image_cross_text), FinalLayerMixin (:583-627: the reference tokens dropped, then the head);
- sgm/modules/diffusionmodules/util.py:207-231 timestep_embedding (cos | sin, float64 frequencies);
- sgm/modules/diffusionmodules/sampling.py:889-1019 (make_hunyuan_timesteps, RFSampler), guiders.py:23-57
  (VanillaCFG: uc and c in one batch), denoiser_scaling.py:71-79 (RFScaling: timestep sigma * 1000);
- diffusion_video.py:308-375 (sample: the CPU torch.randn of (B, T, C, h, w)), sample_video.py:199-305 (references,
  the unconditional's references, the call); configs (model yaml, sampling yaml);
- sgm/modules/diffusionmodules/loss.py:16-29, 562-653 (RFLoss), sigma_sampling.py:110-118 (RFSampling).
The VAE is diffusers' AutoencoderKLWan (their WanVAE is the same network; its encode returns the posterior mean,
normalised (mu - mean) * (1 / std)), and the text encoder's outputs are given (a2's encode_prompt on the tiny UMT5:
512 tokens, zero past the prompt, as their umt5.py:516-522)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image, ImageOps

STEPS = 50  # model yaml sampler_config num_steps
SHIFT_SCALE = 7  # RFSampler(shift_scale=7): its default; the yaml sets none
GUIDANCE = 6  # model yaml guider_config VanillaCFG scale
SEED = 1234  # sat/arguments.py --seed default
MAX_H = MAX_W = 80  # model yaml pos_embed_config max_h / max_w
MAX_SUBJECTS = 3  # forward's kwargs['max_subject_nums']
# configs/sampling/sample_wanvae_concat_14b.yaml:13
NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"  # noqa: RUF001
            "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，畸形的，毁容的，形态畸形的肢体，手指融合，"  # noqa: RUF001
            "静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")  # noqa: RUF001
P = "model.diffusion_model."


# ---------------------------------------------------------------- the DiT on SAT's tensors


def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float64) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1).float()


def rope_tables(head_dim: int, t_pos: torch.Tensor, h_pos: torch.Tensor, w_pos: torch.Tensor):
    """Their Rotary3DPositionEmbeddingMixin.__init__ (interleaved) at the given positions: (cos, sin) (T, H, W, d)."""
    dim_t = head_dim - 4 * (head_dim // 6)
    dim_h = dim_w = (head_dim // 6) * 2
    out = []
    for dim, pos in ((dim_t, t_pos), (dim_h, h_pos), (dim_w, w_pos)):
        freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        f = torch.einsum("..., f -> ... f", pos.float(), freqs)
        out.append(f.repeat_interleave(2, -1))  # repeat '... n -> ... (n r)', r=2
    t, h, w = out
    freqs = torch.cat([t[:, None, None].expand(-1, len(h_pos), len(w_pos), -1),
                       h[None, :, None].expand(len(t_pos), -1, len(w_pos), -1),
                       w[None, None, :].expand(len(t_pos), len(h_pos), -1, -1)], -1)
    return freqs.cos(), freqs.sin()


def rotate_half(x):
    x = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = x.unbind(-1)
    return rearrange(torch.stack((-x2, x1), -1), "... d r -> ... (d r)")


def rms(x, weight, eps=1e-6):
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def linear(sd, name, x):
    return F.linear(x, sd[P + name + ".weight"], sd[P + name + ".bias"])


def forward(sd: dict, heads: int, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
            subjects: torch.Tensor | None) -> torch.Tensor:
    """DiffusionTransformer.forward: x (B, T, C, h, w) the noisy video, timesteps (B,), context (B, 512, 4096) the
    text states, subjects (B, n, C, h, w) the clean reference latents -> the velocity (B, T, C, h, w) of the video."""
    b, t, _, h, w = x.shape
    n = 0 if subjects is None else subjects.shape[1]
    if n:
        x = torch.cat([subjects, x], 1)
    proj = sd[P + "mixins.patch_embed.proj.weight"]
    p = proj.shape[2:]
    emb_x = F.conv3d(rearrange(x, "b t c h w -> b c t h w"), proj, sd[P + "mixins.patch_embed.proj.bias"], stride=p)
    hs = rearrange(emb_x, "b c t h w -> b (t h w) c")
    dim = hs.shape[-1]
    gelu = torch.nn.GELU(approximate="tanh")
    ctx = linear(sd, "text_embedding.2", gelu(linear(sd, "text_embedding.0", context)))
    emb = linear(sd, "time_embed.2", F.silu(linear(sd, "time_embed.0", timestep_embedding(
        timesteps, sd[P + "time_embed.0.weight"].shape[1]))))
    adaln = linear(sd, "adaln_projection.1", F.silu(emb))
    rt, rh, rw = t // p[0], h // p[1], w // p[2]
    head_dim = dim // heads
    # rotary(): rows start_t = max_subject_nums of the grid [-1] * 3 + [0, 1, ...]: the video at times 0..T-1
    cos_v, sin_v = rope_tables(head_dim, torch.arange(rt), torch.arange(rh), torch.arange(rw))
    cos_v, sin_v = (c.reshape(1, 1, -1, head_dim) for c in (cos_v, sin_v))
    sub_len = n * rh * rw
    refs = []  # rotary_image(): reference i at grid row t_s + i (time i), rows and columns from MAX_H / MAX_W
    for i in range(n):
        c, s = rope_tables(head_dim, torch.tensor([float(i)]), torch.arange(MAX_H, MAX_H + rh),
                           torch.arange(MAX_W, MAX_W + rw))
        refs.append((c.reshape(1, 1, -1, head_dim), s.reshape(1, 1, -1, head_dim)))

    def rope(q):
        video = q[:, :, sub_len:] * cos_v + rotate_half(q[:, :, sub_len:]) * sin_v
        parts = []
        for i, (c, s) in enumerate(refs):
            r = q[:, :, i * rh * rw:(i + 1) * rh * rw]
            parts.append(r * c + rotate_half(r) * s)
        return torch.cat(parts + [video], 2)

    def split_heads(v):
        return rearrange(v, "b s (n d) -> b n s d", n=heads)

    layers = 1 + max(int(k.split(".")[4]) for k in sd if k.startswith(P + "transformer.layers."))
    for i in range(layers):
        lp, mp = f"transformer.layers.{i}.", "mixins.adaln_layer."
        mod = sd[P + mp + f"adaLN_modulations.{i}"]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            adaln.unflatten(1, (6, mod.shape[-1])) + mod).chunk(6, dim=1)
        a = F.layer_norm(hs, (dim,), eps=1e-6) * (1 + scale_msa) + shift_msa
        q, k, v = linear(sd, lp + "attention.query_key_value", a).chunk(3, -1)
        q = rms(q, sd[P + mp + f"query_layernorm_list.{i}.weight"])
        k = rms(k, sd[P + mp + f"key_layernorm_list.{i}.weight"])
        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        o = F.scaled_dot_product_attention(rope(q), rope(k), v)
        hs = hs + gate_msa * linear(sd, lp + "attention.dense", rearrange(o, "b n s d -> b s (n d)"))
        c_in = F.layer_norm(hs, (dim,), sd[P + lp + "post_cross_attention_layernorm.weight"],
                            sd[P + lp + "post_cross_attention_layernorm.bias"], eps=1e-6)
        q = rms(linear(sd, lp + "cross_attention.query", c_in), sd[P + mp + f"cross_query_layernorm_list.{i}.weight"])
        k, v = linear(sd, lp + "cross_attention.key_value", ctx).chunk(2, -1)
        k = rms(k, sd[P + mp + f"cross_key_layernorm_list.{i}.weight"])
        o = F.scaled_dot_product_attention(split_heads(q), split_heads(k), split_heads(v))
        hs = hs + linear(sd, lp + "cross_attention.dense", rearrange(o, "b n s d -> b s (n d)"))
        m = F.layer_norm(hs, (dim,), eps=1e-6) * (1 + scale_mlp) + shift_mlp
        m = linear(sd, lp + "mlp.dense_4h_to_h", gelu(linear(sd, lp + "mlp.dense_h_to_4h", m)))
        hs = hs + gate_mlp * m
    hs = hs[:, sub_len:]
    shift, scale = (emb.unsqueeze(1) + sd[P + "mixins.final_layer.adaLN_modulation"]).chunk(2, dim=1)
    hs = linear(sd, "mixins.final_layer.linear", F.layer_norm(hs, (dim,), eps=1e-6) * (1 + scale) + shift)
    c_out = hs.shape[-1] // math.prod(p)
    return rearrange(hs, "b (t h w) (o p q c) -> b (t o) c (h p) (w q)", c=c_out, o=p[0], p=p[1], q=p[2],
                     t=rt, h=rh, w=rw)


# ---------------------------------------------------------------- the sampler


def sigmas(steps: int = STEPS, shift_scale: float = SHIFT_SCALE) -> torch.Tensor:
    """make_hunyuan_timesteps(0, steps, shift_scale, mode='normal')."""
    s = np.linspace(0, 1.0, steps + 1, endpoint=True)
    s = s / (shift_scale + s - shift_scale * s)
    return 1 - torch.tensor(s, dtype=torch.float32)


def reference_latents(vae, images: list[Image.Image], height: int, width: int) -> torch.Tensor:
    """sample_video.py:205-238 (new_straetgy): each image Lanczos-fit into height x width (int() sides), centred on
    white, (x - 127.5) / 127.5, encoded alone as a 1-frame clip (the posterior mean, normalised); (1, n, C, h, w)."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    out = []
    for ref in images:
        ref = ref.convert("RGB")
        ratio = ref.width / ref.height
        if ratio > width / height:
            nw, nh = width, int(width / ratio)
        else:
            nh, nw = height, int(height * ratio)
        ref = ref.resize((nw, nh), Image.Resampling.LANCZOS)
        dw, dh = width - ref.size[0], height - ref.size[1]
        img = ImageOps.expand(ref, (dw // 2, dh // 2, dw - dw // 2, dh - dh // 2), fill=(255, 255, 255))
        x = (torch.from_numpy(np.array(img)).unsqueeze(0).permute(0, 3, 1, 2).float() - 127.5) / 127.5
        mu = vae.encode(x.unsqueeze(2)).latent_dist.mean
        out.append(((mu - mean) * inv_std).permute(0, 2, 1, 3, 4))  # BCTHW -> BTCHW
    return torch.cat(out, 1)


@torch.no_grad()
def sample(sd: dict, heads: int, vae, images, text: torch.Tensor, null: torch.Tensor, num_latent_frames: int,
           height: int, width: int, seed: int = SEED, steps: int = STEPS, scale: float = GUIDANCE) -> dict:
    """sample_video.py's call of SATVideoDiffusionEngine.sample -> RFSampler: the references' latents, the noise
    torch.randn(1, T, C, h, w) on the CPU generator (seeded right before it here), then Euler over `sigmas`, each step
    one forward of [uncond, cond] (the same references in both) and uncond + scale (cond - uncond). Returns the
    reference latents, the initial noise and the final latents, each (1, C, T, h, w) as a2 lays them out."""
    subjects = reference_latents(vae, images, height, width)
    c = sd[P + "mixins.patch_embed.proj.weight"].shape[1]
    torch.manual_seed(seed)
    x = torch.randn(1, num_latent_frames, c, height // 8, width // 8).to(torch.float32)
    initial = x.clone()
    s = sigmas(steps)
    for i in range(len(s) - 1):
        sigma = torch.ones(1) * s[i]
        both = forward(sd, heads, torch.cat([x] * 2), torch.cat([sigma] * 2) * 1000, torch.cat([null, text]),
                       subjects.repeat(2, 1, 1, 1, 1)).float()
        x_u, x_c = both.chunk(2)
        x = x + (s[i + 1] - s[i]) * (x_u + scale * (x_c - x_u))
    return dict(condition=subjects.permute(0, 2, 1, 3, 4), initial=initial.permute(0, 2, 1, 3, 4),
                latents=x.permute(0, 2, 1, 3, 4))


# ---------------------------------------------------------------- the training loss


def shifted_sigma(sigma: torch.Tensor, h: int, w: int, patch=(1, 2, 2)) -> torch.Tensor:
    """RFLoss with schedule_shift: sigma[i] = time_shift(mu, sigma[i], 'normal') (a 0-dim float32 tensor and Python
    floats), mu = get_lin_function(y1=0.5, y2=1.15) of the latent tokens per frame."""
    tokens = h * w // patch[-1] // patch[-2]
    m = (1.15 - 0.5) / (4096 - 256)
    mu = m * tokens + (0.5 - m * 256)
    sigma = sigma.clone()
    for i in range(sigma.shape[0]):
        sigma[i] = math.exp(mu) / (math.exp(mu) + 1 / sigma[i] - 1)
    return sigma


def rf_loss(sd: dict, heads: int, x0: torch.Tensor, subjects: torch.Tensor, context: torch.Tensor,
            sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """RFLoss.__call__ given RFSampling's draw `sigma` (B,) (sigmoid of a standard normal) and the noise, both in
    their (B, T, C, h, w): the shift, x_t, the DiT at sigma * 1000 with the clean references, the per-sample mean
    squared error against noise - x0, then the batch mean (SATVideoDiffusionEngine.forward)."""
    sigma = shifted_sigma(sigma, *x0.shape[-2:])
    s = sigma.view(-1, 1, 1, 1, 1)
    noised = x0.float() * (1 - s) + noise * s
    out = forward(sd, heads, noised, sigma * 1000, context, subjects)
    return ((out - (noise - x0)) ** 2).reshape(x0.shape[0], -1).mean(1).mean()
