"""Elements-to-Video training on Wan / SkyReels-A2: one main(cfg), a hand-written DDP loop.

    python train_a2.py --model tiny --data-root sample_data --max-steps 20          # CPU, built-in tiny model
    python train_a2.py --model /models/Wan2.1-T2V-1.3B-Diffusers --dataset-type t2v --manifest data/train.jsonl
    torchrun --nproc_per_node 8 train_a2.py --model /models/SkyReels-A2 --data-root /data/e2v \
        --elements "subject=_person.png,_mask.png:required,repeat=1" "object=_object.png:repeat=4" \
        "background=_background.png:repeat=4,vae=center_crop"

Everything random in a step (sigma, noise, dropout, VAE posterior) is drawn from a generator seeded by
(seed, step, index of the sample in the global batch), so N ranks, gradient accumulation and one process
compute the same update, and a resumed run continues the same loss curve. The objective is in a2/flow.py,
the conditioning in a2/pipeline.py (prepare_latents, shared with inference).
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a flag typo or a config error answer before the heavy imports below (torch...)
    from a2.cli import exit_on_signal, parse_cli, run_cli
    from config import TrainConfig, dataset_configs

    exit_on_signal("stopped before the first step (the step loop checkpoints on a signal); nothing is lost: run the "
                   "same command again")
    CLI_CONFIG = parse_cli(TrainConfig)
    run_cli(dataset_configs, CLI_CONFIG)  # the flags' and the dataset config's mistakes too (main reads them again)

import itertools
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from a2 import align
from a2.cli import ConfigError, exit_on_signal, run_cli
from a2.conditioning import (
    Layout,
    PosteriorCache,
    element_layout,
    encode,
    lora_target,
    plan,
    vae_scale,
    validation_layout,
)
from a2.dataset_config import check_size
from a2.elements import pair_elements
from a2.ema import ema_load_template, ema_weights
from a2.evaluate import Embedder, evaluate_video, flat_metrics, load_evaluators, named_references
from a2.flow import sigma_cdf, sigma_quantile
from a2.kinds import kind_sampling, model_flow_shift
from a2.lora import base_metadata, make_trainable, model_family
from a2.memory import apply_plan, check_flags, memory_plan, step_shape, use_expandable_segments
from a2.parallel import (
    context_parallel,
    data_parallel,
    gathered,
    grad_scale,
    meta_replica,
    setup_distributed,
    shard_from_rank0,
)
from a2.pipeline import (
    A2Pipeline,
    decode_vae,
    encode_prompt,
    image_tokens,
    load_encoders,
    load_first_frame,
    load_references,
    save_video,
    tensor_to_uint8,
)
from a2.runs import (
    EXIT_RESUMABLE,
    CheckpointError,
    Diverged,
    NonFiniteSteps,
    ResumeError,
    ResumePoint,
    RunLock,
    RunLocked,
    Stopped,
    load_checkpoint,
    params_finite,
    plan_resume,
    record_start,
    save_checkpoint,
    sharded_has_ema,
)
from a2.step import (  # the step: the loop, the eval loss, both dry runs and bench.py run it
    Encoders,
    Run,
    forward_loss,
    make_optimizer,
    model_inputs,
    optimizer_step,
)
from a2.tiny import TINY_MODELS, model_path
from a2.trace import dry_run
from a2.transformer import (
    EXPERTS,
    allow_recompiles,
    detect_model,
    expand_to_e2v,
    expert_sigma_range,
    is_e2v,
    load_transformer,
    save_wan_checkpoint,
)
from config import TrainConfig, dataset_configs, is_tiny, resolve_compile, with_recipe
from data import (
    BucketBatchSampler,
    DatasetError,
    E2VDataset,
    LoaderError,
    LoadFailures,
    WorkerContext,
    cache_key,
    collate,
    held_out,
    ignore_stop_signals,
    kind_datasets,
    next_batch,
    rank_slice,
    stop_signals_blocked,
    stop_workers,
    write_cache,
)

RANK = int(os.environ.get("RANK", 0))
STOP = {"signal": None, "loop": False}  # set by on_signal; the loop checkpoints and exits at the step's end


def log(*args, **kwargs):
    """The one rank-0 print."""
    if RANK == 0:
        tqdm.write(" ".join(str(a) for a in args), **kwargs)


def on_signal(signum, _frame):
    """SIGTERM/SIGINT. In the step loop the first one asks for a checkpoint at the end of the step (the loop reads
    STOP); a second one, or one outside the loop (loading, export, final validation), stops the process at once
    (Stopped), so that a scheduler's stop or a repeated Ctrl-C always ends it."""
    if STOP["loop"] and STOP["signal"] is None:
        STOP["signal"] = signum
    else:
        raise Stopped(signum, "a second signal" if STOP["signal"] else "outside the step loop")


def on_rank0(fn, *args, **kwargs):
    """fn(*args, **kwargs) on rank 0 alone; its result, or the exception it raised, on every rank (a refusal stops
    all ranks)."""
    out = [None]
    if RANK == 0:
        try:
            out = [(True, fn(*args, **kwargs))]
        except Exception as e:  # raised again below, on every rank
            out = [(False, e)]
    if dist.is_initialized():
        dist.broadcast_object_list(out, src=0)
    ok, value = out[0]
    if not ok:
        raise value
    return value


# ---------------------------------------------------------------- the run: what a config derives


def plan_run(cfg: TrainConfig, world: int, ds_cfgs, device) -> Run:
    """All derived settings and every check that needs no data or weights: a bad config fails here, before any
    loading. The precompute cache, which hashes the data, is added by with_cache once the dataset is scanned."""
    h, w = cfg.resolution
    check_size(h, w, cfg.num_frames)
    if cfg.micro_batch < 1 or cfg.grad_accum < 1:
        raise ConfigError("micro_batch and grad_accum must be >= 1")
    check_flags(cfg.memory, cfg.training_type, cfg.fsdp, device)
    vae_cfg = ds_cfgs[0].vae  # every dataset's (config.load_dataset_config): the run's conditioning
    info = detect_model(model_path(cfg.model), cfg.image_encoder and model_path(cfg.image_encoder), cfg.components)
    check_size(h, w, cfg.num_frames, info.spatial_multiple)
    ds_cfgs, elements = kind_datasets(ds_cfgs, info, bool(cfg.elements or cfg.dataset_config))  # none given: the
    # element specs its kind samples with too
    layout = plan(info, elements, vae_cfg, cfg.num_frames, cfg.e2v_type)  # the kind, checked
    if cfg.cache_dir and not layout.cacheable:
        raise ConfigError(f"--cache-dir: the {layout.kind} kind (frame conditioning {layout.frame_conditioning}) "
                          "builds its condition from pixels each step (random frames): train it without a cache")
    if cfg.precompute and not cfg.cache_dir:
        raise ConfigError("--precompute needs --cache-dir")
    check_reference_options(cfg, layout)
    if cfg.val_elements:  # read now, not after training and export
        if layout.images == "none":
            raise ConfigError("--val-elements: this run trains without elements (text only); drop them")
        try:
            if layout.images == "first_frame":  # TI2V-5B image-to-video: the one image is the first frame
                if len(cfg.val_elements) != 1:
                    raise ValueError(f"{info.name} image-to-video takes one image (the first frame), not "
                                     f"{len(cfg.val_elements)}")
                load_first_frame(cfg.val_elements[0], cfg.resolution)
            else:
                items = pair_elements(cfg.val_elements, elements)
                load_references(items, cfg.resolution, (cfg.clip_size,) * 2,
                                validation_layout(layout, tuple(e.repeat for e, _ in items)))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"--val-elements: {e}") from e
    if (cfg.val_elements or cfg.val_every) and not cfg.val_prompt.strip():
        raise ConfigError("--val-prompt is empty: validation videos need a prompt")
    dtype = torch.bfloat16 if device.type == "cuda" and cfg.mixed_precision == "bf16" else torch.float32
    return Run(world, cfg.micro_batch * cfg.grad_accum * world, layout, elements, info, info.subfolder(cfg.expert),
               dtype, expert_sigma_range(cfg.expert, info.boundary_ratio), None,
               resolve_compile(cfg.memory.compile, device.type), bool(cfg.val_elements), cfg.val_every,
               vae_cfg.vae_sample_mode or kind_sampling(layout.kind, info.name).encode_mode)


def check_reference_options(cfg: TrainConfig, layout: Layout) -> None:
    """--align-loss, --reference-augment and the dropouts against the run's kind, before any loading."""
    if not all(0.0 <= p <= 1.0 for p in (cfg.text_dropout, cfg.reference_dropout, cfg.joint_dropout)) or \
            cfg.joint_dropout and cfg.text_dropout + cfg.reference_dropout + cfg.joint_dropout > 1.0:
        raise ConfigError(f"--text-dropout {cfg.text_dropout}, --reference-dropout {cfg.reference_dropout}, "
                          f"--joint-dropout {cfg.joint_dropout}: probabilities in [0, 1], summing to at most 1 with "
                          "--joint-dropout (exclusive cases of one draw)")
    if cfg.vace_lora_target and not layout.context_blocks:
        raise ConfigError(f"--vace-lora-target {cfg.vace_lora_target}: the {layout.kind} kind's model has no VACE "
                          "context blocks; drop it")
    if cfg.reference_dropout and layout.context_blocks:
        raise ConfigError("--reference-dropout: VACE samples with its references in both guidance branches (it drops "
                          "the text alone), so no sample trains without them; drop it")
    if cfg.reference_augment and not layout.takes_references:
        raise ConfigError(f"--reference-augment: the {layout.kind} kind takes no reference images")
    if cfg.reference_augment and cfg.cache_dir:
        raise ConfigError("--reference-augment augments the reference pixels each step; the precompute cache holds "
                          "latents of the images as read: drop --cache-dir (or the augmentation)")
    if not cfg.align_loss:
        return
    if not layout.reference_tokens:
        raise ConfigError(f"--align-loss aligns reference tokens of the sequence (kinds "
                          f"{', '.join(align.aligned_kinds())}); the {layout.kind} kind has none (its references, if "
                          "any, are channels of video tokens)")
    if not cfg.align_model:
        raise ConfigError("--align-loss needs --align-model, a local DINOv3 dir (transformers' DINOv3ViTModel)")
    if cfg.fsdp:
        raise ConfigError("--align-loss is not tried with --fsdp (its projectors are not sharded): use DDP")
    try:
        align.target_dim(cfg.align_model)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def with_cache(cfg: TrainConfig, run: Run, dataset) -> Run:
    """The run with its precompute cache subdir: a hash of everything the encodings depend on (data.cache_key)."""
    if not cfg.cache_dir:
        return run
    encoders = run.info.image_encoder_dir if run.layout.use_clip else None
    cache = Path(cfg.cache_dir) / cache_key(run.info.parts_dir, encoders, dataset, run.layout.clip_frames,
                                            str(run.compute_dtype), run.layout.e2v_type, run.layout.prefix_frames,
                                            run.layout.kind, Path(cfg.align_model) if cfg.align_loss else None)
    if not cfg.precompute and not (cache / "done").exists():
        raise FileNotFoundError(f"{cache}: no precompute cache for this config; run the same command with "
                                "--precompute first")
    return replace(run, cache=cache)


def describe(run: Run) -> str:
    return (f"model {run.info.path}: {run.info.name}, {run.subfolder}/, {run.layout.describe()} | "
            f"{str(run.compute_dtype)[6:]} frozen weights"
            + (f" | sigma in [{run.sigma_range[0]}, {run.sigma_range[1]}]" if run.sigma_range != (0.0, 1.0) else "")
            + f" | blocks {'compiled' if run.compile else 'eager'}")


# ---------------------------------------------------------------- data position


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then constant or cosine to 0 at max_steps (step counts from 0)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "cosine":
        p = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))
    return cfg.lr


def global_batches(sampler, start: int, overfit: int = 0):
    """Endless global batches (epoch after epoch), from the `start`-th on: the data position is the step.
    With `overfit` > 0 the first `overfit` batches of epoch 0 repeat forever."""
    if overfit:
        sampler.set_epoch(0)
        first = [b for _, b in zip(range(overfit), sampler)]
        for n in itertools.count(start):
            yield n, first[n % len(first)]
    n, epoch = 0, 0
    while True:
        sampler.set_epoch(epoch)
        for batch in sampler:
            if n >= start:
                yield n, batch
            n += 1
        epoch += 1


class RankMicroBatches:
    """batch_sampler for the DataLoader: this rank's `accum` micro-batches of each global batch."""

    def __init__(self, sampler, start, rank, world, micro, accum, overfit=0):
        self.args = (sampler, start, rank, world, micro, accum, overfit)

    def __iter__(self):
        sampler, start, rank, world, micro, accum, overfit = self.args
        for _, batch in global_batches(sampler, start, overfit):
            yield from rank_slice(batch, rank, world, micro, accum)


# ---------------------------------------------------------------- models


def load_run_encoders(cfg: TrainConfig, run: Run, device, needed: bool) -> Encoders:
    enc = Encoders()
    if needed:
        parts = load_encoders(run.info.parts_dir, run.info.image_encoder_dir if run.layout.image_branch else None,
                              run.compute_dtype)
        enc = Encoders(*parts)
        for m in (enc.vae, enc.text_encoder, enc.image_encoder):
            if m is not None:
                m.to(device)
    if run.cache is not None and not cfg.precompute:
        meta = torch.load(run.cache / "meta.pt", weights_only=True)
        enc.latents_config, enc.empty_text = meta["latents_config"], meta["empty_text"].to(device)
    elif needed:
        enc.latents_config = dict(latents_mean=list(enc.vae.config.latents_mean),
                                  latents_std=list(enc.vae.config.latents_std), scale_factor_spatial=vae_scale(enc.vae))
        enc.empty_text = encode_prompt(enc.tokenizer, enc.text_encoder, [""]).to(device)  # the CFG-dropout prompt
    if cfg.align_loss and (run.cache is None or cfg.precompute):  # else the cache holds the targets
        enc.align_target = align.load_target_model(cfg.align_model, device)
    return enc


def build_transformer(cfg: TrainConfig, run: Run, rank: int):
    """The transformer to train: loaded (a LoRA's frozen weights in the compute dtype; norms and time embedding stay
    fp32, as diffusers loads them), expanded (a T2V base), made trainable (make_trainable). --fsdp: rank 0 alone
    reads the weights; every rank gets a meta-device replica made trainable alike, and rank 0 also the weights to
    broadcast once it is sharded (a2/parallel.py shard_from_rank0). Returns (transformer, rank 0's weights or
    None)."""
    torch.manual_seed(cfg.seed)  # LoRA's A matrices (and an expansion's new weights) start from this seed
    transformer = None
    if rank == 0 or not cfg.fsdp:
        frozen = cfg.training_type == "lora"  # (a LoRA's expansion weights are made fp32 by make_trainable)
        transformer = load_transformer(run.info.path, run.compute_dtype if frozen else torch.float32, run.subfolder)
        if run.layout.expand:
            log("expanding the T2V transformer to the E2V inputs (output unchanged at init)")
            transformer = expand_to_e2v(transformer, image_dim=run.info.image_encoder_dim if run.layout.image_branch
                                        else None, seed=cfg.seed)
        assert is_e2v(transformer) or not run.layout.channel
        prepare_trainable(transformer, cfg, run)
    if not cfg.fsdp:
        return transformer, None
    return meta_replica(transformer, lambda model: prepare_trainable(model, cfg, run))


def prepare_trainable(transformer, cfg: TrainConfig, run: Run):
    """What the run trains of `transformer`, in place (a2/lora.py make_trainable; --align-loss: its projectors, a
    trainable fp32 submodule: optimised, reduced, checkpointed, planned, never exported), in training mode."""
    try:
        make_trainable(transformer, run.layout, cfg.training_type, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                       lora_target(run.layout, cfg.lora_target, cfg.vace_lora_target))  # VACE: its context blocks
    except ValueError as e:  # a --lora-target with no original-Wan name
        raise ConfigError(f"--lora-target {cfg.lora_target!r}: {e}") from None
    if cfg.align_loss:
        try:
            align.install(transformer, align.target_dim(cfg.align_model), cfg.align_blocks, seed=cfg.seed)
        except ValueError as e:  # a block the model lacks
            raise ConfigError(str(e)) from None
    return transformer.train()


# ---------------------------------------------------------------- one step: model inputs, loss


# ---------------------------------------------------------------- precompute, validation, visualisation


def precompute(run: Run, dataset, enc: Encoders, rank: int, world: int) -> None:
    """Encode every sample into run.cache (sharded over ranks, resumable): VAE posteriors (recorded, no draw), T5
    trimmed to its tokens, CLIP tokens; rank 0 adds the empty prompt and the latents' normalisation."""
    def encode_batch(batch):
        rec = PosteriorCache(dict(enc.vae.config), vae=enc.vae)
        with torch.no_grad():
            video, refs, region = batch["video"].to(enc.vae.device), batch.get("ref_vae"), batch.get("region")
            layout = element_layout(run.layout, batch["repeats"])  # the sample's own element set
            _, cond = encode(rec, layout, video, None if refs is None else refs.to(enc.vae.device), None, "argmax",
                             region)
            text = encode_prompt(enc.tokenizer, enc.text_encoder, batch["prompts"])[0]  # (512, D), zeros after tokens
            clip = image_tokens(enc.image_encoder, enc.image_processor, cond, batch["ref_clip"])[0] \
                if run.layout.use_clip else None
            targets = None
            if enc.align_target is not None:  # --align-loss: the DINOv3 targets, once per reference
                patch, s = run.info.patch_size, run.info.vae_scale
                _, _, grid = align.reference_spans(layout, (video.shape[3] // s // patch[1],
                                                            video.shape[4] // s // patch[2]), patch)
                targets = align.dino_targets(enc.align_target, refs, grid)[0].cpu()  # (N, L, D)
        n = int(text.abs().sum(-1).nonzero().max()) + 1 if text.abs().sum() > 0 else 0
        return dict(prompt=batch["prompts"][0], posteriors=[p[0].cpu() for p in rec.posteriors],
                    text=text[:n].cpu(), clip=None if clip is None else clip.cpu(),
                    region=None if region is None else region[0], align=targets)

    write_cache(run.cache, dataset, encode_batch, rank, world)
    if world > 1:
        dist.barrier()
    if rank == 0:
        torch.save(dict(empty_text=encode_prompt(enc.tokenizer, enc.text_encoder, [""]).cpu(),
                        latents_config=dict(latents_mean=list(enc.vae.config.latents_mean),
                                            latents_std=list(enc.vae.config.latents_std),
                                            scale_factor_spatial=vae_scale(enc.vae))), run.cache / "meta.pt")
        (run.cache / "done").write_text(f"{len(dataset)} samples\n")
        log(f"precomputed {len(dataset)} samples into {run.cache}")


def validate(step: int, cfg: TrainConfig, run: Run, transformer, enc: Encoders, run_dir: Path, frozen: dict,
             rank: int, device, amp, evaluators=None) -> dict | None:
    """A validation video from --val-elements and --val-prompt (text alone for T2V) into run_dir/samples/.
    Wan 2.2: the other (frozen) expert is loaded at the first validation into `frozen` and waits in host memory
    between validations (on the GPU it would add a whole model to every step). With `evaluators` (rank 0), returns
    the video's metrics (a2/evaluate.py) as a metrics.jsonl record: step, val/<metric>."""
    if not run.validates or (rank >= cfg.context_parallel and not cfg.fsdp):  # FSDP, CP: all its ranks forward
        return None
    h, w = cfg.resolution
    refs = clips = region = first_frame = None
    items = []
    if run.layout.images == "first_frame":  # TI2V-5B image-to-video (plan_run checked: one image)
        first_frame = load_first_frame(cfg.val_elements[0], (h, w))
    elif cfg.val_elements:
        items = pair_elements(cfg.val_elements, run.elements)
    layout = validation_layout(run.layout, tuple(e.repeat for e, _ in items))  # any element set the kind takes
    if items:
        refs, clips, _, region = load_references(items, (h, w), (cfg.clip_size, cfg.clip_size), layout)
    transformer.eval()
    experts = {}
    high = transformer
    if run.info.two_experts:
        if "other" not in frozen:
            other = "low" if cfg.expert == "high" else "high"
            frozen["other"] = load_transformer(run.info.path, run.compute_dtype, EXPERTS[other]).eval()
        frozen["other"].to(device)
        high, low = (transformer, frozen["other"]) if cfg.expert == "high" else (frozen["other"], transformer)
        experts = dict(transformer_2=low, boundary_ratio=run.info.boundary_ratio)
    pipe = A2Pipeline(high, enc.vae, enc.tokenizer, enc.text_encoder, enc.image_encoder, enc.image_processor,
                      **experts, expand_timesteps=run.info.ti2v, model=run.info.name, info=run.info,
                      flow_shift=model_flow_shift(run.info.parts_dir))
    with amp:  # the flags the user set; A2Pipeline fills the rest with the kind's own, as for infer.py
        out = pipe(cfg.val_prompt, refs, clips, layout=layout, height=h, width=w, num_inference_steps=cfg.val_steps,
                   guidance_scale=cfg.val_guidance_scale, flow_shift=cfg.val_flow_shift, first_frame=first_frame,
                   region=region, sample_mode=run.encode_mode, progress=False)
    transformer.train()
    if "other" in frozen:
        frozen["other"].to("cpu")
    if rank == 0:
        path = save_video(run_dir / "samples" / f"step-{step:07d}.mp4", out["video"][0], out["sampling"].fps,
                          None if refs is None else refs[0])
        log(f"validation video: {path}")
    if evaluators is None or rank != 0:
        return None
    result = evaluate_video(out["video"][0], named_references(items, clips), cfg.val_prompt, evaluators,
                            cfg.eval.faces, cfg.eval.max_frames)
    return dict(step=step, **flat_metrics(result, "val/"))


def load_val_evaluators(cfg: TrainConfig, run: Run, enc: Encoders, rank: int, device):
    """The metric encoders of the validation videos (--val-metrics, rank 0), loaded before training so that a bad
    --eval.* dir fails first. CLIP-I uses the run's own image encoder when it has one."""
    if not cfg.val_metrics or rank != 0 or not run.validates:
        return None
    clip = None
    if enc.image_encoder is not None:
        clip = Embedder(enc.image_encoder, enc.image_processor, device, next(enc.image_encoder.parameters()).dtype)
    return load_evaluators(cfg.eval, run.info.image_encoder_dir, device, run.compute_dtype, clip=clip)


EVAL_KEY = 2**62  # the step key of the eval loss's draws (noise, posterior samples): no training step has it


def check_extra_options(cfg: TrainConfig) -> None:
    """--ema-decay, the eval loss and --timestep-buckets, checked before any data or weights load."""
    if not 0.0 <= cfg.ema_decay < 1.0:
        raise ConfigError(f"--ema-decay {cfg.ema_decay}: a decay in [0, 1) (0: no EMA), e.g. 0.999")
    if cfg.eval_split < 0 or cfg.eval_every < 0 or cfg.eval_quantiles < 1 or cfg.timestep_buckets < 0:
        raise ConfigError(f"--eval-split {cfg.eval_split}, --eval-every {cfg.eval_every}, --timestep-buckets "
                          f"{cfg.timestep_buckets} must be >= 0 and --eval-quantiles {cfg.eval_quantiles} >= 1")


def eval_sigmas(cfg: TrainConfig, run: Run) -> list[float]:
    """The eval loss's sigmas: the quantiles (i + 1) / (n + 1), i < n = --eval-quantiles, of the --sigma-sampling
    distribution, truncated to the run's sigma range (a Wan 2.2 expert's) as training draws it."""
    a, b = sigma_cdf(cfg, run.sigma_range[0]), sigma_cdf(cfg, run.sigma_range[1])
    n = cfg.eval_quantiles
    return [sigma_quantile(cfg, a + (b - a) * (i + 1) / (n + 1)) for i in range(n)]


@torch.no_grad()
def eval_loss(step: int, cfg: TrainConfig, run: Run, transformer, enc: Encoders, dataset, held: list[int], rank: int,
              world: int, device, amp, prefix: str = "eval/") -> dict:
    """The loss of the held-out samples at eval_sigmas, as a metrics.jsonl record: <prefix>loss (the mean) and
    <prefix>loss@<sigma>. Each sample is the training step's model_inputs (its n-th sample of a one-sample batch at the
    fixed step key EVAL_KEY, dropout off: the same noise and posterior draws at every eval) and forward_loss with the
    sigmas replaced; the noise is shared by all sigmas. Samples n = rank, rank + world, ... per rank (--fsdp: every
    rank runs as many forwards, the extra ones discarded); each (sample, sigma) loss is computed by one rank and summed
    with zeros from the others, so the result is the same bit for bit at any world size."""
    sigmas = eval_sigmas(cfg, run)
    fixed = replace(cfg, micro_batch=1, text_dropout=0.0, reference_dropout=0.0, joint_dropout=0.0, overfit_batches=0,
                    timestep_buckets=0, reference_augment=False, align_loss=False)  # the flow loss alone
    one = replace(run, world=1)
    per = torch.zeros(len(held), len(sigmas), device=device)  # (N, Q)
    transformer.eval()  # (LoRA dropout)
    for n in range(rank, -(-len(held) // world) * world, world):
        if n >= len(held) and not cfg.fsdp:
            break
        k = min(n, len(held) - 1)
        batch = collate([dataset[(held[k], 0)]])
        if "failed" in batch:
            raise DatasetError(f"eval loss at step {step}: {batch['failed'][0][1]}")
        inputs = model_inputs(batch, EVAL_KEY, k, fixed, one, enc, 0, device)
        for q, sigma in enumerate(sigmas):
            loss, _ = forward_loss(transformer, {**inputs, "sigmas": torch.full_like(inputs["sigmas"], sigma)}, fixed,
                                   one, amp, transformer.dtype)
            if n < len(held):
                per[n, q] = loss
    transformer.train()
    split = getattr(transformer, "context_parallel", None)
    if split is not None and split.rank and world > 1:
        per.zero_()  # a context-parallel group computed each of its samples on every rank: one of them counts it
    if world > 1:
        dist.all_reduce(per)
    means = per.mean(0).tolist()
    return dict(step=step, **{f"{prefix}loss": sum(means) / len(means)},
                **{f"{prefix}loss@{s:.3f}": v for s, v in zip(sigmas, means)})


def evaluate_held_out(step: int, cfg: TrainConfig, run: Run, transformer, opt, params, enc: Encoders, dataset,
                      held: list[int], rank: int, world: int, device, amp) -> dict:
    """eval_loss of the trained weights (eval/...) and, with --ema-decay, of their EMA (eval_ema/...), announced and
    timed (the progress bar stops meanwhile)."""
    log(f"step {step}: eval loss of {len(held)} held-out sample(s) ...")
    t0 = time.perf_counter()
    rec = eval_loss(step, cfg, run, transformer, enc, dataset, held, rank, world, device, amp)
    if cfg.ema_decay:
        with ema_weights(opt, params):
            rec.update(eval_loss(step, cfg, run, transformer, enc, dataset, held, rank, world, device, amp,
                                 "eval_ema/"))
    log(f"step {step}: eval loss {rec['eval/loss']:.4f} ({time.perf_counter() - t0:.1f} s)")
    return rec


def visualize(step: int, viz: dict, vis, vae, run_dir: Path) -> None:
    """The dataset config's visualization processors: latents saved as .pt, or decoded to PNG frames."""
    if not vis.enabled or step % vis.frequency:
        return
    out = Path(vis.output_dir.format(run_id=run_dir.name))
    out = out if out.is_absolute() else run_dir / out
    out.mkdir(parents=True, exist_ok=True)
    for proc in vis.processors:
        for key in proc.get("data", []):
            x = viz.get(key)
            if x is None:
                continue
            if proc["type"] == "latent_save" or key == "reference_images":
                torch.save(x.detach().cpu(), out / f"step{step:07d}_{key}.pt")
            elif proc["type"] == "vae_decode":
                with torch.no_grad():
                    frames = decode_vae(vae, x[:, :vae.config.z_dim].detach().float())[0]  # (3, F, H, W)
                from PIL import Image

                for fi in proc.get("frames", [0, -1]):
                    Image.fromarray(tensor_to_uint8(frames[:, fi])).save(out / f"step{step:07d}_{key}_f{fi}.png")


# ---------------------------------------------------------------- samples that fail to load mid-run


def skip_step(step: int, failures: LoadFailures, cfg: TrainConfig, run_dir: Path, transformer, opt, rank: int,
              world: int) -> None:
    """A step whose global batch holds a sample that failed to load (on any rank: LoadFailures.refuses) makes no
    update. With --skip-bad-samples the sample is dropped and the run goes on; without, the state before this step
    is checkpointed and the run stops with one line (--resume auto redoes the step)."""
    for line in failures.skip_step(step + 1):
        log(line)
    if not cfg.skip_bad_samples:
        opt.zero_grad(set_to_none=True)  # the checkpoint holds the optimizer, not the step's partial gradients
        checkpoint(run_dir, step, transformer, opt, cfg, failures)
        raise DatasetError(failures.stop_message(step + 1))


# ---------------------------------------------------------------- checkpoints, export


def checkpoint(run_dir: Path, step: int, transformer, opt, cfg: TrainConfig, failures: LoadFailures) -> Path:
    """Write ckpt-<step> (a2/runs.py: save_checkpoint), on every rank alike: DDP's rank 0 writes it and the others
    wait for it, and a write that fails (CheckpointError: a full disk) stops every rank, not rank 0 alone."""
    def save():
        path = save_checkpoint(run_dir, step, transformer, opt, asdict(cfg), cfg.keep_last, failures.state_dict(),
                               cfg.fsdp)
        log(f"checkpoint {path}")
        return path

    return save() if cfg.fsdp else on_rank0(save)


def export_weights(run_dir: Path, model, cfg: TrainConfig, tag: str = "", metadata: dict | None = None,
                   original_keys: str | None = None) -> Path:
    """LoRA -> pytorch_lora_weights.safetensors (diffusers format, load_lora_weights reads it) and
    pytorch_lora_weights_comfy.safetensors (original Wan keys: ComfyUI), see a2/lora.py;
    full fine-tune -> a save_pretrained transformer dir, and the same weights as one bf16 file in original Wan keys,
    transformer_comfy.safetensors (ComfyUI, Wan's code). `model`: unsharded (--fsdp: a2/parallel.py gathered's).
    A Wan 2.2 expert's export names it: pytorch_lora_weights_high|low*.safetensors (keys `transformer.*`, as
    diffusers writes both; `load_lora_weights(..., load_into_transformer_2=True)` puts the low one on its expert),
    or transformer/ (high) | transformer_2/ (low), the subfolder it replaces in the model dir.
    `tag` ends the names (_ema: the EMA weights, export_ema). original_keys (a full fine-tune of an original-key
    checkpoint: its kind's Layout.original_export, Phantom-Wan.pth or RefAlign's refalign_model.safetensors): also
    transformer_original/<original_keys>, the weights in original-Wan keys as Phantom's own code
    loads them (torch.load), with the Wan config.json a2 reads them back with."""
    if cfg.training_type == "lora":
        from a2 import standin
        from a2.lora import export_lora

        if standin.installed(getattr(model, "module", model)):  # Stand-In's file, its keys (their loader reads it)
            return standin.export_lora(run_dir, getattr(model, "module", model),
                                       (f"_{cfg.expert}" if cfg.expert else "") + tag, metadata)
        with align.without_projectors(model) as bare:  # (trainable, not LoRA: e2v_weights would take them)
            return export_lora(run_dir, bare, cfg.expert, tag, metadata)[0]
    out = run_dir / ((EXPERTS[cfg.expert] if cfg.expert else "transformer") + tag)
    with align.without_projectors(model) as model:  # the alignment loss's projectors are no part of the model
        model.save_pretrained(out)
        comfy = save_wan_checkpoint(model.state_dict(), out.with_name(f"{out.name}_comfy.safetensors"))
        log(f"full model for ComfyUI (Load Diffusion Model) and Wan's own code, bf16 in original Wan keys: {comfy}")
        if original_keys:
            from a2.transformer import diffusers_to_original, original_wan_config

            original = run_dir / "transformer_original"
            original.mkdir(exist_ok=True)
            (original / "config.json").write_text(json.dumps(original_wan_config(model.config), indent=2))
            sd = {k: v.detach().cpu().contiguous() for k, v in diffusers_to_original(model.state_dict()).items()}
            if original_keys.endswith(".safetensors"):  # (RefAlign's pipeline reads safetensors)
                from safetensors.torch import save_file

                save_file(sd, original / original_keys)
            else:
                torch.save(sd, original / original_keys)
    return out


def export_ema(run_dir: Path, transformer, opt, params, cfg: TrainConfig, run: Run, rank: int,
               metadata: dict | None = None) -> Path | None:
    """--ema-decay: the EMA weights exported beside the trained ones (rank 0; --fsdp: gathered, a collective):
    pytorch_lora_weights_ema.safetensors (+ _ema_comfy, e2v_weights_ema) or transformer_ema/."""
    with ema_weights(opt, params):
        model = unsharded(transformer, cfg, run)
        return export_weights(run_dir, model, cfg, tag="_ema", metadata=metadata) if rank == 0 else None


def unsharded(transformer, cfg: TrainConfig, run: Run):
    """The transformer to export: itself, or --fsdp on rank 0 a plain model of the gathered trained weights (a LoRA's
    adapter alone), None on the other ranks (a collective on every rank)."""
    if not cfg.fsdp:
        return transformer
    return gathered(transformer, lambda model: prepare_trainable(model, cfg, run), cfg.training_type == "lora")


def open_run_dir(run_dir: Path, lock: RunLock, cfg: TrainConfig, run: Run, point: ResumePoint) -> None:
    """Create and lock the run dir; config.json (once per run, then a `resumes` entry per resume), metrics.jsonl cut
    back to the resumed step, run.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if lock.fd is None:
        lock.acquire()
    record_start(run_dir, asdict(cfg), point, run.world)
    (run_dir / "run.json").write_text(json.dumps(asdict(run), indent=2, default=str))


def lock_existing(run_dir: Path, lock: RunLock) -> None:
    """An existing run dir is locked at once: one in use by another run fails here, naming its holder."""
    if run_dir.is_dir():
        lock.acquire()


def place_transformer(cfg: TrainConfig, run: Run, rank: int, device, shapes: int, cp_group=None):
    """build_transformer, sharded with --fsdp, its sequence split over `cp_group` (context parallel), then put in
    place by the memory plan (fp8, swapped blocks, the rest on `device`, recomputation, compilation for `shapes` input
    shapes), decided before the weights move: where they go is part of it."""
    transformer, rank0_weights = build_transformer(cfg, run, rank)
    if cfg.fsdp:
        shard_from_rank0(transformer, rank0_weights, device, run.compute_dtype)  # bf16 compute on CUDA
        del rank0_weights
    if cp_group is not None:  # before the plan wraps the blocks' forward (the split hooks are the blocks')
        context_parallel(transformer, cp_group)
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M params, "
        f"{sum(p.numel() for p in transformer.parameters() if p.requires_grad) / 1e6:.3f}M trainable "
        f"({cfg.training_type}{', FSDP2' if cfg.fsdp else ''})")
    # decided before the weights move to the GPU (a2/memory.py), for a rank's share of the tokens
    plan = memory_plan(cfg.memory, transformer, step_shape(run.layout, run.info, cfg.resolution, cfg.micro_batch,
                                                            cfg.context_parallel),
                       cfg.training_type == "full", cfg.fsdp, device, run.compile, ema=cfg.ema_decay > 0)
    log(f"memory: {plan}")
    if run.compile:
        allow_recompiles(shapes)
    for line in apply_plan(transformer, plan, device, run.compile, cfg.memory.fp8_matmul):  # fp8, swap, to(device),
        log(line)  # blocks
    if cfg.memory.attention_backend:
        transformer.set_attention_backend(cfg.memory.attention_backend)
    return transformer


def make_loader(dataset, sampler, start_step: int, rank: int, world: int, cfg: TrainConfig, use_cuda: bool):
    """This rank's micro-batches from `start_step` on (the data position is the step)."""
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=RankMicroBatches(sampler, start_step, rank, world, cfg.micro_batch, cfg.grad_accum,
                                                cfg.overfit_batches),
        collate_fn=collate, num_workers=cfg.num_workers, pin_memory=use_cuda, persistent_workers=cfg.num_workers > 0,
        # forked workers of a process that runs CUDA and OpenMP threads can hang (seen on an H100); spawned cannot
        multiprocessing_context=WorkerContext() if cfg.num_workers > 0 else None,
        worker_init_fn=ignore_stop_signals if cfg.num_workers > 0 else None)  # SIGTERM/SIGINT are the loop's


def open_metrics(run_dir: Path, cfg: TrainConfig, rank: int):
    """Rank 0's metrics.jsonl (appended to: a resume continues it) and tensorboard writer."""
    if rank != 0:
        return None, None
    tb = None
    if cfg.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(run_dir / "tb")
    return open(run_dir / "metrics.jsonl", "a"), tb


def step_record(done: int, step_loss, grad_norm, opt, guard: NonFiniteSteps, cfg: TrainConfig, last_ckpt,
                meter: dict, use_cuda: bool) -> dict:
    """The metrics.jsonl record of step `done` (its loss read here: the step's only host sync), with throughput since
    the last record (`meter` restarts). Raises Diverged after too many non-finite steps."""
    value = step_loss.item()
    _, skipped = guard.check(done, cfg.max_nonfinite_steps, last_ckpt)
    dt = time.time() - meter["t0"]
    rec = dict(step=done, loss=value, lr=opt.param_groups[0]["lr"], grad_norm=float(grad_norm), skipped_steps=skipped,
               s_per_step=dt / (done - meter["logged"]), samples_per_s=meter["seen"] / dt,
               tokens_per_s=meter["tokens"] / dt,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if use_cuda else None)
    meter.update(t0=time.time(), seen=0, tokens=0, logged=done)
    return rec


def stop_agreed(world: int, ctrl) -> bool:
    """Whether a stop signal reached any rank (agreed through the CPU group, so that all stop at the same step)."""
    interrupted = STOP["signal"] is not None
    if world > 1:
        flag = torch.tensor([float(interrupted)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctrl)
        interrupted = bool(flag.item())
    return interrupted


def checkpoint_if_due(done: int, interrupted: bool, cfg: TrainConfig, guard: NonFiniteSteps, params, last_ckpt,
                      run_dir: Path, transformer, opt, failures: LoadFailures, world: int):
    """The checkpoint decision after step `done`: every --ckpt-every steps, at the end and on a stop; never of
    non-finite weights (Diverged, naming the last good one), and postponed amid skipped non-finite steps so that it
    pushes out no earlier checkpoint. Returns the run's newest checkpoint."""
    if not (done % cfg.ckpt_every == 0 or done == cfg.max_steps or interrupted):
        return last_ckpt
    streak, _ = guard.check(done, cfg.max_nonfinite_steps, last_ckpt)
    finite = torch.tensor([float(params_finite(params))])
    if cfg.fsdp and world > 1:  # each rank checked its shards
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise Diverged(f"step {done}: weights not finite, not checkpointed; the last checkpoint with finite weights: "
                       f"{last_ckpt or 'none'}")
    if streak and not interrupted and done != cfg.max_steps:
        log(f"step {done} was not finite: checkpoint postponed")
        return last_ckpt
    return checkpoint(run_dir, done, transformer, opt, cfg, failures)


def export(run_dir: Path, model, transformer, opt, params, cfg: TrainConfig, run: Run, rank: int) -> dict:
    """The trained weights (and with --ema-decay their EMA) exported from rank 0 (--fsdp: gathered first, a
    collective on every rank), each LoRA file with its base's metadata; a full fine-tune of a lab's original-key
    checkpoint (Phantom-Wan, RefAlign) also in those keys."""
    original_keys = run.layout.original_export if run.info.original_weights else None
    metadata = base_metadata(transformer.config, model_family(run.info), run.layout.kind, cfg.model)
    out, trained = {}, unsharded(transformer, cfg, run)
    if rank == 0:
        out["weights"] = export_weights(run_dir, trained, cfg, original_keys=original_keys, metadata=metadata)
        log(f"exported {out['weights']}")
    del trained
    if cfg.ema_decay:
        out["ema_weights"] = export_ema(run_dir, transformer, opt, params, cfg, run, rank, metadata)
        log(f"exported the EMA weights {out['ema_weights']}")
    return out


def log_step(rec: dict | None, metrics_file, tb) -> None:
    """A metrics.jsonl record (and tensorboard scalars); None (nothing to log) is skipped."""
    if rec is None:
        return
    if metrics_file:
        metrics_file.write(json.dumps(rec) + "\n")
        metrics_file.flush()
    if tb:
        for k, v in rec.items():
            if v is not None and k != "step":
                tb.add_scalar(k, v, rec["step"])


# ---------------------------------------------------------------- main


def optimizer_and_resume(cfg: TrainConfig, params, transformer, dataset, point, device):
    """AdamW over the trainable weights, its non-finite guard and the run's load-failure bookkeeping, restored from
    the checkpoint when resuming (what changed in the dataset since, said by path). Returns (opt, guard, failures,
    start_step)."""
    opt, guard = make_optimizer(cfg, params, device)
    failures = LoadFailures(cfg.skip_bad_samples, [f"{s.video} ({s.id})" for s in dataset.samples],  # (data.py)
                            dataset.stamp)
    if point.path and cfg.fsdp and cfg.ema_decay and sharded_has_ema(point.path):
        ema_load_template(opt, params)  # a sharded checkpoint loads into the optimizer state entries that exist
    if not point.path:
        return opt, guard, failures, 0
    state = load_checkpoint(point.path, transformer, opt, cfg.fsdp)
    for line in failures.load_state_dict(state.get("load_failures", failures.state_dict())):
        log(line)  # whether the dataset changed since the checkpoint; the dropped samples, by path
    log(f"resumed from {point.path} at step {state['step']}")
    return opt, guard, failures, state["step"]


def main(cfg: TrainConfig) -> dict:
    cfg, recipe = with_recipe(cfg)  # what the flags left out, from the model's recipe (config.RECIPES), said below
    # ---------------------------------------------------------------- distributed setup
    if cfg.model in TINY_MODELS:  # built on each node's disk before the process group exists (transformers writes
        # weights on global rank 0 alone once it does); its file lock lets the node's first rank build it
        model_path(cfg.model)
    global RANK
    use_expandable_segments()  # before CUDA initialises
    world, RANK, local_rank, device, ctrl = setup_distributed(cfg.device, cfg.fsdp and not cfg.memory.dry_run)
    rank = RANK
    # context parallel: a group of ranks shares each sample (a2/parallel.py); data and batch count dp ranks only
    dp_rank, dp_world, cp_group = data_parallel(world, rank, 1 if cfg.memory.dry_run else cfg.context_parallel,
                                                device.type)
    use_cuda = device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda and cfg.mixed_precision == "bf16" else nullcontext()

    # ---------------------------------------------------------------- the run's settings (no data or weights yet)
    ds_cfgs = dataset_configs(cfg)
    run = plan_run(cfg, dp_world, ds_cfgs, device)  # a bad config fails here, before the data is scanned
    ds_cfgs = kind_datasets(ds_cfgs, run.info, bool(cfg.elements or cfg.dataset_config))[0]  # as planned
    check_extra_options(cfg)
    if cfg.memory.dry_run:  # one rank's step traced at real size (a2/trace.py); the harness shards with --fsdp
        result = dry_run(cfg, run, lambda run: build_transformer(replace(cfg, fsdp=False), run, 0)[0], log=log)
        if not result["fits"]:
            sys.exit(3)
        return result
    run_dir = Path(cfg.output_dir) / (cfg.run_name or time.strftime("%Y%m%d-%H%M%S"))
    lock = RunLock(run_dir)  # rank 0's: a run dir in use fails at once, naming its holder
    on_rank0(lock_existing, run_dir, lock)
    cp = f" (x context parallel {cfg.context_parallel})" if cfg.context_parallel > 1 else ""
    log(f"run dir {run_dir} | world {world} | global batch {run.global_batch} = micro {cfg.micro_batch} x accum "
        f"{cfg.grad_accum} x world {run.world}{cp} | seed {cfg.seed} (noise keyed by seed, step, sample index)")

    # ---------------------------------------------------------------- data (validated before any model loads)
    dataset = E2VDataset(ds_cfgs, run.layout.clip_frames, cfg.skip_bad_samples, layout=run.layout,
                         verbose=rank == 0, global_batch=run.global_batch, size_multiple=run.info.spatial_multiple)
    run = with_cache(cfg, run, dataset)
    held = held_out(dataset, cfg.eval_split, cfg.seed)  # eval loss samples, never trained on
    if held:
        clips = sorted({str(dataset.samples[i].video) for i in held})
        log(f"held out for the eval loss (never trained on): {len(held)} sample(s) of {len(clips)} clip(s): "
            + ", ".join(clips[:8]) + (f" and {len(clips) - 8} more" if len(clips) > 8 else ""))
    sampler = BucketBatchSampler(dataset, run.global_batch, seed=cfg.seed, exclude=held)
    log(describe(run))
    if recipe:
        log(f"{'tiny' if is_tiny(cfg.model) else 'the model'}'s recipe for the flags not given: "
            + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in recipe.items()))
    # where to start, with the checkpoint checked against this config (a2/runs.py), before any model loads
    point = ResumePoint() if cfg.precompute else on_rank0(plan_resume, cfg.resume, run_dir, asdict(cfg), run.world,
                                                          named=cfg.run_name is not None)
    for line in [f"skipping {p}: {why}" for p, why in point.skipped] + point.notes:
        log(f"resume: {line}")
    if not cfg.precompute:  # every check passed: the run dir is created (locked) now, and nothing before
        on_rank0(open_run_dir, run_dir, lock, cfg, run, point)

    # ---------------------------------------------------------------- encoders; precompute cache (then exit)
    # every dataset's visualization block is read (the dumps of each enabled one, deduplicated), not the first's
    visualizations = list({repr(d.visualization): d.visualization for d in ds_cfgs if d.visualization.enabled}.values())
    needed = run.cache is None or cfg.precompute or run.validates \
        or any(p["type"] == "vae_decode" for v in visualizations for p in v.processors)
    enc = load_run_encoders(cfg, run, device, needed)
    if cfg.precompute:
        precompute(run, dataset, enc, rank, world)
        if dist.is_initialized():
            dist.destroy_process_group()
        lock.release()
        return dict(cache=run.cache)
    if run.cache is not None:
        dataset.cache_dir = run.cache
        log(f"training from the precompute cache {run.cache}"
            + ("" if enc.vae is None else " (encoders loaded for validation/visualisation)"))
    evaluators = load_val_evaluators(cfg, run, enc, rank, device)  # validation metrics

    # ---------------------------------------------------------------- transformer: DDP or FSDP2
    transformer = place_transformer(cfg, run, rank, device, len(set(dataset.buckets)), cp_group)  # planned, on device
    params = [p for p in transformer.parameters() if p.requires_grad]  # DTensor shards with --fsdp
    ddp = world > 1 and not cfg.fsdp
    model = DDP(transformer, device_ids=[local_rank] if use_cuda else None) if ddp else transformer

    # ---------------------------------------------------------------- optimiser, resume, loader
    opt, guard, failures, start_step = optimizer_and_resume(cfg, params, transformer, dataset, point, device)
    loader = make_loader(dataset, sampler, start_step, dp_rank, dp_world, cfg, use_cuda)
    STOP.update(signal=None, loop=False)
    signal.signal(signal.SIGTERM, on_signal)  # checkpoint and exit cleanly at the end of the step
    signal.signal(signal.SIGINT, on_signal)

    # ---------------------------------------------------------------- the loop
    metrics_file, tb = open_metrics(run_dir, cfg, rank)
    losses: list[float] = []
    frozen: dict = {}  # validation's other Wan 2.2 expert
    last_ckpt = point.path  # the run's newest checkpoint (none is written from non-finite weights)
    meter = dict(t0=time.time(), seen=0, tokens=0, logged=start_step)  # throughput since the last log line
    step, interrupted = start_step, False  # interrupted: a signal, as all ranks agree (one may have missed it)
    STOP["loop"], data_iter = True, None
    try:
        with stop_signals_blocked():  # a signal while the workers start waits, then is theirs to ignore
            data_iter = iter(loader)
        bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps, disable=rank != 0,
                   desc="train")
        for step in bar:
            random.seed(cfg.seed * 1000003 + step)  # anything left random in the step is keyed by (seed, step, rank)
            torch.manual_seed(cfg.seed * 1000003 + step * 1009 + dp_rank)
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step)
            step_loss = torch.zeros((), device=device)
            refused = False  # a sample of this global batch failed to load, on some rank: the step trains nothing
            for j in range(cfg.grad_accum):
                batch = next_batch(data_iter, step)
                refused = failures.refuses(batch, ctrl) or refused  # a collective: every rank, every micro-batch
                if refused:
                    continue
                sync = j == cfg.grad_accum - 1
                if cfg.fsdp:
                    model.set_requires_gradient_sync(sync)  # FSDP2: reduce-scatter on the last micro-step only
                with model.no_sync() if ddp and not sync else nullcontext():
                    inputs = model_inputs(batch, step, j, cfg, run, enc, dp_rank, device)
                    loss, viz = forward_loss(model, inputs, cfg, run, amp, transformer.dtype)
                    (loss * grad_scale(transformer) / cfg.grad_accum).backward()  # x CP size: DDP averages its ranks
                step_loss += loss.detach() / cfg.grad_accum
                meter["seen"] += len(batch["prompts"]) * dp_world
                meter["tokens"] += inputs["tokens"] * dp_world
            if refused:
                skip_step(step, failures, cfg, run_dir, transformer, opt, rank, world)
            else:
                grad_norm = optimizer_step(opt, params, guard, step_loss, step, cfg, world)
            opt.zero_grad(set_to_none=True)
            done = step + 1
            if rank == 0 and not refused:
                for vis in visualizations:
                    visualize(done, viz, vis, enc.vae, run_dir)
            if not refused and (done % cfg.log_every == 0 or done == cfg.max_steps or STOP["signal"] is not None):
                rec = step_record(done, step_loss, grad_norm, opt, guard, cfg, last_ckpt, meter, use_cuda)
                losses.append(rec["loss"])
                log_step(rec, metrics_file, tb)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", sps=f"{rec['samples_per_s']:.2f}")
            interrupted = stop_agreed(world, ctrl)
            last_ckpt = checkpoint_if_due(done, interrupted, cfg, guard, params, last_ckpt, run_dir, transformer, opt,
                                          failures, world)
            if held and not interrupted and (cfg.eval_every and done % cfg.eval_every == 0 or done == cfg.max_steps):
                log_step(evaluate_held_out(done, cfg, run, transformer, opt, params, enc, dataset, held, dp_rank,
                                           dp_world, device, amp), metrics_file, tb)
            if cfg.val_every and done % cfg.val_every == 0:
                with ema_weights(opt, params, cfg.ema_decay > 0):  # the EMA, when kept, is what validation shows
                    log_step(validate(done, cfg, run, transformer, enc, run_dir, frozen, rank, device, amp,
                                      evaluators), metrics_file, tb)
            if interrupted:
                by = signal.Signals(STOP["signal"]).name if STOP["signal"] else "a signal to another rank"
                log(f"stopped by {by} at step {done}, checkpoint {last_ckpt}: exit {EXIT_RESUMABLE} (resumable: the "
                    "same command with --resume auto continues it)")
                break
    finally:  # every exit: the workers ignore SIGTERM, so Python's exit (which stops them with it) would wait forever
        STOP["loop"] = False
        stop_workers(data_iter)
    if failures.skipped_steps:
        log(failures.summary())

    # ---------------------------------------------------------------- export
    result = dict(run_dir=run_dir, step=step + 1 if cfg.max_steps > start_step else start_step, losses=losses,
                  interrupted=interrupted)
    if not interrupted:
        result.update(export(run_dir, model, transformer, opt, params, cfg, run, rank))
        if cfg.val_elements and not cfg.val_every:
            with ema_weights(opt, params, cfg.ema_decay > 0):
                log_step(validate(cfg.max_steps, cfg, run, transformer, enc, run_dir, frozen, rank, device, amp,
                                  evaluators), metrics_file, tb)
    if metrics_file:
        metrics_file.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    lock.release()
    return result


if __name__ == "__main__":
    try:
        result = run_cli(main, CLI_CONFIG)  # a config or data error: its message, no traceback, exit 2
    except (RunLocked, ResumeError) as e:  # the run dir is busy, or the checkpoint does not fit: the same
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Diverged as e:
        print(f"error: diverged: {e}", file=sys.stderr)
        sys.exit(1)
    except LoaderError as e:  # a worker killed or failing outside a sample (a sample's failure is a DatasetError)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except CheckpointError as e:  # e.g. a full disk: the run dir, the free space and what the checkpoint needs
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except Stopped as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    sys.exit(EXIT_RESUMABLE if result.get("interrupted") else 0)
