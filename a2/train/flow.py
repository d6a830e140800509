"""Flow matching, the training objective (kept apart from the loop, as DiT keeps its diffusion code).

    x_t = (1 - sigma) * x0 + sigma * noise,   target = noise - x0,   timestep = 1000 * sigma

The model predicts the velocity `noise - x0`; the sampler (UniPC / Euler in flow mode) integrates it from
sigma = 1 (noise) to 0. Every random draw of a sample comes from its own generator, keyed by
(seed, step, index of the sample in the global batch), so N ranks, gradient accumulation and one process draw
the same numbers, and a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def sample_generator(seed: int, step: int, k: int, device="cpu", stream: int = 0) -> torch.Generator:
    """The generator of the k-th sample of the global batch at `step`: independent of rank and split. A `stream`
    other than 0 is another independent generator of the same sample (reference augmentation: a2/kinds/align.py), so
    an option's draws leave the others' unchanged."""
    s = int(np.random.SeedSequence([seed, step, k] + ([stream] if stream else [])).generate_state(
        1, dtype=np.uint64)[0] >> 1)
    return torch.Generator(device=device).manual_seed(s)


def sigma_cdf(cfg, s: float) -> float:
    """P(sigma <= s) under cfg's sigma distribution (cfg: sigma_sampling, logit_mean/std, sigma_shift)."""
    if s <= 0.0 or s >= 1.0:
        return min(max(s, 0.0), 1.0)
    if cfg.sigma_sampling == "logit_normal_shifted":  # the logit-normal's CDF at the shift's preimage
        s = s / (cfg.sigma_shift - (cfg.sigma_shift - 1) * s)
    if cfg.sigma_sampling.startswith("logit_normal"):
        return 0.5 * (1 + math.erf((math.log(s / (1 - s)) - cfg.logit_mean) / (cfg.logit_std * math.sqrt(2))))
    if cfg.sigma_sampling == "uniform":
        return s
    return s / (cfg.sigma_shift - (cfg.sigma_shift - 1) * s)  # shifted: the inverse of the shift map


def shift_sigma(cfg, s):
    """logit_normal_shifted: the logit-normal draw s moved by the shift map shift·s / (1 + (shift - 1) s) at
    --sigma-shift (Kaleido's RFLoss: its time_shift at exp(mu), config.py rf_shift), computed as theirs in
    the draw's float32; the other distributions as they are. Returns a float."""
    if cfg.sigma_sampling == "logit_normal_shifted":
        s = cfg.sigma_shift * s / (1 + (cfg.sigma_shift - 1) * s)
    return float(s)


def sigma_quantile(cfg, u: float) -> float:
    """The inverse of sigma_cdf: u in [0, 1] -> sigma."""
    if cfg.sigma_sampling.startswith("logit_normal"):
        z = math.sqrt(2) * torch.erfinv(torch.tensor(2 * u - 1, dtype=torch.float64)).item()
        s = 1 / (1 + math.exp(-(cfg.logit_mean + cfg.logit_std * z))) if math.isfinite(z) else float(z > 0)
        return shift_sigma(cfg, s)
    if cfg.sigma_sampling == "uniform":
        return u
    return cfg.sigma_shift * u / (1 + (cfg.sigma_shift - 1) * u)  # shifted


def timestep_bucket(seed: int, step: int, k: int, buckets: int) -> int | None:
    """--timestep-buckets: the bucket (of `buckets` equal-probability ones) of the k-th sample of the global batch at
    `step`, None when off. Samples k = 0..N-1, N..2N-1, ... each take a random permutation of the N buckets, keyed by
    (seed, step, k // N): a global batch of G >= N samples covers every bucket (G < N: G distinct ones), and, being a
    function of the global index, one process, accumulation and N ranks stratify alike."""
    if not buckets:
        return None
    s = int(np.random.SeedSequence([seed, step, k // buckets, buckets]).generate_state(1, dtype=np.uint64)[0] >> 1)
    return int(torch.randperm(buckets, generator=torch.Generator().manual_seed(s))[k % buckets])


def sample_sigma(cfg, g: torch.Generator, lo: float = 0.0, hi: float = 1.0, bucket: int | None = None) -> float:
    """sigma from cfg's distribution; with [lo, hi) narrower than [0, 1] (a Wan 2.2 expert's range) from that
    distribution truncated to the range: one uniform draw between the CDF's values at lo and hi, mapped back
    by the quantile function. The shape inside the range is kept, so the high- and low-noise experts together
    are trained on exactly the configured distribution (rescaling it into each range would not).
    `bucket` b of cfg.timestep_buckets N (timestep_bucket): the uniform draw is confined to [b/N, (b+1)/N) of
    that CDF range, so the sigma lies in the b-th of N equal-probability buckets."""
    if bucket is None and lo <= 0.0 and hi >= 1.0:
        if cfg.sigma_sampling.startswith("logit_normal"):
            return shift_sigma(cfg, torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn((), generator=g)))
        return sigma_quantile(cfg, torch.rand((), generator=g).item())
    a, b = sigma_cdf(cfg, lo), sigma_cdf(cfg, hi)
    u = torch.rand((), generator=g, dtype=torch.float64).item()
    if bucket is not None:
        u = (bucket + u) / cfg.timestep_buckets
    s = sigma_quantile(cfg, a + (b - a) * u)
    # rounding must not cross the boundary: below hi strictly (in float32, the dtype the timestep is made in)
    top = 1.0 if hi >= 1.0 else float(np.nextafter(np.float32(hi), np.float32(0)))
    return min(max(s, lo), top)


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, target) for x0, noise (B, C, T, h, w) and sigmas (B,): the point on the straight line from x0 to the
    noise, and the velocity the model must predict there."""
    s = sigmas.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * noise, noise - x0


def flow_loss(pred: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor, weighting: str = "none",
              first_frame: int = 0) -> torch.Tensor:
    """Mean squared velocity error over latent frames first_frame.. (the prefix layout can leave its reference
    frames out), one value per sample, then the batch mean. cosmap: SD3's weighting 2 / (pi (1 - 2s + 2s^2))."""
    per_sample = (pred.float() - target)[:, :, first_frame:].pow(2).mean(dim=(1, 2, 3, 4))
    if weighting == "cosmap":
        per_sample = per_sample * 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return per_sample.mean()
