"""Stand-In's DiT forward with reference tokens, and its sampling loop's K/V cache, written out step by step on the
weights of a diffusers WanTransformer3DModel: the reference a2.kinds.standin is tested against (tests/test_standin.py).

Read from WeChatCV/Stand-In cceec58 (models/wan_video_dit.py: precompute_freqs_cis (positions from -1), rope_apply,
RMSNorm, LoRALinearLayer, SelfAttention.forward, CrossAttention, DiTBlock.forward, Head; pipelines/wan_video.py:
model_fn_wan_video, encode_ip_image, WanVideoUnit_NoiseInitializer, BasePipeline.generate_noise and
WanVideoPipeline.__call__'s loop; schedulers/flow_match.py: FlowMatchScheduler; infer.py: its defaults). Their module
names on diffusers' weights: self_attn.{q,k,v,o} = attn1.{to_q,to_k,to_v,to_out.0}, norm_q/norm_k =
attn1.norm_q/norm_k, cross_attn = attn2, their norm3 (affine, before cross-attention) = diffusers' norm2, their norm2
(before the FFN) = diffusers' norm3, modulation = scale_shift_table, ffn.{0,2} = ffn.net.{0.proj,2}, time_embedding =
condition_embedder.time_embedder, time_projection = its act_fn + time_proj, text_embedding = its text_embedder, head =
norm_out + proj_out + scale_shift_table.

wan_numerics=True computes as Stand-In does where original Wan and diffusers round differently: the sinusoidal time
embedding in float64 (cast to float32), RoPE as a complex128 product (cast to float32), RMSNorm as x * rsqrt(mean(x^2)
+ eps). wan_numerics=False uses diffusers' float32 arithmetic for those three (its get_timestep_embedding, the real
cos/sin RoPE of WanAttnProcessor, torch's RMSNorm), so that what is left is Stand-In's structure alone.

joint_ffn=True runs the reference tokens' FFN in one matrix product with the video tokens' (as diffusers' block,
which a2 uses, does) instead of alone (as Stand-In's DiTBlock): a matrix product's rows can round differently with
the number of rows (CPU kernels block them; here the reference rows do), which is the one other residual."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_1d_rotary_pos_embed, get_timestep_embedding
from einops import rearrange


class TheirStandIn:
    """loras: {block index: {"q"|"k"|"v": (down (r, d), up (d, r))}} in Stand-In's LoRALinearLayer layout."""

    def __init__(self, model, loras: dict, wan_numerics: bool, joint_ffn: bool = False):
        self.m, self.loras, self.wan, self.joint_ffn = model, loras, wan_numerics, joint_ffn
        self.heads = model.config.num_attention_heads
        self.dim = self.heads * model.config.attention_head_dim
        head_dim = model.config.attention_head_dim
        self.dims = (head_dim - 2 * (head_dim // 3), head_dim // 3, head_dim // 3)  # their f, h, w split
        n = len(model.blocks)
        self.cond_size = [None] * n  # SelfAttention.cond_size / kv_cache: state of each block across calls
        self.kv_cache = [None] * n

    # -- pieces where original Wan and diffusers round differently
    def sinusoid(self, t):
        if not self.wan:
            return get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
        half = 128
        s = torch.outer(t.double(), torch.pow(10000, -torch.arange(half, dtype=torch.float64).div(half)))
        return torch.cat([torch.cos(s), torch.sin(s)], 1).to(t.dtype)

    def freqs(self, positions):
        """positions: (L, 3) of (f, h, w) -> what rope_apply multiplies by: complex128 (L, 1, head_dim/2), or the
        float32 (cos, sin) of diffusers, each (1, L, 1, head_dim)."""
        parts = []
        for axis, dim in enumerate(self.dims):
            pos = positions[:, axis]
            if self.wan:  # precompute_freqs_cis: 1 / theta^(2i/dim) in float64, polar(1, pos * freq)
                freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2)[: dim // 2].double() / dim))
                angle = torch.outer(pos.double(), freq)
                parts.append(torch.polar(torch.ones_like(angle), angle))
            else:
                parts.append(get_1d_rotary_pos_embed(dim, pos, 10000.0, use_real=True, repeat_interleave_real=True,
                                                     freqs_dtype=torch.float64))
        if self.wan:
            return torch.cat(parts, -1)[:, None]
        return tuple(torch.cat([p[i] for p in parts], -1)[None, :, None] for i in range(2))

    def rope(self, x, freqs):
        x = rearrange(x, "b s (n d) -> b s n d", n=self.heads)
        if self.wan:  # rope_apply
            xc = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:3], -1, 2))
            return torch.view_as_real(xc * freqs).flatten(3).to(x.dtype)
        cos, sin = freqs
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
        out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
        return out

    def rms(self, norm, x):
        if not self.wan:
            return norm(x)
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight

    # -- their modules
    def attn(self, q, k, v):  # flash_attention's SDPA path (no flash-attn package on CPU)
        q, k, v = (rearrange(t, "b s n d -> b n s d") for t in (q, k, v))
        return rearrange(F.scaled_dot_product_attention(q, k, v), "b n s d -> b s (n d)")

    def lora(self, i, which, x):
        down, up = self.loras[i][which]
        return F.linear(F.linear(x.to(down.dtype), down), up).to(x.dtype)

    def self_attn(self, i, a, x, freqs):
        """SelfAttention.forward: uncached split (cond_size set, no cache), cached, or plain."""
        def qkv(x, f, ip):
            q, k, v = a.to_q(x), a.to_k(x), a.to_v(x)
            if ip:
                q, k, v = q + self.lora(i, "q", x), k + self.lora(i, "k", x), v + self.lora(i, "v", x)
            q, k = self.rms(a.norm_q, q), self.rms(a.norm_k, k)
            return self.rope(q, f), self.rope(k, f), rearrange(v, "b s (n d) -> b s n d", n=self.heads)

        n = self.cond_size[i]
        if n is not None and self.kv_cache[i] is None:
            split = lambda f: (f[:-n], f[-n:]) if self.wan else tuple(tuple(t[:, s] for t in f) for s in (  # noqa: E731
                slice(None, -n), slice(-n, None)))
            f_main, f_ip = split(freqs)
            q, k, v = qkv(x[:, :-n], f_main, False)
            qi, ki, vi = qkv(x[:, -n:], f_ip, True)
            self.kv_cache[i] = (ki, vi)
            main = self.attn(q, torch.cat([k, ki], 1), torch.cat([v, vi], 1))
            return a.to_out[0](torch.cat([main, self.attn(qi, ki, vi)], 1))
        q, k, v = qkv(x, freqs, False)
        if n is not None:
            ki, vi = self.kv_cache[i]
            k, v = torch.cat([k, ki], 1), torch.cat([v, vi], 1)
        return a.to_out[0](self.attn(q, k, v))

    def cross_attn(self, a, x, ctx):  # CrossAttention without image input (Stand-In's bases are T2V)
        q, k, v = self.rms(a.norm_q, a.to_q(x)), self.rms(a.norm_k, a.to_k(ctx)), a.to_v(ctx)
        split = lambda t: rearrange(t, "b s (n d) -> b s n d", n=self.heads)  # noqa: E731
        return a.to_out[0](self.attn(split(q), split(k), split(v)))

    def block(self, i, b, x, ctx, t_mod, freqs, x_ip, t_mod_ip):
        """DiTBlock.forward."""
        def ln(norm, x):  # their nn.LayerNorm on float32 activations
            return F.layer_norm(x, (self.dim,), norm.weight, norm.bias, norm.eps)

        mod = (b.scale_shift_table + t_mod).chunk(6, 1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
        input_x = ln(b.norm1, x) * (1 + scale_msa) + shift_msa
        if x_ip is not None:
            mod_ip = (b.scale_shift_table + t_mod_ip).chunk(6, 1)
            input_x_ip = ln(b.norm1, x_ip) * (1 + mod_ip[1]) + mod_ip[0]
            self.cond_size[i] = input_x_ip.shape[1]
            self.kv_cache[i] = None
            input_x = torch.cat([input_x, input_x_ip], 1)
        out = self.self_attn(i, b.attn1, input_x, freqs)
        if x_ip is not None:
            out, out_ip = out[:, :-self.cond_size[i]], out[:, -self.cond_size[i]:]
        x = x + gate_msa * out
        x = x + self.cross_attn(b.attn2, ln(b.norm2, x), ctx)
        h = ln(b.norm3, x) * (1 + scale_mlp) + shift_mlp
        if x_ip is None:
            return x + gate_mlp * b.ffn(h), None
        x_ip = x_ip + mod_ip[2] * out_ip
        h_ip = ln(b.norm3, x_ip) * (1 + mod_ip[4]) + mod_ip[3]
        if self.joint_ffn:
            y, y_ip = b.ffn(torch.cat([h, h_ip], 1)).split([h.shape[1], h_ip.shape[1]], 1)
        else:
            y, y_ip = b.ffn(h), b.ffn(h_ip)
        return x + gate_mlp * y, x_ip + mod_ip[5] * y_ip

    def __call__(self, latents, timestep, text, ip_latent=None):
        """model_fn_wan_video for a T2V model with Stand-In's ip_image (its VAE latent, one frame)."""
        m, ce = self.m, self.m.condition_embedder
        time_embedding = lambda t: ce.time_embedder(self.sinusoid(t))  # noqa: E731
        t = time_embedding(timestep)
        t_mod = ce.time_proj(ce.act_fn(t)).unflatten(1, (6, self.dim))
        t_mod_ip = None
        if ip_latent is not None:
            t_mod_ip = ce.time_proj(ce.act_fn(time_embedding(torch.zeros_like(timestep)))).unflatten(1, (6, self.dim))
        ctx = ce.text_embedder(text)
        x = m.patch_embedding(latents)
        f, h, w = x.shape[2:]
        x = rearrange(x, "b c f h w -> b (f h w) c")
        grid = lambda f0, h0, w0, f, h, w: torch.stack(torch.meshgrid(  # noqa: E731
            torch.arange(f0, f0 + f), torch.arange(h0, h0 + h), torch.arange(w0, w0 + w), indexing="ij"), -1)
        positions = grid(0, 0, 0, f, h, w).reshape(-1, 3)  # offset 1 into tables that start at position -1
        x_ip = None
        if ip_latent is not None:
            x_ip = m.patch_embedding(ip_latent)
            hi, wi = x_ip.shape[3:]
            x_ip = rearrange(x_ip, "b c f h w -> b (f h w) c")
            # freqs[0][0] (position -1), freqs[1][h + 1:], freqs[2][w + 1:]: right of and below the video grid
            positions = torch.cat([positions, grid(-1, h, w, 1, hi, wi).reshape(-1, 3)])
        freqs = self.freqs(positions)
        for i, b in enumerate(m.blocks):
            x, x_ip = self.block(i, b, x, ctx, t_mod, freqs, x_ip, t_mod_ip)
        shift, scale = (m.scale_shift_table + t.unsqueeze(1)).chunk(2, 1)  # Head(x, t): t before the projection
        x = m.proj_out(F.layer_norm(x, (self.dim,), eps=m.norm_out.eps) * (1 + scale) + shift)
        p = m.config.patch_size
        return rearrange(x, "b (f h w) (x y z c) -> b c (f x) (h y) (w z)", f=f, h=h, w=w, x=p[0], y=p[1], z=p[2])


def their_sampling(model_fn, latents, ip_latent, text, negative, sigmas, cfg: float = 5.0):
    """WanVideoPipeline.__call__'s loop for one DiT: the positive pass of the first step gets ip_image (K/V cached),
    every later pass (the negative ones too) runs on the cache; Euler steps between sigmas (FlowMatchScheduler)."""
    for k, sigma in enumerate(sigmas[:-1]):
        t = (sigma * 1000).expand(1)
        posi = model_fn(latents, t, text, ip_latent if k == 0 else None)
        nega = model_fn(latents, t, negative)
        latents = latents + (nega + cfg * (posi - nega)) * (sigmas[k + 1] - sigma)
    return latents


# WanVideoPipeline.__call__ defaults as Stand-In's infer.py calls it: 20 steps (its --num_inference_steps), sigma_shift
# 5, cfg_scale 5, switch_DiT_boundary 0.875 (Wan 2.2 A14B: dit for timesteps >= 875, dit2 below)
STEPS, SHIFT, CFG, BOUNDARY = 20, 5.0, 5.0, 0.875


def flow_match_sigmas(steps: int, shift: float = SHIFT) -> tuple[torch.Tensor, torch.Tensor]:
    """FlowMatchScheduler(shift=5, sigma_min=0.0, extra_one_step=True).set_timesteps(steps, denoising_strength=1,
    shift=shift): float32 torch arithmetic throughout. Returns (sigmas, timesteps = 1000·sigmas)."""
    sigma_min, sigma_max = 0.0, 1.0
    sigma_start = sigma_min + (sigma_max - sigma_min) * 1.0
    sigmas = torch.linspace(sigma_start, sigma_min, steps + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas, sigmas * 1000


@torch.no_grad()
def their_pipeline(dits, vae, ip_image, text, negative, num_frames: int, height: int, width: int, steps: int = STEPS,
                   seed: int = 0, cfg: float = CFG, shift: float = SHIFT, boundary: float = BOUNDARY) -> dict:
    """WanVideoPipeline.__call__(prompt, negative_prompt, seed, ip_image, num_inference_steps) on a T2V model in
    float32 (their torch_dtype): dits = [model_fn] (Wan 2.1) or [dit, dit2] (Wan 2.2 A14B), each a TheirStandIn with
    its own per-block cache; ip_image the PIL image FaceProcessor would return (here any RGB image); text / negative
    the (1, 512, C) prompt states. Returns condition (the reference latent), initial (the noise), latents (the final
    ones) and calls: every model_fn call's (latents, timestep, context, ip_latent or None, dit index)."""
    # encode_ip_image: /255 as float32, cast to the pipeline dtype, *2 - 1, VAE posterior mean, normalised
    x = torch.tensor(np.array(ip_image)).permute(2, 0, 1).float() / 255.0
    x = x.unsqueeze(1).unsqueeze(0).to(dtype=torch.float32) * 2 - 1  # (1, 3, 1, H, W)
    mu = vae.encode(x).latent_dist.mean
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    scale = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    ip = (mu - mean) * scale
    sigmas, timesteps = flow_match_sigmas(steps, shift)
    # WanVideoUnit_NoiseInitializer + generate_noise: a CPU generator (rand_device="cpu"), float32, then the dtype
    shape = (1, 16, (num_frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), device="cpu",
                          dtype=torch.float32).to(torch.float32)
    initial = latents.clone()
    which, ip_arg, calls = 0, ip, []
    for progress_id, timestep in enumerate(timesteps):
        if timestep.item() < boundary * 1000 and len(dits) > 1 and which == 0:
            which, ip_arg = 1, ip  # dit2 gets the reference once: its own cache
        timestep = timestep.unsqueeze(0).to(dtype=torch.float32)
        calls.append((latents, timestep, text, ip_arg, which))
        posi = dits[which](latents, timestep, text, ip_arg)
        ip_arg = None
        if cfg != 1.0:
            calls.append((latents, timestep, negative, None, which))
            nega = dits[which](latents, timestep, negative)
            noise_pred = nega + cfg * (posi - nega)
        else:
            noise_pred = posi
        # FlowMatchScheduler.step(noise_pred, timesteps[progress_id], latents)
        t = timesteps[progress_id]
        timestep_id = torch.argmin((timesteps - t).abs())
        sigma = sigmas[timestep_id]
        sigma_ = 0 if timestep_id + 1 >= len(timesteps) else sigmas[timestep_id + 1]
        latents = latents + noise_pred * (sigma_ - sigma)
    return dict(condition=ip, initial=initial, latents=latents, calls=calls)
