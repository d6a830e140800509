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

import itertools
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import tyro
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from a2.evaluate import Embedder, evaluate_video, flat_metrics, load_evaluators, named_references
from a2.flow import flow_loss, noisy_latents, sample_generator, sample_sigma  # noqa: F401 (tests import them here)
from a2.fp8 import scaled_mm_supported
from a2.memory import MemoryPlan, apply_plan, plan_for_model, use_expandable_segments
from a2.pipeline import (
    A2Pipeline,
    Conditioning,
    PosteriorCache,
    check_size,
    conditioning_frame_indices,
    decode_vae,
    encode_image,
    encode_prompt,
    encode_vae,
    load_encoders,
    load_first_frame,
    load_references,
    model_flow_shift,
    model_input,
    num_ref_latents,
    prepare_latents,
    save_video,
    tensor_to_uint8,
    ti2v_model_input,
    vae_scale,
    video_prediction,
)
from a2.runs import (
    EXIT_RESUMABLE,
    Diverged,
    NonFiniteSteps,
    ResumeError,
    ResumePoint,
    RunLock,
    RunLocked,
    commit_checkpoint,
    params_finite,
    plan_resume,
    record_start,
)
from a2.tiny import TINY_MODELS, model_path
from a2.transformer import (
    CLIP_TOKENS,
    EXPERTS,
    TEXT_TOKENS,
    ModelInfo,
    detect_model,
    expand_to_e2v,
    expert_sigma_range,
    is_e2v,
    is_expansion_weight,
    load_transformer,
    resolve_e2v_type,
)
from config import (
    ConfigError,
    Element,
    TrainConfig,
    VaeProcessorConfig,
    clip_frames_for,
    dataset_configs,
    pair_elements,
    ref_latents,
    run_cli,
)
from data import (
    BucketBatchSampler,
    DatasetError,
    E2VDataset,
    LoadFailures,
    cache_key,
    collate,
    ignore_stop_signals,
    rank_slice,
    stop_signals_blocked,
    write_cache,
)

RANK = int(os.environ.get("RANK", 0))
STOP = {"signal": None}  # set by the SIGTERM/SIGINT handler; the loop checkpoints and exits at the step's end


def log(*args, **kwargs):
    """The one rank-0 print."""
    if RANK == 0:
        tqdm.write(" ".join(str(a) for a in args), **kwargs)


def on_signal(signum, _frame):
    STOP["signal"] = signum


def on_rank0(fn):
    """fn() on rank 0 alone; its result, or the exception it raised, on every rank (a refusal stops all ranks)."""
    out = [None]
    if RANK == 0:
        try:
            out = [(True, fn())]
        except Exception as e:  # raised again below, on every rank
            out = [(False, e)]
    if dist.is_initialized():
        dist.broadcast_object_list(out, src=0)
    ok, value = out[0]
    if not ok:
        raise value
    return value


# ---------------------------------------------------------------- the run: what a config derives


@dataclass(frozen=True)
class Run:
    """What a run derives from its config and model dir, computed once by plan_run, printed at start and saved
    as run.json beside config.json. Never written back into the config."""

    world: int
    global_batch: int  # micro_batch x grad_accum x world
    layout: str  # prefix: A2's element frames before the clip | inplace: frames of the clip (I2V) | incontext: clean
    # element latents after the clip on the time axis (Phantom / SkyReels-V3 R2V, a T2V model) | t2v: none
    elements: tuple[Element, ...]
    vae: VaeProcessorConfig  # the datasets' shared VAE processing (combine, frame conditioning)
    ref_latents: int  # latent frames the references take in the prefix layout (A2's 1, 4, 4 repeats: 3)
    clip_frames: int  # pixel frames of the target clip: 4·(T - ref_latents - 1) + 1 (A2 at 81 frames: 69)
    info: ModelInfo  # what detect_model read from the model dir
    subfolder: str  # the transformer trained: transformer, or a Wan 2.2 expert's transformer_2
    e2v_type: str  # dual | vae | clip (which reference paths), none for T2V
    expand: bool  # a T2V base widened to the E2V inputs (a2/transformer.py: expand_to_e2v)
    image_branch: bool  # the trained transformer has CLIP image attention (its own, or from the expansion)
    use_clip: bool  # the step feeds CLIP image tokens
    compute_dtype: torch.dtype  # frozen weights and encoders: bf16 on CUDA with --mixed-precision bf16, else fp32
    sigma_range: tuple[float, float]  # [lo, hi): all of [0, 1], or a Wan 2.2 expert's part
    cache: Path | None  # the precompute cache subdir of this data, encoders and preprocessing

    @property
    def prefix(self) -> bool:
        return self.layout == "prefix"

    @property
    def loss_start(self) -> int:
        """First latent frame of the clip in the prefix layout (the loss may leave the references out)."""
        return self.ref_latents


def plan_run(cfg: TrainConfig, world: int, ds_cfgs, device) -> Run:
    """All derived settings and every check that needs no data or weights: a bad config fails here, before any
    loading. The precompute cache, which hashes the data, is added by with_cache once the dataset is scanned."""
    h, w = cfg.resolution
    check_size(h, w, cfg.num_frames)
    if cfg.micro_batch < 1 or cfg.grad_accum < 1:
        raise ConfigError("micro_batch and grad_accum must be >= 1")
    if cfg.fp8_base and cfg.training_type != "lora":  # fp8 base weights (issue 13)
        raise ConfigError("--fp8-base stores the frozen weights of a LoRA run in fp8; full fine-tuning trains them")
    if cfg.fp8_matmul and not cfg.fp8_base and (cfg.memory == "manual" or device.type != "cuda"):  # else: if planned
        raise ConfigError("--fp8-matmul multiplies by the fp8 base weights: add --fp8-base")
    if cfg.fp8_matmul and not scaled_mm_supported(device):
        raise ConfigError(f"--fp8-matmul needs a CUDA GPU of compute capability 9.0+ (H100), not {device}: drop it "
                          "(--fp8-base alone computes in bf16)")
    if cfg.fsdp and cfg.training_type != "full":
        raise ConfigError("--fsdp shards full fine-tuning (--training-type full); LoRA trains a few weights "
                          "of a frozen model: drop --fsdp (DDP)")
    if cfg.swap_blocks and cfg.training_type != "lora":  # (issue 13) full fine-tuning trains every weight
        raise ConfigError(f"--swap-blocks swaps frozen weights: LoRA only, not --training-type {cfg.training_type}")
    if cfg.offload_activations and cfg.fsdp:  # its hooks are set up on the unsharded model only
        raise ConfigError("--offload-activations is not tried with --fsdp: drop one of them")
    if cfg.swap_blocks < 0:
        raise ConfigError(f"--swap-blocks {cfg.swap_blocks}: a number of blocks, >= 0")
    vae_cfg = ds_cfgs[0].vae
    if any(d.vae != vae_cfg for d in ds_cfgs[1:]):
        raise ConfigError("all datasets of one run must share processors.vae (combine, frame conditioning)")
    elements = ds_cfgs[0].elements
    layout = "inplace" if vae_cfg.frame_conditioning != "full" else "t2v" if not elements else \
        "incontext" if vae_cfg.reference_layout == "incontext" else "prefix"
    # in the prefix layout the target clip is what the reference latents leave of num_frames (A2: 81 -> 69)
    l_ref, clip_frames = ref_latents(ds_cfgs), clip_frames_for(cfg.num_frames, ds_cfgs)  # as data.py validate
    info = detect_model(model_path(cfg.model), cfg.image_encoder)  # clear errors for unsupported dirs
    check_size(h, w, cfg.num_frames, info.spatial_multiple)
    if layout == "incontext":  # the references are tokens of the sequence: the model's own input layer takes them
        if info.e2v:
            raise ConfigError(f"{info.path} ({info.name}) takes {info.in_channels} input channels (noisy | mask | "
                              "condition): reference_layout incontext is for T2V models; use reference_layout channel")
        if cfg.e2v_type in ("dual", "clip"):
            raise ConfigError(f"{info.path} ({info.name}) has no CLIP image branch: reference_layout incontext uses "
                              f"the VAE path only (--e2v-type vae or auto), not {cfg.e2v_type}")
        e2v_type = "vae"
    else:
        e2v_type = resolve_e2v_type(info, cfg.e2v_type, layout != "t2v")
    if info.ti2v:  # ---- issue 14: Wan 2.2 TI2V-5B: leading frames the diffusers 5B way, references in context
        check_ti2v(info, layout, vae_cfg.frame_conditioning, cfg.prefix_frames, clip_frames)
    expand = layout not in ("t2v", "incontext") and not info.e2v and not info.ti2v
    image_branch = info.image_branch or (expand and e2v_type != "vae")
    use_clip = layout == "prefix" and e2v_type != "vae" and image_branch
    if cfg.cache_dir and vae_cfg.frame_conditioning == "random":
        raise ConfigError("--cache-dir: random conditioning frames are drawn per step; they cannot be cached")
    if cfg.precompute and not cfg.cache_dir:
        raise ConfigError("--precompute needs --cache-dir")
    if cfg.val_elements:  # read now, not after training and export
        if layout == "t2v":
            raise ConfigError("--val-elements: this run trains without elements (text only); drop them")
        try:
            if info.ti2v and layout == "inplace":  # TI2V-5B image-to-video: the one image is the first frame
                if len(cfg.val_elements) != 1:
                    raise ValueError(f"{info.name} image-to-video takes one image (the first frame), not "
                                     f"{len(cfg.val_elements)}")
                load_first_frame(cfg.val_elements[0], cfg.resolution)
            else:
                load_references(pair_elements(cfg.val_elements, elements), cfg.resolution, (cfg.clip_size,) * 2)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"--val-elements: {e}") from e
    if (cfg.val_elements or cfg.val_every) and not cfg.val_prompt.strip():
        raise ConfigError("--val-prompt is empty: validation videos need a prompt")
    dtype = torch.bfloat16 if device.type == "cuda" and cfg.mixed_precision == "bf16" else torch.float32
    return Run(world, cfg.micro_batch * cfg.grad_accum * world, layout, elements, vae_cfg, l_ref, clip_frames, info,
               info.subfolder(cfg.expert), e2v_type, expand, image_branch, use_clip, dtype,
               expert_sigma_range(cfg.expert, info.boundary_ratio), None)


def check_ti2v(info: ModelInfo, layout: str, frame_conditioning: str, prefix_frames: int, clip_frames: int) -> None:
    """What TI2V-5B trains: T2V, E2V with the references in context (layout incontext), or frame conditioning
    `first` / `prefix` (4k+1 frames: whole latent frames) by replacing the leading latent frames
    (a2.pipeline.ti2v_model_input). Other frame conditionings would need partial latent frames, which the 5B's input
    cannot mark."""
    if layout == "prefix":
        raise ConfigError(f"{info.path} ({info.name}) takes the latents alone: element references go in context "
                          "(--reference-layout incontext), not in A2's channel prefix layout")
    if layout == "inplace" and frame_conditioning not in ("first", "prefix"):
        raise ConfigError(f"{info.path} ({info.name}): --frame-conditioning {frame_conditioning} is not a run of "
                          "leading latent frames; use first or prefix")
    n = cond_frames(frame_conditioning, prefix_frames)
    if layout == "inplace" and ((n - 1) % 4 or n >= clip_frames):
        raise ConfigError(f"{info.path} ({info.name}): --prefix-frames {n} must be 4k+1 (whole latent frames) and "
                          f"fewer than the clip's {clip_frames} frames")


def cond_frames(frame_conditioning: str, prefix_frames: int) -> int:
    """Leading pixel frames TI2V-5B is conditioned on (first: the image of I2V)."""
    return prefix_frames if frame_conditioning == "prefix" else 1


def with_cache(cfg: TrainConfig, run: Run, dataset) -> Run:
    """The run with its precompute cache subdir: a hash of everything the encodings depend on (data.cache_key)."""
    if not cfg.cache_dir:
        return run
    cache = Path(cfg.cache_dir) / cache_key(run.info.path, run.info.image_encoder_dir if run.use_clip else None,
                                            dataset, run.clip_frames, str(run.compute_dtype), run.e2v_type,
                                            cfg.prefix_frames)
    if not cfg.precompute and not (cache / "done").exists():
        raise FileNotFoundError(f"{cache}: no precompute cache for this config; run the same command with "
                                "--precompute first")
    return replace(run, cache=cache)


def describe(run: Run) -> str:
    prefix = f"{run.ref_latents} reference latents + " if run.prefix else ""
    if run.layout == "incontext":
        prefix = f"clean reference latents after the clip (timestep {run.vae.reference_timestep}) + "
    return (f"model {run.info.path}: {run.info.name}, {run.subfolder}/, layout {run.layout}"
            + (f", E2V type {run.e2v_type}{', CLIP tokens' if run.use_clip else ''}" if run.layout != "t2v" else "")
            + (", expanded to the E2V inputs" if run.expand else "")
            + f" | sequence: {prefix}a {run.clip_frames}-frame clip | {str(run.compute_dtype)[6:]} frozen weights"
            + (f" | sigma in [{run.sigma_range[0]}, {run.sigma_range[1]}]" if run.sigma_range != (0.0, 1.0) else ""))


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


def load_run_encoders(cfg: TrainConfig, run: Run, device, needed: bool) -> Encoders:
    enc = Encoders()
    if needed:
        parts = load_encoders(run.info.path, run.info.image_encoder_dir if run.image_branch else None,
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
    return enc


def build_transformer(cfg: TrainConfig, run: Run, rank: int):
    """The transformer to train: loaded, expanded (a T2V base), LoRA-adapted or full (fp32 master weights); a LoRA's
    frozen weights load in the compute dtype (norms and time embedding stay fp32, as diffusers loads them).
    --fsdp: rank 0 alone reads the weights; every rank gets a meta-device replica, and rank 0 also the weights to
    broadcast once it is sharded (shard_from_rank0). Returns (transformer, rank 0's weights or None)."""
    torch.manual_seed(cfg.seed)  # LoRA's A matrices (and an expansion's new weights) start from this seed
    transformer = None
    if rank == 0 or not cfg.fsdp:
        frozen = cfg.training_type == "lora"  # (a LoRA's expansion weights are made fp32 below)
        transformer = load_transformer(run.info.path, run.compute_dtype if frozen else torch.float32, run.subfolder)
        if run.expand:
            log("expanding the T2V transformer to the E2V inputs (output unchanged at init)")
            transformer = expand_to_e2v(transformer, image_dim=run.info.image_encoder_dim if run.image_branch
                                        else None, seed=cfg.seed)
    source = None
    if cfg.fsdp:
        transformer, source = meta_replica(transformer)
    assert is_e2v(transformer) or run.layout in ("t2v", "incontext") or run.info.ti2v
    if cfg.training_type == "lora":
        from peft import LoraConfig

        transformer.requires_grad_(False)
        # an expansion's image K/V train in full (below), no LoRA on them
        keep_kv = run.use_clip and not run.expand
        target = cfg.lora_target if keep_kv else cfg.lora_target.replace("|add_k_proj|add_v_proj", "")
        transformer.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                           target_modules=target, init_lora_weights=True))
        if run.expand:  # the weights the expansion created have nothing to adapt: they train in full and ship
            for name, p in transformer.named_parameters():  # beside the adapter (a2/lora.py: e2v_weights)
                if is_expansion_weight(name) and ".lora_" not in name:
                    p.requires_grad_(True)
        for p in transformer.parameters():  # LoRA (and expansion) weights train in fp32
            if p.requires_grad:
                p.data = p.data.float()
    transformer.train()
    return transformer, source


def memory_plan(cfg: TrainConfig, run: Run, transformer, device) -> MemoryPlan:
    """How the step fits (a2/memory.py), decided before the transformer's weights move to the GPU: --memory auto on
    CUDA plans recomputation, activation offload, fp8 frozen weights and swapped blocks from the model, the shape and
    the memory (the flags --fp8-base, --offload-activations, --swap-blocks force their piece on); --memory manual and
    the CPU take the flags."""
    if cfg.memory == "manual" or device.type != "cuda":
        return MemoryPlan(cfg.checkpoint_fraction if cfg.gradient_checkpointing else 0.0, cfg.save_attention, None,
                          None, "the flags", cfg.offload_activations, cfg.swap_blocks, cfg.fp8_base)
    h, w = cfg.resolution
    appended = num_ref_latents([e.repeat for e in run.elements], "after") if run.layout == "incontext" else 0
    tokens = cfg.micro_batch * run.info.latent_tokens(cfg.num_frames + 4 * appended, h, w)  # + incontext refs
    plan = plan_for_model(transformer, tokens, cfg.max_memory_gb, cfg.training_type == "full", cfg.fsdp, device,
                          fp8=cfg.fp8_base, offload=cfg.offload_activations, swap_blocks=cfg.swap_blocks,
                          compile=cfg.compile)
    return replace(plan, why=f"--memory auto: {plan.why}")


def dry_run(cfg: TrainConfig, run: Run) -> dict:
    """--dry-run (TrainConfig.dry_run): the step's memory at real size without a GPU or weights (a2/trace.py),
    planned by the rule for a --max-memory-gb card (80 by default). Exits 3 when the traced peak does not fit."""
    from a2.memory import model_bytes, plan_memory
    from a2.trace import dry_run as trace_step
    from a2.trace import report

    if run.layout not in ("prefix", "inplace", "t2v") or run.info.ti2v or cfg.fsdp:
        raise ValueError(f"--dry-run traces the prefix, inplace and t2v layouts without --fsdp, not {run.layout}")
    run = replace(run, compute_dtype=torch.bfloat16)  # as on CUDA with --mixed-precision bf16
    h, w = cfg.resolution
    b, s, t_lat = cfg.micro_batch, run.info.vae_scale, (cfg.num_frames - 1) // 4 + 1
    budget = cfg.max_memory_gb or 80.0
    full = cfg.training_type == "full"

    def plan_for(model):
        if cfg.memory == "manual":
            return memory_plan(cfg, run, model, torch.device("cpu"))
        tokens = b * run.info.latent_tokens(cfg.num_frames, h, w)
        # the host is the GPU machine's, not this one's: what the plan pins is printed (report)
        plan = plan_memory(dict(model.config), tokens, budget * 2**30, model_bytes(model, full, False),
                           float("inf"), fp8=cfg.fp8_base, offload=cfg.offload_activations,
                           swap_blocks=cfg.swap_blocks, compile=cfg.compile)
        return replace(plan, why=f"--memory auto: {plan.why}")

    def forward(model):
        latents = torch.zeros(b, run.info.z_dim, t_lat, h // s, w // s)  # (B, 16, T, h, w)
        condition = None if run.layout == "t2v" else torch.zeros(b, 4 + run.info.z_dim, t_lat, h // s, w // s)
        cond = None if condition is None else Conditioning(condition, run.ref_latents if run.prefix else 0, None)
        image = torch.zeros(b, CLIP_TOKENS * len(run.elements), model.config.image_dim) if run.use_clip else None
        inputs = dict(x0=latents, noise=torch.zeros_like(latents), sigmas=torch.full((b,), 0.5), cond=cond,
                      text=torch.zeros(b, TEXT_TOKENS, model.config.text_dim), image=image, reference_images=None)
        amp = torch.autocast("cpu", dtype=torch.bfloat16)
        return forward_loss(model, inputs, cfg, run, amp, torch.bfloat16)[0]

    tracer, plan = trace_step(lambda: build_transformer(cfg, run, 0)[0], plan_for, forward)
    log(f"memory: {plan}")
    lines, fits = report(tracer, plan, budget)
    log("\n".join(lines))
    if not fits:
        sys.exit(3)
    return dict(peak_gb=tracer.peak.total / 2**30, estimate_gb=plan.estimate_gb, host_gb=tracer.host_peak / 2**30)


def meta_replica(transformer):
    """--fsdp: the same architecture on the meta device on every rank, from rank 0's loaded transformer (the
    other ranks pass None and read no weights: host RAM holds one full fp32 copy, not one per rank: 14B = 57 GB).
    Returns (meta model, what shard_from_rank0 broadcasts: rank 0's weights and buffers, None elsewhere)."""
    from diffusers import WanTransformer3DModel

    config = [dict(transformer.config) if RANK == 0 else None]
    dist.broadcast_object_list(config, src=0)
    with torch.device("meta"):
        replica = WanTransformer3DModel.from_config(config[0])
    source = None
    if RANK == 0:  # the state dict (persistent) and the buffers it omits (RoPE tables), both rank 0's tensors
        source = transformer.state_dict(), dict(transformer.named_buffers())
    return replica, source


def shard_from_rank0(model, source, device, param_dtype: torch.dtype) -> None:
    """FSDP2: shard meta_replica's model (each block, then the root: embeddings, head; compute in param_dtype,
    gradients reduced in fp32), materialise it on `device` and fill it from rank 0's `source`: each weight is
    broadcast once and every rank keeps its own shard; unsharded buffers are copied whole.
    Inputs are not cast (cast_forward_inputs=False): bf16 autocast does the casting as under DDP, and the timestep
    and RoPE tables, which FSDP would cast to bf16 (a timestep of 937.5 becomes 936), stay fp32 as under DDP."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # `model` becomes the sharded module itself
    model.to_empty(device=device)
    set_model_state_dict(model, source[0] if RANK == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buf in model.named_buffers():  # to_empty left them uninitialised (not in a state dict)
            if RANK == 0:
                buf.copy_(source[1][name])
            dist.broadcast(buf, src=0)


# ---------------------------------------------------------------- one step: model inputs, loss


def h2d(x: torch.Tensor, device) -> torch.Tensor:
    """Host -> device with no host sync: a copy from pinned memory, queued behind the GPU's work (a plain
    .to(device) from pageable memory waits for the GPU to drain). From the cache a step has no host sync."""
    if device.type != "cuda":
        return x
    return (x if x.is_pinned() else x.pin_memory()).to(device, non_blocking=True)


def total_frames(run: Run, batch) -> int:
    """Pixel frames of the whole sequence: the clip, plus the reference latents' frames in the prefix layout."""
    if not run.prefix:
        return run.clip_frames
    return 4 * ((run.clip_frames - 1) // 4 + num_ref_latents(batch["repeats"], run.vae.combine)) + 1


def encode_latents(vae, batch, gens, sample_mode: str, run: Run, prefix_frames: int, device):
    """x0 (B, 16, T, h, w) and the Conditioning of a micro-batch: the VAE calls only, in a fixed order, so that a
    recording PosteriorCache (--precompute) and a replaying one (training from the cache) see the same calls as
    the live VAE."""
    cached = "posteriors" in batch
    # from the cache the pixels are meta tensors: shapes for prepare_latents, no memory, never read
    video = torch.empty(batch["video_shape"], device="meta") if cached else h2d(batch["video"], device)
    if run.prefix:
        refs = torch.empty(batch["ref_shape"], device="meta") if cached else h2d(batch["ref_vae"], device)
        cond = prepare_latents(vae, total_frames(run, batch), references=refs, repeats=batch["repeats"],
                               combine=run.vae.combine, sample_mode=sample_mode, generator=gens)
        return torch.cat([cond.ref_latents, encode_vae(vae, video, sample_mode, gens)], dim=2), cond
    if run.layout == "incontext":  # references first, then the clip: the encode order the cache replays
        refs = torch.empty(batch["ref_shape"], device="meta") if cached else h2d(batch["ref_vae"], device)
        cond = prepare_latents(vae, run.clip_frames, references=refs, repeats=batch["repeats"], layout="incontext",
                               reference_timestep=run.vae.reference_timestep, sample_mode=sample_mode, generator=gens)
        return encode_vae(vae, video, sample_mode, gens), cond
    x0 = encode_vae(vae, video, sample_mode, gens)
    if run.layout == "t2v":
        return x0, None
    if run.info.ti2v:  # the clean leading latents (B, 48, T_c, h, w), encoded as inference encodes its image
        n = cond_frames(run.vae.frame_conditioning, prefix_frames)
        return x0, prepare_latents(vae, run.clip_frames, video=video, cond_frame_indices=tuple(range(n)),
                                   layout="clean", sample_mode=sample_mode, generator=gens)
    idx = conditioning_frame_indices(run.vae.frame_conditioning, run.clip_frames, run.vae.frame_index, prefix_frames,
                                     gens[0] if gens else None)
    return x0, prepare_latents(vae, run.clip_frames, video=video, cond_frame_indices=idx, sample_mode=sample_mode,
                               generator=gens)


def model_inputs(batch, step: int, j: int, cfg: TrainConfig, run: Run, enc: Encoders, rank: int, device) -> dict:
    """Everything the transformer and the loss take for this rank's j-th micro-batch of `step`: x0, noise, sigma,
    the condition (mask | latents), text and image tokens, with text/reference dropout applied. Each sample draws
    from its own generator (a2/flow.py: sample_generator): sigma, dropout, noise, then the VAE posteriors, as A2's
    inference orders its draws."""
    cached = "posteriors" in batch
    b, _, _, height, width = batch["video_shape"] if cached else batch["video"].shape
    ks = [(j * run.world + rank) * cfg.micro_batch + i for i in range(b)]
    key = step % cfg.overfit_batches if cfg.overfit_batches else step  # overfit: the same draws every lap
    gens = [sample_generator(cfg.seed, key, k) for k in ks]
    drop_text = [torch.rand((), generator=g).item() < cfg.text_dropout for g in gens]
    drop_refs = [torch.rand((), generator=g).item() < cfg.reference_dropout for g in gens]
    sigmas = h2d(torch.tensor([sample_sigma(cfg, g, *run.sigma_range) for g in gens]), device)  # (B,)
    with torch.no_grad():
        t_lat = (total_frames(run, batch) - 1) // 4 + 1
        s = run.info.vae_scale
        noise = h2d(torch.stack([torch.randn(run.info.z_dim, t_lat, height // s, width // s, generator=g)
                                 for g in gens]), device)
        vae = PosteriorCache(enc.latents_config, [h2d(p, device) for p in batch["posteriors"]]) if cached else enc.vae
        x0, cond = encode_latents(vae, batch, gens, cfg.vae_sample_mode, run, cfg.prefix_frames, device)
        clean = None  # TI2V-5B frame conditioning: the clean leading latents (B, 48, T_c, h, w) (ti2v_model_input)
        if run.info.ti2v and run.layout == "inplace":
            clean, cond = cond.clean, None
        condition = None if cond is None else cond.condition  # (B, 20, T, h, w) in the channel layout
        if condition is not None and run.e2v_type == "clip":
            condition = torch.zeros_like(condition)
        text = (h2d(batch["text"], device) if cached
                else encode_prompt(enc.tokenizer, enc.text_encoder, batch["prompts"]))  # (B, 512, D)
        text = torch.where(h2d(torch.tensor(drop_text), device)[:, None, None], enc.empty_text, text)
        image = None
        if run.use_clip:
            image = (h2d(batch["clip"], device) if cached else
                     encode_image(enc.image_encoder, enc.image_processor, batch["ref_clip"]))  # (B, 257·N, D)
        keep_refs = h2d(torch.tensor([not d for d in drop_refs], dtype=torch.float32), device)
        if condition is not None:  # (TI2V-5B's clean frames: a dropped sample trains as T2V, forward_loss)
            condition = condition * keep_refs[:, None, None, None, None]
        if image is not None:
            image = image * keep_refs[:, None, None].to(image.dtype)
        if cond is not None and cond.layout == "incontext" and cond.ref_latents is not None:  # dropped: zeros
            cond = replace(cond, ref_latents=cond.ref_latents * keep_refs[:, None, None, None, None])  # (Phantom's)
        elif cond is not None:
            cond = replace(cond, condition=condition)
    appended = 0 if cond is None or cond.layout != "incontext" or cond.ref_latents is None else \
        cond.ref_latents.shape[2]
    return dict(x0=x0, noise=noise, sigmas=sigmas, condition=condition, cond=cond, text=text, image=image,
                clean=clean, keep_refs=keep_refs,
                tokens=b * run.info.latent_tokens(4 * (t_lat + appended - 1) + 1, height, width),
                reference_images=batch.get("ref_vae"))


def forward_loss(model, inputs: dict, cfg: TrainConfig, run: Run, amp, dtype: torch.dtype):
    """The flow-matching loss of one micro-batch (a2/flow.py) and the latents visualize() may show."""
    x0, sigmas, cond = inputs["x0"], inputs["sigmas"], inputs["cond"]
    x_t, target = noisy_latents(x0, inputs["noise"], sigmas)
    # (B, 16 | 36, T, h, w), or (B, 16, T + L_ref, h, w) incontext: a2.pipeline.model_input, as the sampler builds it
    per_token = run.info.ti2v or cond is not None and cond.layout == "incontext" and cond.reference_timestep == "zero"
    patch_size = getattr(model, "module", model).config.patch_size if per_token else None
    video_x, timestep = x_t, sigmas * 1000
    if run.info.ti2v:  # clean leading latents at timestep 0 in x_t itself, as at inference; no loss on them
        video_x, timestep = ti2v_model_input(x_t, inputs["clean"], timestep, patch_size, inputs["keep_refs"])
    x_in, timestep = model_input(video_x, cond, timestep, patch_size)
    image = inputs["image"]
    with amp:
        pred = model(hidden_states=x_in.to(dtype), timestep=timestep,
                     encoder_hidden_states=inputs["text"].to(dtype),
                     encoder_hidden_states_image=None if image is None else image.to(dtype), return_dict=False)[0]
    pred = video_prediction(pred, cond)  # incontext: the loss is on the video latents only
    first = run.loss_start if run.prefix and not cfg.loss_on_references else 0
    if inputs.get("clean") is not None:  # TI2V-5B: the given leading frames
        first = inputs["clean"].shape[2]
    loss = flow_loss(pred, target, sigmas, cfg.loss_weighting, first)
    s = sigmas.view(-1, 1, 1, 1, 1)
    viz = dict(input_latents=x0, noisy_latents=x_t, conditioned_latents=x_in, predicted_latents=x_t - s * pred,
               reference_images=inputs["reference_images"])
    return loss, viz


# ---------------------------------------------------------------- precompute, validation, visualisation


def precompute(run: Run, dataset, enc: Encoders, rank: int, world: int) -> None:
    """Encode every sample into run.cache (sharded over ranks, resumable): VAE posteriors (recorded, no draw), T5
    trimmed to its tokens, CLIP tokens; rank 0 adds the empty prompt and the latents' normalisation."""
    def encode(batch):
        rec = PosteriorCache(dict(enc.vae.config), vae=enc.vae)
        with torch.no_grad():
            encode_latents(rec, batch, None, "argmax", run, 1, enc.vae.device)
            text = encode_prompt(enc.tokenizer, enc.text_encoder, batch["prompts"])[0]  # (512, D), zeros after tokens
            clip = encode_image(enc.image_encoder, enc.image_processor, batch["ref_clip"])[0] if run.use_clip else None
        n = int(text.abs().sum(-1).nonzero().max()) + 1 if text.abs().sum() > 0 else 0
        return dict(prompt=batch["prompts"][0], posteriors=[p[0].cpu() for p in rec.posteriors],
                    text=text[:n].cpu(), clip=None if clip is None else clip.cpu())

    write_cache(run.cache, dataset, encode, rank, world)
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
    if not (cfg.val_elements or run.layout == "t2v") or (rank != 0 and not cfg.fsdp):  # FSDP: all ranks forward
        return None
    h, w = cfg.resolution
    refs = clips = None
    repeats: tuple[int, ...] = ()
    first_frame = None
    if run.info.ti2v and run.layout == "inplace" and cfg.val_elements:  # TI2V-5B image-to-video (plan_run checked)
        first_frame, items = load_first_frame(cfg.val_elements[0], (h, w)), []
    else:
        items = pair_elements(cfg.val_elements, run.elements) if cfg.val_elements else []
    if items:
        refs, clips, repeats = load_references(items, (h, w), (cfg.clip_size, cfg.clip_size))
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
                      **experts, flow_shift=model_flow_shift(run.info.path), expand_timesteps=run.info.ti2v)
    with amp:
        out = pipe(cfg.val_prompt, refs, clips, repeats, height=h, width=w, num_frames=cfg.num_frames,
                   num_inference_steps=cfg.val_steps, guidance_scale=cfg.val_guidance_scale,
                   flow_shift=cfg.val_flow_shift, combine=run.vae.combine, reference_layout=run.vae.reference_layout,
                   reference_timestep=run.vae.reference_timestep, first_frame=first_frame,
                   generator=torch.Generator(device).manual_seed(cfg.seed), progress=False)
    transformer.train()
    if "other" in frozen:
        frozen["other"].to("cpu")
    if rank == 0:
        path = save_video(run_dir / "samples" / f"step-{step:07d}.mp4", out["video"][0], 15,
                          None if refs is None else refs[0])
        log(f"validation video: {path}")
    # ---- issue 15: validation metrics
    if evaluators is None or rank != 0:
        return None
    result = evaluate_video(out["video"][0], named_references(items, clips), cfg.val_prompt, evaluators,
                            cfg.eval.faces, cfg.eval.max_frames)
    return dict(step=step, **flat_metrics(result, "val/"))


def load_val_evaluators(cfg: TrainConfig, run: Run, enc: Encoders, rank: int, device):
    """The metric encoders of the validation videos (--val-metrics, rank 0), loaded before training so that a bad
    --eval.* dir fails first. CLIP-I uses the run's own image encoder when it has one."""
    if not cfg.val_metrics or rank != 0 or not (cfg.val_elements or run.layout == "t2v" and cfg.val_every):
        return None
    clip = None
    if enc.image_encoder is not None:
        clip = Embedder(enc.image_encoder, enc.image_processor, device, next(enc.image_encoder.parameters()).dtype)
    return load_evaluators(cfg.eval, run.info.image_encoder_dir, device, run.compute_dtype, clip=clip)


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
        if rank == 0 or cfg.fsdp:
            log(f"checkpoint {save_checkpoint(run_dir, step, transformer, opt, cfg, cfg.keep_last, failures)}")
        if world > 1:
            dist.barrier()
        raise DatasetError(failures.stop_message(step + 1))


# ---------------------------------------------------------------- checkpoints, export


def save_checkpoint(run_dir: Path, step: int, model, opt, cfg: TrainConfig, keep_last: int,
                    failures: LoadFailures) -> Path:
    """Write ckpt-<step> atomically (temp dir, manifest written last, then rename) and keep the last `keep_last`.
    DDP: rank 0 writes the trainable weights and optimizer. --fsdp: every rank writes its shards of both
    (torch.distributed.checkpoint, into sharded/), then rank 0 adds state.pt and renames, after a barrier."""
    final = run_dir / f"ckpt-{step:07d}"
    tmp = run_dir / f".tmp-ckpt-{step:07d}"
    if RANK == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if cfg.fsdp:
        dist.barrier()  # the temp dir is there, with nothing stale in it, before any rank writes
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "sharded")
        dist.barrier()  # every rank's shards are on disk
        if RANK != 0:
            return final
    else:
        trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(trainable, tmp / "trainable.safetensors")
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
    rng = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
               cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    torch.save(dict(step=step, data_position=step, rng=rng, load_failures=failures.state_dict()), tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return commit_checkpoint(tmp, final, keep_last, step=step, world_size=world, fsdp=cfg.fsdp)  # manifest last


def load_checkpoint(ckpt: Path, transformer, opt, fsdp: bool, failures: LoadFailures) -> int:
    """Restore weights (or adapter), optimizer, RNG and dropped samples from ckpt; returns its step (the data
    position)."""
    state = torch.load(ckpt / "state.pt", weights_only=False)
    if fsdp:
        if not (ckpt / "sharded").is_dir():
            raise ValueError(f"{ckpt}: not an --fsdp checkpoint (no sharded/); resume it without --fsdp")
        model_sd, optim_sd = get_state_dict(transformer, opt)
        sharded = {"model": model_sd, "optim": optim_sd}
        dcp.load(sharded, checkpoint_id=ckpt / "sharded")  # every rank reads its shards (any world size)
        set_state_dict(transformer, opt, model_state_dict=sharded["model"], optim_state_dict=sharded["optim"])
    else:
        if not (ckpt / "trainable.safetensors").exists():
            raise ValueError(f"{ckpt}: a sharded --fsdp checkpoint; resume it with --fsdp")
        missing = transformer.load_state_dict(load_file(ckpt / "trainable.safetensors"), strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"{ckpt}: checkpoint has weights this model lacks: {missing.unexpected_keys[:5]}")
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    if "load_failures" in state:
        failures.load_state_dict(state["load_failures"])
    return state["step"]


def export_weights(run_dir: Path, model, cfg: TrainConfig, full_state: dict | None = None) -> Path:
    """LoRA -> pytorch_lora_weights.safetensors (diffusers format, load_lora_weights reads it) and
    pytorch_lora_weights_comfy.safetensors (original Wan keys: ComfyUI), see a2/lora.py;
    full fine-tune -> a save_pretrained transformer dir (--fsdp: of `full_state`, the gathered weights).
    A Wan 2.2 expert's export names it: pytorch_lora_weights_high|low*.safetensors (keys `transformer.*`, as
    diffusers writes both; `load_lora_weights(..., load_into_transformer_2=True)` puts the low one on its expert),
    or transformer/ (high) | transformer_2/ (low), the subfolder it replaces in the model dir."""
    if cfg.training_type == "lora":
        from a2.lora import export_lora

        return export_lora(run_dir, model, cfg.expert)[0]
    if full_state is not None:  # a plain (unsharded) model around the gathered weights, no copy
        from diffusers import WanTransformer3DModel

        with torch.device("meta"):
            model = WanTransformer3DModel.from_config(model.config)
        model.load_state_dict(full_state, assign=True)
    out = run_dir / (EXPERTS[cfg.expert] if cfg.expert else "transformer")
    model.save_pretrained(out)
    return out


def open_run_dir(run_dir: Path, lock: RunLock, cfg: TrainConfig, run: Run, point: ResumePoint) -> None:
    """Create and lock the run dir; config.json (once per run, then a `resumes` entry per resume), metrics.jsonl cut
    back to the resumed step, run.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if lock.fd is None:
        lock.acquire()
    record_start(run_dir, asdict(cfg), point, run.world)
    (run_dir / "run.json").write_text(json.dumps(asdict(run), indent=2, default=str))


def log_step(rec: dict, metrics_file, tb) -> None:
    if metrics_file:
        metrics_file.write(json.dumps(rec) + "\n")
        metrics_file.flush()
    if tb:
        for k, v in rec.items():
            if v is not None and k != "step":
                tb.add_scalar(k, v, rec["step"])


# ---------------------------------------------------------------- main


def main(cfg: TrainConfig) -> dict:
    # ---------------------------------------------------------------- distributed setup
    global RANK
    use_expandable_segments()  # before CUDA initialises
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    RANK = rank
    use_cuda = cfg.device == "cuda" or cfg.device == "auto" and torch.cuda.is_available()
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: PyTorch sees no CUDA GPU here")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    elif cfg.fsdp:  # one process: FSDP still needs a (one-rank) process group
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    # the stop flag is agreed on through a CPU group each step, so that it never waits for the GPU
    ctrl = dist.new_group(backend="gloo") if world > 1 and use_cuda else None
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda and cfg.mixed_precision == "bf16" else nullcontext()

    # ---------------------------------------------------------------- the run's settings (no data or weights yet)
    ds_cfgs = dataset_configs(cfg)
    if cfg.model in TINY_MODELS and dist.is_initialized():
        if rank == 0:  # rank 0 builds it: transformers' save_pretrained writes no weights on another rank
            model_path(cfg.model)
        dist.barrier()
    run = plan_run(cfg, world, ds_cfgs, device)  # a bad config fails here, before the data is scanned
    if cfg.dry_run:
        return dry_run(cfg, run)
    run_dir = Path(cfg.output_dir) / (cfg.run_name or time.strftime("%Y%m%d-%H%M%S"))
    lock = RunLock(run_dir)  # rank 0's: a run dir in use fails at once, naming its holder
    on_rank0(lambda: run_dir.is_dir() and lock.acquire() and None)
    log(f"run dir {run_dir} | world {world} | global batch {run.global_batch} = micro {cfg.micro_batch} x accum "
        f"{cfg.grad_accum} x world {world} | seed {cfg.seed} (noise keyed by seed, step, sample index)")

    # ---------------------------------------------------------------- data (validated before any model loads)
    dataset = E2VDataset(ds_cfgs, num_frames=run.clip_frames, skip_bad_samples=cfg.skip_bad_samples,
                         verbose=rank == 0, global_batch=run.global_batch, size_multiple=run.info.spatial_multiple)
    run = with_cache(cfg, run, dataset)
    sampler = BucketBatchSampler(dataset, run.global_batch, seed=cfg.seed)
    log(describe(run))
    # where to start, with the checkpoint checked against this config (a2/runs.py), before any model loads
    point = ResumePoint() if cfg.precompute else on_rank0(
        lambda: plan_resume(cfg.resume, run_dir, asdict(cfg), world, named=cfg.run_name is not None))
    for line in [f"skipping {p}: {why}" for p, why in point.skipped] + point.notes:
        log(f"resume: {line}")
    if not cfg.precompute:  # every check passed: the run dir is created (locked) now, and nothing before
        on_rank0(lambda: open_run_dir(run_dir, lock, cfg, run, point))

    # ---------------------------------------------------------------- encoders; precompute cache (then exit)
    needed = run.cache is None or cfg.precompute or bool(cfg.val_elements or run.layout == "t2v" and cfg.val_every) \
        or any(p["type"] == "vae_decode" for p in ds_cfgs[0].visualization.processors
               if ds_cfgs[0].visualization.enabled)
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
    evaluators = load_val_evaluators(cfg, run, enc, rank, device)  # issue 15: validation metrics

    # ---------------------------------------------------------------- transformer: DDP or FSDP2
    transformer, rank0_weights = build_transformer(cfg, run, rank)
    if cfg.fsdp:
        shard_from_rank0(transformer, rank0_weights, device, run.compute_dtype)  # bf16 compute on CUDA
        del rank0_weights
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M params, "
        f"{sum(p.numel() for p in transformer.parameters() if p.requires_grad) / 1e6:.3f}M trainable "
        f"({cfg.training_type}{', FSDP2' if cfg.fsdp else ''})")
    plan = memory_plan(cfg, run, transformer, device)  # before the weights move: where they go is part of it
    log(f"memory: {plan}")
    for line in apply_plan(transformer, plan, device, cfg.compile, cfg.fp8_matmul):  # fp8, swap, to(device), blocks
        log(line)
    if cfg.attention_backend:
        transformer.set_attention_backend(cfg.attention_backend)
    params = [p for p in transformer.parameters() if p.requires_grad]  # DTensor shards with --fsdp
    ddp = world > 1 and not cfg.fsdp
    model = DDP(transformer, device_ids=[local_rank] if use_cuda else None) if ddp else transformer

    # ---------------------------------------------------------------- optimiser, resume, loader
    # fused: a non-finite step is skipped through its found_inf (NonFiniteSteps), on the device
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=cfg.adam_eps,
                            fused=True)
    guard = NonFiniteSteps(opt, device)
    failures = LoadFailures(cfg.skip_bad_samples)  # samples that fail to load mid-run (data.py)
    start_step = load_checkpoint(point.path, transformer, opt, cfg.fsdp, failures) if point.path else 0
    if point.path:
        log(f"resumed from {point.path} at step {start_step}")
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=RankMicroBatches(sampler, start_step, rank, world, cfg.micro_batch, cfg.grad_accum,
                                                cfg.overfit_batches),
        collate_fn=collate, num_workers=cfg.num_workers, pin_memory=use_cuda, persistent_workers=cfg.num_workers > 0,
        # forked workers of a process that runs CUDA and OpenMP threads can hang (seen on an H100); spawned cannot
        multiprocessing_context="spawn" if cfg.num_workers > 0 else None,
        worker_init_fn=ignore_stop_signals if cfg.num_workers > 0 else None)  # SIGTERM/SIGINT are the loop's
    signal.signal(signal.SIGTERM, on_signal)  # checkpoint and exit cleanly at the end of the step
    signal.signal(signal.SIGINT, on_signal)

    # ---------------------------------------------------------------- the loop
    metrics_file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    tb = None
    if cfg.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(run_dir / "tb")
    losses: list[float] = []
    frozen: dict = {}  # validation's other Wan 2.2 expert
    with stop_signals_blocked():  # a signal while the workers start waits, then is theirs to ignore
        data_iter = iter(loader)
    last_ckpt = point.path  # the run's newest checkpoint (none is written from non-finite weights)
    bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps, disable=rank != 0,
               desc="train")
    t0, seen, tok, step, logged = time.time(), 0, 0, start_step, start_step
    interrupted = False  # a signal, as agreed by all ranks (a rank may have missed it, or got it after the loop)
    for step in bar:
        random.seed(cfg.seed * 1000003 + step)  # anything left random in the step is keyed by (seed, step, rank)
        torch.manual_seed(cfg.seed * 1000003 + step * 1009 + rank)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        step_loss = torch.zeros((), device=device)
        refused = False  # a sample of this global batch failed to load, on some rank: the step trains nothing
        for j in range(cfg.grad_accum):
            batch = next(data_iter)
            refused = failures.refuses(batch, ctrl) or refused  # a collective: every rank, every micro-batch
            if refused:
                continue
            sync = j == cfg.grad_accum - 1
            if cfg.fsdp:
                model.set_requires_gradient_sync(sync)  # FSDP2: reduce-scatter on the last micro-step only
            with model.no_sync() if ddp and not sync else nullcontext():
                inputs = model_inputs(batch, step, j, cfg, run, enc, rank, device)
                loss, viz = forward_loss(model, inputs, cfg, run, amp, transformer.dtype)
                (loss / cfg.grad_accum).backward()
            step_loss += loss.detach() / cfg.grad_accum
            seen += len(batch["prompts"]) * world
            tok += inputs["tokens"] * world
        if refused:
            skip_step(step, failures, cfg, run_dir, transformer, opt, rank, world)
        else:
            if world > 1:  # before the step: every rank sees the same loss, so all skip a non-finite step alike
                dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            guard.before_step(step_loss, grad_norm)  # not finite: this step's update is skipped, on the device
            opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if rank == 0 and not refused:
            visualize(done, viz, ds_cfgs[0].visualization, enc.vae, run_dir)
        if not refused and (done % cfg.log_every == 0 or done == cfg.max_steps or STOP["signal"] is not None):
            value = step_loss.item()  # the only host sync of the step, at log intervals
            _, skipped = guard.check(done, cfg.max_nonfinite_steps, last_ckpt)  # raises Diverged
            dt = time.time() - t0
            rec = dict(step=done, loss=value, lr=opt.param_groups[0]["lr"], grad_norm=float(grad_norm),
                       skipped_steps=skipped,
                       s_per_step=dt / (done - logged), samples_per_s=seen / dt, tokens_per_s=tok / dt,
                       peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if use_cuda else None)
            losses.append(value)
            log_step(rec, metrics_file, tb)
            bar.set_postfix(loss=f"{value:.4f}", lr=f"{rec['lr']:.2e}", sps=f"{rec['samples_per_s']:.2f}")
            t0, seen, tok, logged = time.time(), 0, 0, done
        interrupted = STOP["signal"] is not None
        if world > 1:
            flag = torch.tensor([float(interrupted)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctrl)
            interrupted = bool(flag.item())
        if done % cfg.ckpt_every == 0 or done == cfg.max_steps or interrupted:
            streak, _ = guard.check(done, cfg.max_nonfinite_steps, last_ckpt)
            finite = torch.tensor([float(params_finite(params))])
            if cfg.fsdp and world > 1:  # each rank checked its shards
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if not finite.item():
                raise Diverged(f"step {done}: weights not finite, not checkpointed; the last checkpoint with finite "
                               f"weights: {last_ckpt or 'none'}")
            if streak and not interrupted and done != cfg.max_steps:  # amid skipped steps: postponed, so that
                log(f"step {done} was not finite: checkpoint postponed")  # it pushes out no earlier checkpoint
            else:
                last_ckpt = run_dir / f"ckpt-{done:07d}"
                if rank == 0 or cfg.fsdp:
                    log(f"checkpoint {save_checkpoint(run_dir, done, transformer, opt, cfg, cfg.keep_last, failures)}")
                if world > 1:
                    dist.barrier()
        if cfg.val_every and done % cfg.val_every == 0:
            scores = validate(done, cfg, run, transformer, enc, run_dir, frozen, rank, device, amp, evaluators)
            if scores:  # issue 15: validation metrics
                log_step(scores, metrics_file, tb)
        if interrupted:
            by = signal.Signals(STOP["signal"]).name if STOP["signal"] else "a signal to another rank"
            log(f"stopped by {by} at step {done}, checkpoint {last_ckpt}: exit {EXIT_RESUMABLE} (resumable: the same "
                "command with --resume auto continues it)")
            break
    del data_iter, loader  # stop the loader workers now, not mid-batch at interpreter exit
    if failures.skipped_steps:
        log(failures.summary())

    # ---------------------------------------------------------------- export
    result = dict(run_dir=run_dir, step=step + 1 if cfg.max_steps > start_step else start_step, losses=losses,
                  interrupted=interrupted)
    full_state = None
    if cfg.fsdp and not interrupted:  # a collective: rank 0 gets the full weights on CPU, the others {}
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and not interrupted:
        result["weights"] = export_weights(run_dir, transformer, cfg, full_state)
        log(f"exported {result['weights']}")
    del full_state
    if cfg.val_elements and not cfg.val_every and not interrupted:
        scores = validate(cfg.max_steps, cfg, run, transformer, enc, run_dir, frozen, rank, device, amp, evaluators)
        if scores:  # issue 15: validation metrics
            log_step(scores, metrics_file, tb)
    if metrics_file:
        metrics_file.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    lock.release()
    return result


if __name__ == "__main__":
    try:
        result = run_cli(main, tyro.cli(TrainConfig))  # a config or data error: its message, no traceback, exit 2
    except (RunLocked, ResumeError) as e:  # the run dir is busy, or the checkpoint does not fit: the same
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Diverged as e:
        print(f"error: diverged: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(EXIT_RESUMABLE if result.get("interrupted") else 0)
