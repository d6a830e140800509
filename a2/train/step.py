"""One training step: the inputs of a micro-batch (every draw keyed by seed, step and sample), its loss, and the
optimizer's update with the EMA of the trained weights (--ema-decay). What train_a2.py's loop, its eval loss, both dry
runs (a2/train/trace.py) and bench.py run, so that what is measured is what trains."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from a2.config.sections import ObjectiveConfig, OptimConfig, ReferencesConfig
from a2.kinds import align
from a2.kinds.align import AUGMENT_STREAM, augment_references
from a2.kinds.conditioning import (
    PosteriorCache,
    drop,
    element_layout,
    encode,
    loss_start,
    model_input,
    num_latent_frames,
    prepare_model,
    video_prediction,
)
from a2.pipeline import encode_prompt, image_tokens
from a2.plan import Run
from a2.train.flow import flow_loss, noisy_latents, sample_generator, sample_sigma, timestep_bucket
from a2.train.runs import NonFiniteSteps


@dataclass
class Encoders:
    """The frozen encoders of a run (None where not loaded: training from the precompute cache) and what the step
    needs of them: the latents' normalisation and the empty prompt of text dropout."""

    vae: object = None
    tokenizer: object = None
    text_encoder: object = None
    image_encoder: object = None
    image_processor: object = None
    latents_config: dict | None = None
    empty_text: torch.Tensor | None = None  # (1, 512, D)
    align_target: tuple | None = None  # --align-loss: the DINOv3 model and its normalisation (a2/kinds/align.py)


@dataclass(frozen=True)
class Process:
    """This process's place in the run (a2/model/parallel.py setup_distributed, data_parallel): its global rank, its
    data-parallel rank (a context-parallel group of ranks shares one sample), its device and autocast."""

    rank: int
    dp_rank: int
    dp_world: int
    device: torch.device
    amp: object = nullcontext()  # torch.autocast on CUDA with --mixed-precision bf16
    ctrl: object = None  # the CPU group a stop is agreed through (None: the default group)
    cp_group: object = None  # this rank's context-parallel group (None: none)


@dataclass
class TrainState:
    """What the loop updates and carries from step to step: the trained model and its optimizer, what checkpoints,
    the eval loss, validation and export read."""

    transformer: torch.nn.Module  # the trained module (sharded with --fsdp)
    model: torch.nn.Module  # what the step's forward runs: DDP(transformer), or the transformer itself
    params: list  # the trainable weights (DTensor shards with --fsdp)
    opt: torch.optim.Optimizer
    guard: NonFiniteSteps
    failures: object  # a2.data.loader.LoadFailures: the samples that failed to load, checkpointed with the run
    last_ckpt: Path | None = None  # the run's newest checkpoint (none is written from non-finite weights)


def h2d(x: torch.Tensor, device) -> torch.Tensor:
    """Host -> device with no host sync: a copy from pinned memory, queued behind the GPU's work (a plain
    .to(device) from pageable memory waits for the GPU to drain). From the cache a step has no host sync."""
    if device.type != "cuda":
        return x
    return (x if x.is_pinned() else x.pin_memory()).to(device, non_blocking=True)


def model_inputs(batch, step: int, j: int, optim: OptimConfig, objective: ObjectiveConfig, references: ReferencesConfig,
                 run: Run, enc: Encoders, rank: int, device) -> dict:
    """Everything the transformer and the loss take for this rank's j-th micro-batch of `step`: x0, noise, sigma,
    the Conditioning (a2/kinds/conditioning.py), text tokens, with text and reference dropout applied. Each sample draws
    from its own generator (a2/train/flow.py: sample_generator): sigma, dropout, noise, then the VAE posteriors, as A2's
    inference orders its draws."""
    cached = "posteriors" in batch
    b, _, _, height, width = batch["video_shape"] if cached else batch["video"].shape
    ks = [(j * run.world + rank) * optim.micro_batch + i for i in range(b)]
    key = step % optim.overfit_batches if optim.overfit_batches else step  # overfit: the same draws every lap
    gens = [sample_generator(optim.seed, key, k) for k in ks]
    drop_text = [torch.rand((), generator=g).item() for g in gens]
    drop_refs = [torch.rand((), generator=g).item() for g in gens]
    drop_text, drop_refs = dropouts(references, drop_text, drop_refs)
    sigmas = h2d(torch.tensor([sample_sigma(objective, g, *run.sigma_range, timestep_bucket(optim.seed, key, k,
                                                                                   objective.timestep_buckets))
                               for g, k in zip(gens, ks)]), device)  # (B,)
    layout = element_layout(run.layout, batch["repeats"])  # the batch's element set (its bucket's)
    with torch.no_grad():
        s = run.info.vae_scale
        noise = h2d(torch.stack([torch.randn(run.info.z_dim, num_latent_frames(layout.num_frames), height // s,
                                             width // s, generator=g) for g in gens]), device)
        # from the cache the pixels are meta tensors: shapes for prepare_latents, no memory, never read
        vae = PosteriorCache(enc.latents_config, [h2d(p, device) for p in batch["posteriors"]]) if cached else enc.vae
        video = torch.empty(batch["video_shape"], device="meta") if cached else h2d(batch["video"], device)
        refs = None
        if layout.takes_references:
            refs = torch.empty(batch["ref_shape"], device="meta") if cached else batch["ref_vae"]
            if references.reference_augment:  # (a2/plan.py: never from the cache) the sample's augmentation stream
                refs = augment_references(refs, [sample_generator(optim.seed, key, k, stream=AUGMENT_STREAM)
                                                 for k in ks])
            refs = refs if cached else h2d(refs, device)
        region = batch.get("region")  # magref: where the element images are on its canvas (B, H, W)
        x0, cond = encode(vae, layout, video, refs, gens, run.encode_mode,
                          None if region is None else h2d(region, device))
        text = (h2d(batch["text"], device) if cached
                else encode_prompt(enc.tokenizer, enc.text_encoder, batch["prompts"]))  # (B, 512, D)
        text = torch.where(h2d(torch.tensor(drop_text), device)[:, None, None], enc.empty_text, text)
        if layout.use_clip:
            cond.image = (h2d(batch["clip"], device) if cached else  # (B, 257·N, D)
                          image_tokens(enc.image_encoder, enc.image_processor, cond, batch["ref_clip"]))
        kept = h2d(torch.tensor([not d for d in drop_refs], dtype=torch.float32), device)  # (B,)
        cond = drop(cond, kept)
        targets = None
        if references.align_loss:  # DINOv3 features of the references the VAE encoded (their grid: the DiT's tokens)
            patch = run.info.patch_size
            _, _, grid = align.reference_spans(layout, (height // s // patch[1], width // s // patch[2]), patch)
            targets = h2d(batch["align"], device) if cached else align.dino_targets(enc.align_target, refs, grid)
    return dict(x0=x0, noise=noise, sigmas=sigmas, cond=cond, text=text,
                tokens=b * layout.tokens(run.info, height, width),
                reference_images=batch.get("ref_vae"), align_targets=targets, layout=layout, references_kept=kept)


def dropouts(references: ReferencesConfig, u_text: list[float], u_refs: list[float]) -> tuple[list[bool], list[bool]]:
    """Which samples drop their prompt and their references, from each sample's two uniform draws: independently
    (--joint-dropout 0: u_text < --text-dropout, u_refs < --reference-dropout), or as exclusive cases of u_text alone
    (RefAlign's): [0, p_text) the prompt, then p_refs the references, then p_joint both."""
    if not references.joint_dropout:
        return [u < references.text_dropout for u in u_text], [u < references.reference_dropout for u in u_refs]
    t, r, j = references.text_dropout, references.reference_dropout, references.joint_dropout
    return [u < t or t + r <= u < t + r + j for u in u_text], [t <= u < t + r + j for u in u_text]


def forward_loss(model, inputs: dict, objective: ObjectiveConfig, references: ReferencesConfig, run: Run, amp,
                 dtype: torch.dtype):
    """The flow-matching loss of one micro-batch (a2/train/flow.py) and the latents visualize() may show."""
    x0, sigmas, cond = inputs["x0"], inputs["sigmas"], inputs["cond"]
    x_t, target = noisy_latents(x0, inputs["noise"], sigmas)
    patch_size = getattr(model, "module", model).config.patch_size
    x_in, timestep = model_input(x_t, cond, sigmas * 1000, patch_size)  # as the sampler builds it
    layout = inputs["layout"]  # the batch's element set (model_inputs')
    prepare_model(getattr(model, "module", model), layout)  # (refalign: this set's reference tokens)
    spans = None
    if references.align_loss:  # where the aligned blocks' outputs hold the references' tokens
        spans = align.reference_spans(layout, (x_t.shape[3] // patch_size[1], x_t.shape[4] // patch_size[2]),
                                      patch_size)[:2]
    with amp, (align.capture(model, spans) if spans else nullcontext()) as features:
        pred = model(hidden_states=x_in.to(dtype), timestep=timestep, encoder_hidden_states=inputs["text"].to(dtype),
                     encoder_hidden_states_image=None if cond.image is None else cond.image.to(dtype),
                     return_dict=False)[0]
    pred = video_prediction(pred, cond)
    loss = flow_loss(pred, target, sigmas, objective.loss_weighting, loss_start(cond, objective.loss_on_references))
    if spans:
        loss = loss + references.align_weight * align.align_loss(features, inputs["align_targets"], sigmas,
                                                          inputs["references_kept"], references.align_gate_floor,
                                                          references.align_gate_power)
    s = sigmas.view(-1, 1, 1, 1, 1)
    viz = dict(input_latents=x0, noisy_latents=x_t, conditioned_latents=x_in, predicted_latents=x_t - s * pred,
               reference_images=inputs["reference_images"])
    return loss, viz


def make_optimizer(optim: OptimConfig, params, device) -> tuple[torch.optim.Optimizer, NonFiniteSteps]:
    """AdamW over the trainable weights and its non-finite guard (fused: a non-finite step is skipped through its
    found_inf, on the device)."""
    opt = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.adam_betas,
                            eps=optim.adam_eps, fused=True)
    return opt, NonFiniteSteps(opt, device)


def optimizer_step(opt, params, guard, step_loss, step: int, optim: OptimConfig, world: int):
    """Clip, step (skipped on the device when the loss or the norm is not finite) and update the EMA. Returns the
    gradient norm before clipping."""
    if world > 1:  # before the step: every rank sees the same loss, so all skip a non-finite step alike
        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)
    guard.before_step(step_loss, grad_norm)  # not finite: this step's update is skipped, on the device
    opt.step()
    if optim.ema_decay:
        update_ema(opt, params, ema_decay(optim.ema_decay, step))
    return grad_norm


# ---------------------------------------------------------------- the EMA of the trained weights (--ema-decay)
# EMA of the trained weights (--ema-decay), kept in the optimizer's state.
#
#     ema <- decay_t * ema + (1 - decay_t) * weights,   decay_t = min(decay, (1 + t) / (10 + t))   after step t
#
# The warm-up (1 + t) / (10 + t) is diffusers' EMAModel rule (the one SimpleTuner and most diffusion trainers use):
# early on, when the weights move fast and an EMA of decay 0.9999 would stay at the initialisation for thousands of
# steps, it follows them closely (t = 0: 0.1, t = 90: 0.91, t = 990: 0.991) and reaches `decay` after about 10 / (1 -
# decay) steps. Each weight's EMA is one more entry, "ema", of its optimizer state, beside AdamW's moments, so it lives
# where they live (the device; with --fsdp a DTensor sharded exactly like its weight), and every checkpoint and resume
# that restores the optimizer restores it (DDP: optimizer.pt; --fsdp: the sharded optimizer state, reshardable), bit for
# bit. It starts at the weights after the weight's first update (AdamW creates a weight's state there): before it a
# weight has not moved, and after it the 0.1 of the first decay would have weighted the initial value, a difference that
# the warm-up forgets within a few steps. A weight that never gets a gradient never moves: it is its own EMA.


def ema_decay(decay: float, step: int) -> float:
    """The decay of the update after optimizer step `step` (0-based): the warm-up of the comment above."""
    return min(decay, (1 + step) / (10 + step))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (the same storage), a tensor itself: the EMA is elementwise, so shards update alone."""
    return t.to_local() if hasattr(t, "to_local") else t


def _tracked(opt: torch.optim.Optimizer, params) -> list[torch.Tensor]:
    """The weights that have optimizer state (have been updated)."""
    return [p for p in params if "step" in opt.state.get(p, {})]


@torch.no_grad()
def update_ema(opt: torch.optim.Optimizer, params, decay: float) -> None:
    """After opt.step(): every updated weight's EMA moves towards it by 1 - decay (one fused foreach kernel)."""
    tracked = _tracked(opt, params)
    for p in tracked:
        if "ema" not in opt.state[p]:
            opt.state[p]["ema"] = p.detach().clone()
    if tracked:
        torch._foreach_lerp_([_local(opt.state[p]["ema"]) for p in tracked], [_local(p.detach()) for p in tracked],
                             1.0 - decay)


@contextmanager
def ema_weights(opt: torch.optim.Optimizer, params, enabled: bool = True):
    """Inside: the weights hold their EMA (validation, export); after: the trained weights again, bit for bit.
    Costs one copy of the updated weights (of this rank's shards) while inside."""
    tracked = [p for p in _tracked(opt, params) if "ema" in opt.state[p]] if enabled else []
    weights = [_local(p.detach()) for p in tracked]
    saved = [w.clone() for w in weights]
    with torch.no_grad():
        if weights:
            torch._foreach_copy_(weights, [_local(opt.state[p]["ema"]) for p in tracked])
    try:
        yield
    finally:
        with torch.no_grad():
            if weights:
                torch._foreach_copy_(weights, saved)
