"""Elements-to-Video training on Wan / SkyReels-A2: one main(cfg), a hand-written DDP loop.

    python train_a2.py --model tiny --data-root sample_data --max-steps 20          # CPU, built-in tiny model
    python train_a2.py --model /models/Wan2.1-T2V-1.3B-Diffusers --dataset-type t2v --manifest data/train.jsonl
    torchrun --nproc_per_node 8 train_a2.py --model /models/SkyReels-A2 --data-root /data/e2v \
        --elements "subject=_person.png,_mask.png:required,repeat=1" "object=_object.png:repeat=4" \
        "background=_background.png:repeat=4,vae=center_crop"

Everything random in a step (sigma, noise, dropout, VAE posterior) is drawn from a generator seeded by
(seed, step, index of the sample in the global batch), so N ranks, gradient accumulation and one process
compute the same update, and a resumed run continues the same loss curve. The objective is in a2/train/flow.py,
the conditioning in a2/kinds/conditioning.py (prepare_latents, shared with inference through A2Pipeline).
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a flag typo or a config error answer before the heavy imports below (torch...)
    from a2.cli import exit_on_signal, parse_cli, run_cli
    from config import TrainConfig, run_datasets

    exit_on_signal("stopped before the first step (the step loop checkpoints on a signal); nothing is lost: run the "
                   "same command again")
    CLI_CONFIG = parse_cli(TrainConfig)
    run_cli(run_datasets, CLI_CONFIG)  # the flags' and the dataset config's mistakes too (main reads them again)

import itertools
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from a2.cli import ConfigError, exit_on_signal, left_as_found, run_cli
from a2.data.loader import (
    LoaderError,
    LoadFailures,
    WorkerContext,
    collate,
    ignore_stop_signals,
    next_batch,
    stop_signals_blocked,
    stop_workers,
)
from a2.eval.evaluate import evaluate_held_out, load_val_evaluators, validate, visualize
from a2.kinds import align
from a2.kinds.conditioning import (
    PosteriorCache,
    element_layout,
    encode,
    lora_target,
    vae_scale,
)
from a2.memory.memory import apply_plan, memory_plan, step_shape, use_expandable_segments
from a2.model.parallel import (
    context_parallel,
    data_parallel,
    grad_scale,
    meta_replica,
    setup_distributed,
    shard_from_rank0,
)
from a2.model.tiny import TINY_MODELS, model_path
from a2.model.transformer import (
    allow_recompiles,
    expand_to_e2v,
    is_e2v,
    load_transformer,
)
from a2.pipeline import (
    encode_prompt,
    image_tokens,
    load_encoders,
)
from a2.plan import Run, plan_training, with_cache
from a2.train.lora import export, make_trainable
from a2.train.runs import (
    EXIT_RESUMABLE,
    CheckpointError,
    Diverged,
    ResumePoint,
    RunLock,
    Stopped,
    load_checkpoint,
    params_finite,
    plan_resume,
    record_start,
    save_checkpoint,
)
from a2.train.step import (  # the step: the loop, the eval loss, both dry runs and bench.py run it
    Encoders,
    Process,
    TrainState,
    ema_weights,
    forward_loss,
    make_optimizer,
    model_inputs,
    optimizer_step,
)
from a2.train.trace import dry_run
from config import OptimConfig, TrainConfig, flat_config, is_tiny, run_datasets, with_flags
from data import (
    BucketBatchSampler,
    DatasetError,
    E2VDataset,
    held_out,
    rank_slice,
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


def plan_run(cfg: TrainConfig, world: int, datasets, device) -> Run:
    """The run of cfg on `world` data-parallel ranks (a2/plan.py plan_training, on the sections it reads): a bad config
    fails here, before any data or weights load."""
    return plan_training(cfg.model, cfg.data, cfg.rundir, cfg.optim, cfg.memory, cfg.lora, cfg.parallel, cfg.references,
                         cfg.objective, cfg.validation, world, datasets, device)


def step_sections(cfg: TrainConfig) -> tuple:
    """The sections a training step reads (a2/train/trace.py dry_run's): memory, parallel, LoRA, optim, objective,
    references."""
    return cfg.memory, cfg.parallel, cfg.lora, cfg.optim, cfg.objective, cfg.references


def validation_sections(cfg: TrainConfig) -> tuple:
    """What a validation video reads (a2/eval/evaluate.py validate's): its section, eval's, parallel's, the size, the
    CLIP size and the expert."""
    return cfg.validation, cfg.eval, cfg.parallel, cfg.data.resolution, cfg.model.clip_size, cfg.model.expert


def data_layout(run: Run, dataset: E2VDataset):
    """The run's layout for the largest element set its data holds (its buckets'), the one the header describes: a
    plan covers the kind's most references, the data may hold fewer (Phantom's 4, clips of 3)."""
    sets = [tuple(e.repeat for e in dataset.cfgs[s.dataset].elements if e.name in names)
            for s, (_, _, _, names) in zip(dataset.samples, dataset.buckets)]
    try:
        return element_layout(run.layout, max(sets, key=len)) if sets else run.layout
    except ValueError:  # a set the kind cannot take is left out by the dataset
        return run.layout


def describe(run: Run, layout=None) -> str:
    """The run's header line; layout: the one the data samples in (data_layout), else the plan's."""
    return (f"model {run.info.path}: {run.info.name}, {run.subfolder}/, {(layout or run.layout).describe()} | "
            f"{str(run.compute_dtype)[6:]} frozen weights"
            + (f" | sigma in [{run.sigma_range[0]}, {run.sigma_range[1]}]" if run.sigma_range != (0.0, 1.0) else "")
            + f" | blocks {'compiled' if run.compile else 'eager'}")


# ---------------------------------------------------------------- data position


def lr_at(optim: OptimConfig, step: int) -> float:
    """Linear warmup, then constant or cosine to 0 at max_steps (step counts from 0)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.lr_schedule == "cosine":
        p = (step - optim.warmup_steps) / max(1, optim.max_steps - optim.warmup_steps)
        return optim.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))
    return optim.lr


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


def rank_micro_batches(sampler, start, rank, world, micro, accum, overfit=0):
    """The DataLoader's batch_sampler (iterated once, by the loop's one iter(loader)): this rank's `accum`
    micro-batches of each global batch."""
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
    if run.cache is not None and not cfg.data.precompute:
        meta = torch.load(run.cache / "meta.pt", weights_only=True)
        enc.latents_config, enc.empty_text = meta["latents_config"], meta["empty_text"].to(device)
    elif needed:
        enc.latents_config = dict(latents_mean=list(enc.vae.config.latents_mean),
                                  latents_std=list(enc.vae.config.latents_std), scale_factor_spatial=vae_scale(enc.vae))
        enc.empty_text = encode_prompt(enc.tokenizer, enc.text_encoder, [""]).to(device)  # the CFG-dropout prompt
    if cfg.references.align_loss and (run.cache is None or cfg.data.precompute):  # else the cache holds the targets
        enc.align_target = align.load_target_model(cfg.references.align_model, device)
    return enc


def build_transformer(cfg: TrainConfig, run: Run, rank: int):
    """The transformer to train: loaded (a LoRA's frozen weights in the compute dtype; norms and time embedding stay
    fp32, as diffusers loads them), expanded (a T2V base), made trainable (make_trainable). --fsdp: rank 0 alone
    reads the weights; every rank gets a meta-device replica made trainable alike, and rank 0 also the weights to
    broadcast once it is sharded (a2/model/parallel.py shard_from_rank0). Returns (transformer, rank 0's weights or
    None)."""
    torch.manual_seed(cfg.optim.seed)  # LoRA's A matrices (and an expansion's new weights) start from this seed
    transformer = None
    if rank == 0 or not cfg.parallel.fsdp:
        frozen = cfg.lora.training_type == "lora"  # (a LoRA's expansion weights are made fp32 by make_trainable)
        transformer = load_transformer(run.info.path, run.compute_dtype if frozen else torch.float32, run.subfolder)
        if run.layout.expand:
            log("expanding the T2V transformer to the E2V inputs (output unchanged at init)")
            transformer = expand_to_e2v(transformer, image_dim=run.info.image_encoder_dim if run.layout.image_branch
                                        else None, seed=cfg.optim.seed)
        assert is_e2v(transformer) or not run.layout.channel
        prepare_trainable(transformer, cfg, run)
    if not cfg.parallel.fsdp:
        return transformer, None
    return meta_replica(transformer, lambda model: prepare_trainable(model, cfg, run))


def prepare_trainable(transformer, cfg: TrainConfig, run: Run):
    """What the run trains of `transformer`, in place (a2/train/lora.py make_trainable; --align-loss: its projectors, a
    trainable fp32 submodule: optimised, reduced, checkpointed, planned, never exported), in training mode."""
    lora, r = cfg.lora, cfg.references
    try:
        make_trainable(transformer, run.layout, lora.training_type, lora.lora_rank, lora.lora_alpha, lora.lora_dropout,
                       lora_target(run.layout, lora.lora_target, lora.vace_lora_target))  # VACE: its context blocks
    except ValueError as e:  # a --lora-target with no original-Wan name
        raise ConfigError(f"--lora-target {lora.lora_target!r}: {e}") from None
    if r.align_loss:
        try:
            align.install(transformer, align.target_dim(r.align_model), r.align_blocks, seed=cfg.optim.seed)
        except ValueError as e:  # a block the model lacks
            raise ConfigError(str(e)) from None
    return transformer.train()


# ---------------------------------------------------------------- precompute cache


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
        # what load_run_encoders made of the encoders, and reads back from here when training from the cache
        torch.save(dict(empty_text=enc.empty_text.cpu(), latents_config=enc.latents_config), run.cache / "meta.pt")
        (run.cache / "done").write_text(f"{len(dataset)} samples\n")
        log(f"precomputed {len(dataset)} samples into {run.cache}")


# ---------------------------------------------------------------- samples that fail to load mid-run


def skip_step(step: int, state: TrainState, cfg: TrainConfig, run_dir: Path) -> None:
    """A step whose global batch holds a sample that failed to load (on any rank: LoadFailures.refuses) makes no
    update. With --skip-bad-samples the sample is dropped and the run goes on; without, the state before this step
    is checkpointed and the run stops with one line (--resume auto redoes the step)."""
    for line in state.failures.skip_step(step + 1):
        log(line)
    if not cfg.data.skip_bad_samples:
        state.opt.zero_grad(set_to_none=True)  # the checkpoint holds the optimizer, not the step's partial gradients
        checkpoint(run_dir, step, state, cfg)
        raise DatasetError(state.failures.stop_message(step + 1))


# ---------------------------------------------------------------- checkpoints


def checkpoint(run_dir: Path, step: int, state: TrainState, cfg: TrainConfig) -> Path:
    """Write ckpt-<step> (a2/train/runs.py: save_checkpoint), on every rank alike: DDP's rank 0 writes it and the others
    wait for it, and a write that fails (CheckpointError: a full disk) stops every rank, not rank 0 alone."""
    def save():
        path = save_checkpoint(run_dir, step, state.transformer, state.opt, flat_config(cfg, nested=True),
                               cfg.rundir.keep_last, state.failures.state_dict(), cfg.parallel.fsdp)
        log(f"checkpoint {path}")
        return path

    return save() if cfg.parallel.fsdp else on_rank0(save)
def open_run_dir(run_dir: Path, lock: RunLock, cfg: TrainConfig, run: Run, point: ResumePoint) -> None:
    """Create and lock the run dir; config.json (once per run, then a `resumes` entry per resume), metrics.jsonl cut
    back to the resumed step, run.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if lock.fd is None:
        lock.acquire()
    record_start(run_dir, flat_config(cfg, nested=True), point, run.world)
    (run_dir / "run.json").write_text(json.dumps(asdict(run), indent=2, default=str))


def lock_existing(run_dir: Path, lock: RunLock) -> None:
    """An existing run dir is locked at once: one in use by another run fails here, naming its holder."""
    if run_dir.is_dir():
        lock.acquire()


def place_transformer(cfg: TrainConfig, run: Run, proc: Process, shapes: int):
    """build_transformer, sharded with --fsdp, its sequence split over proc.cp_group (context parallel), then put in
    place by the memory plan (fp8, swapped blocks, the rest on proc.device, recomputation, compilation for `shapes`
    input shapes), decided before the weights move: where they go is part of it."""
    device = proc.device
    transformer, rank0_weights = build_transformer(cfg, run, proc.rank)
    if cfg.parallel.fsdp:
        shard_from_rank0(transformer, rank0_weights, device, run.compute_dtype)  # bf16 compute on CUDA
        del rank0_weights
    if proc.cp_group is not None:  # before the plan wraps the blocks' forward (the split hooks are the blocks')
        context_parallel(transformer, proc.cp_group)
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M params, "
        f"{sum(p.numel() for p in transformer.parameters() if p.requires_grad) / 1e6:.3f}M trainable "
        f"({cfg.lora.training_type}{', FSDP2' if cfg.parallel.fsdp else ''})")
    # decided before the weights move to the GPU (a2/memory/memory.py), for a rank's share of the tokens
    shape = step_shape(run.layout, run.info, cfg.data.resolution, cfg.optim.micro_batch, cfg.parallel.context_parallel)
    plan = memory_plan(cfg.memory, transformer, shape, cfg.lora.training_type == "full", cfg.parallel.fsdp, device,
                       run.compile, ema=cfg.optim.ema_decay > 0)
    log(f"memory: {plan}")
    if run.compile:
        allow_recompiles(shapes)
    for line in apply_plan(transformer, plan, device, run.compile, cfg.memory.fp8_matmul):  # fp8, swap, to(device),
        log(line)  # blocks
    if cfg.memory.attention_backend:
        transformer.set_attention_backend(cfg.memory.attention_backend)
    return transformer


def make_loader(dataset, sampler, start_step: int, proc: Process, cfg: TrainConfig):
    """This rank's micro-batches from `start_step` on (the data position is the step)."""
    o, workers = cfg.optim, cfg.data.num_workers
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=rank_micro_batches(sampler, start_step, proc.dp_rank, proc.dp_world, o.micro_batch,
                                                 o.grad_accum, o.overfit_batches),
        collate_fn=collate, num_workers=workers, pin_memory=proc.device.type == "cuda",
        persistent_workers=workers > 0,
        # forked workers of a process that runs CUDA and OpenMP threads can hang (seen on an H100); spawned cannot
        multiprocessing_context=WorkerContext() if workers > 0 else None,
        worker_init_fn=ignore_stop_signals if workers > 0 else None)  # SIGTERM/SIGINT are the loop's


def hold_out(dataset, cfg: TrainConfig) -> list[int]:
    """The eval loss's samples (--eval-split), never trained on, named by their clips."""
    held = held_out(dataset, cfg.validation.eval_split, cfg.optim.seed)
    if held:
        clips = sorted({str(dataset.samples[i].video) for i in held})
        log(f"held out for the eval loss (never trained on): {len(held)} sample(s) of {len(clips)} clip(s): "
            + ", ".join(clips[:8]) + (f" and {len(clips) - 8} more" if len(clips) > 8 else ""))
    return held


def open_metrics(run_dir: Path, cfg: TrainConfig, rank: int):
    """Rank 0's metrics.jsonl (appended to: a resume continues it) and tensorboard writer."""
    if rank != 0:
        return None, None
    tb = None
    if cfg.rundir.tensorboard:
        from torch.utils.tensorboard import SummaryWriter  # (tensorboard: optional, imported only when asked for)

        tb = SummaryWriter(run_dir / "tb")
    return open(run_dir / "metrics.jsonl", "a"), tb


def accumulate(step: int, data_iter, state: TrainState, cfg: TrainConfig, run: Run, enc: Encoders, proc: Process,
               meter: dict):
    """The step's --grad-accum micro-batches: forward and backward each, the gradients reduced on the last one.
    Returns (the step's loss on the device, the last micro-batch's tensors for visualisation, refused: a sample of
    the global batch failed to load, on some rank, and the step trains nothing)."""
    step_loss = torch.zeros((), device=proc.device)
    refused, viz = False, None
    ddp = isinstance(state.model, DDP)
    for j in range(cfg.optim.grad_accum):
        batch = next_batch(data_iter, step)
        refused = state.failures.refuses(batch, proc.ctrl) or refused  # a collective: every rank, every micro-batch
        if refused:
            continue
        sync = j == cfg.optim.grad_accum - 1
        if cfg.parallel.fsdp:
            state.model.set_requires_gradient_sync(sync)  # FSDP2: reduce-scatter on the last micro-step only
        with state.model.no_sync() if ddp and not sync else nullcontext():
            inputs = model_inputs(batch, step, j, cfg.optim, cfg.objective, cfg.references, run, enc, proc.dp_rank,
                                  proc.device)
            loss, viz = forward_loss(state.model, inputs, cfg.objective, cfg.references, run, proc.amp,
                                     state.transformer.dtype)
            # x CP size: DDP averages its ranks
            (loss * grad_scale(state.transformer) / cfg.optim.grad_accum).backward()
        step_loss += loss.detach() / cfg.optim.grad_accum
        meter["seen"] += len(batch["prompts"]) * proc.dp_world
        meter["tokens"] += inputs["tokens"] * proc.dp_world
    return step_loss, viz, refused


def step_record(done: int, step_loss, grad_norm, state: TrainState, cfg: TrainConfig, meter: dict,
                use_cuda: bool) -> dict:
    """The metrics.jsonl record of step `done` (its loss read here: the step's only host sync), with throughput since
    the last record (`meter` restarts). Raises Diverged after too many non-finite steps."""
    value = step_loss.item()
    _, skipped = state.guard.check(done, cfg.optim.max_nonfinite_steps, state.last_ckpt)
    dt = time.time() - meter["t0"]
    rec = dict(step=done, loss=value, lr=state.opt.param_groups[0]["lr"], grad_norm=float(grad_norm),
               skipped_steps=skipped, s_per_step=dt / (done - meter["logged"]), samples_per_s=meter["seen"] / dt,
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


def checkpoint_if_due(done: int, interrupted: bool, cfg: TrainConfig, state: TrainState, run_dir: Path,
                      world: int) -> None:
    """The checkpoint decision after step `done`: every --ckpt-every steps, at the end and on a stop; never of
    non-finite weights (Diverged, naming the last good one), and postponed amid skipped non-finite steps so that it
    pushes out no earlier checkpoint. A checkpoint written becomes state.last_ckpt."""
    if not (done % cfg.rundir.ckpt_every == 0 or done == cfg.optim.max_steps or interrupted):
        return
    streak, _ = state.guard.check(done, cfg.optim.max_nonfinite_steps, state.last_ckpt)
    finite = torch.tensor([float(params_finite(state.params))])
    if cfg.parallel.fsdp and world > 1:  # each rank checked its shards
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise Diverged(f"step {done}: weights not finite, not checkpointed; the last checkpoint with finite weights: "
                       f"{state.last_ckpt or 'none'}")
    if streak and not interrupted and done != cfg.optim.max_steps:
        log(f"step {done} was not finite: checkpoint postponed")
        return
    state.last_ckpt = checkpoint(run_dir, done, state, cfg)


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


def train_state(cfg: TrainConfig, transformer, model, dataset, point: ResumePoint, device) -> tuple[TrainState, int]:
    """AdamW over the trainable weights, its non-finite guard and the run's load-failure bookkeeping, restored from
    the checkpoint when resuming (what changed in the dataset since, said by path). Returns (state, start step)."""
    params = [p for p in transformer.parameters() if p.requires_grad]  # DTensor shards with --fsdp
    opt, guard = make_optimizer(cfg.optim, params, device)
    failures = LoadFailures(cfg.data.skip_bad_samples, [f"{s.video} ({s.id})" for s in dataset.samples],  # (data.py)
                            dataset.stamp)
    state = TrainState(transformer, model, params, opt, guard, failures, point.path)
    if not point.path:
        return state, 0
    saved = load_checkpoint(point.path, transformer, opt, cfg.parallel.fsdp)
    for line in failures.load_state_dict(saved.get("load_failures", failures.state_dict())):
        log(line)  # whether the dataset changed since the checkpoint; the dropped samples, by path
    log(f"resumed from {point.path} at step {saved['step']}")
    return state, saved["step"]


def start_process(cfg: TrainConfig) -> tuple[int, int, Process]:
    """The process group (torchrun's, or this process alone) and this rank's Process: its device, autocast and, with
    context parallel, the group of ranks that shares each sample (a2/model/parallel.py; data and batch count dp ranks
    only). Returns (world, local rank, Process)."""
    global RANK
    if cfg.model.model in TINY_MODELS:  # built on each node's disk before the process group exists (transformers writes
        # weights on global rank 0 alone once it does); its file lock lets the node's first rank build it
        model_path(cfg.model.model)
    use_expandable_segments()  # before CUDA initialises
    par, dry = cfg.parallel, cfg.memory.dry_run
    world, RANK, local_rank, device, ctrl = setup_distributed(par.device, par.fsdp and not dry)
    dp_rank, dp_world, cp_group = data_parallel(world, RANK, 1 if dry else par.context_parallel, device.type)
    bf16 = device.type == "cuda" and par.mixed_precision == "bf16"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()
    return world, local_rank, Process(RANK, dp_rank, dp_world, device, amp, ctrl, cp_group)


def trace_step(cfg: TrainConfig, run: Run) -> dict:
    """--dry-run: one rank's step traced at real size (a2/train/trace.py; the harness shards with --fsdp); exit 3 when
    the plan does not fit."""
    result = dry_run(*step_sections(cfg), cfg.data.resolution, run,
                     lambda run: build_transformer(with_flags(cfg, fsdp=False), run, 0)[0], log=log)
    if not result["fits"]:
        sys.exit(3)
    return result


def lock_run_dir(cfg: TrainConfig, run: Run, world: int) -> tuple[Path, RunLock]:
    """The run dir (--run-name, else the start time) and its lock, held by rank 0 at once when the dir exists (one in
    use fails here, naming its holder); the run's first log line."""
    o, cp = cfg.optim, cfg.parallel.context_parallel
    run_dir = Path(cfg.rundir.output_dir) / (cfg.rundir.run_name or time.strftime("%Y%m%d-%H%M%S"))
    lock = RunLock(run_dir)
    on_rank0(lock_existing, run_dir, lock)
    log(f"run dir {run_dir} | world {world} | global batch {run.global_batch} = micro {o.micro_batch} x accum "
        f"{o.grad_accum} x world {run.world}{f' (x context parallel {cp})' if cp > 1 else ''} | seed {o.seed} "
        "(noise keyed by seed, step, sample index)")
    return run_dir, lock


def run_encoders(cfg: TrainConfig, run: Run, device) -> tuple[Encoders, list]:
    """The encoders the run needs (none from a precompute cache, unless validation or a vae_decode dump decodes) and
    its visualizations: every dataset's enabled block (deduplicated), not the first's alone."""
    visualizations = list({repr(d.visualization): d.visualization for d in run.datasets
                           if d.visualization.enabled}.values())
    needed = run.cache is None or run.validates or any(p["type"] == "vae_decode" for v in visualizations
                                                       for p in v.processors)
    enc = load_run_encoders(cfg, run, device, needed)
    if run.cache is not None:
        log(f"training from the precompute cache {run.cache}"
            + ("" if enc.vae is None else " (encoders loaded for validation/visualisation)"))
    return enc, visualizations


def seed_step(o: OptimConfig, step: int, dp_rank: int, opt) -> None:
    """The step's learning rate, and its seeds: anything left random in the step is keyed by (seed, step, rank)."""
    random.seed(o.seed * 1000003 + step)
    torch.manual_seed(o.seed * 1000003 + step * 1009 + dp_rank)
    for g in opt.param_groups:
        g["lr"] = lr_at(o, step)


@left_as_found(lambda: STOP.update(signal=None, loop=False))  # (its STOP flags cleared on every exit)
def main(cfg: TrainConfig) -> dict:
    # ---------------------------------------------------------------- distributed setup
    world, local_rank, proc = start_process(cfg)
    rank, device, use_cuda, o, par = proc.rank, proc.device, proc.device.type == "cuda", cfg.optim, cfg.parallel

    # ---------------------------------------------------------------- the run's settings (no data or weights yet)
    run = plan_run(cfg, proc.dp_world, run_datasets(cfg), device)  # a bad config fails here, before any data is read
    if cfg.memory.dry_run:
        return trace_step(cfg, run)
    run_dir, lock = lock_run_dir(cfg, run, world)

    # ---------------------------------------------------------------- data (validated before any model loads)
    dataset = E2VDataset(run.datasets, run.layout.clip_frames, cfg.data.skip_bad_samples, layout=run.layout,
                         verbose=rank == 0, global_batch=run.global_batch, size_multiple=run.info.spatial_multiple)
    run = with_cache(cfg.data, cfg.references, run, dataset)
    held = hold_out(dataset, cfg)  # eval loss samples, never trained on
    sampler = BucketBatchSampler(dataset, run.global_batch, seed=o.seed, exclude=held)
    log(describe(run, data_layout(run, dataset)))
    if cfg.filled:  # what the flags left out, from the model's recipe (config.RECIPES)
        log(f"{'tiny' if is_tiny(cfg.model.model) else 'the model'}'s recipe for the flags not given: "
            + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in cfg.filled.items()))
    if cfg.data.precompute:  # the cache alone: no run dir, no resume
        precompute(run, dataset, load_run_encoders(cfg, run, device, True), rank, world)
        lock.release()
        return dict(cache=run.cache)
    # where to start, with the checkpoint checked against this config (a2/train/runs.py), before any model loads
    point = on_rank0(plan_resume, cfg.rundir.resume, run_dir, flat_config(cfg, nested=True), run.world,
                     named=cfg.rundir.run_name is not None)
    for line in [f"skipping {p}: {why}" for p, why in point.skipped] + point.notes:
        log(f"resume: {line}")
    on_rank0(open_run_dir, run_dir, lock, cfg, run, point)  # every check passed: the run dir is made now, not before

    # ---------------------------------------------------------------- encoders
    enc, visualizations = run_encoders(cfg, run, device)
    if run.cache is not None:
        dataset.cache_dir = run.cache
    evaluators = load_val_evaluators(cfg.validation, cfg.eval, run, enc, proc)  # validation metrics

    # ---------------------------------------------------------------- transformer: DDP or FSDP2
    transformer = place_transformer(cfg, run, proc, len(set(dataset.buckets)))  # planned, on device
    ddp = world > 1 and not cfg.parallel.fsdp
    model = DDP(transformer, device_ids=[local_rank] if use_cuda else None) if ddp else transformer

    # ---------------------------------------------------------------- optimiser, resume, loader
    state, start_step = train_state(cfg, transformer, model, dataset, point, device)
    loader = make_loader(dataset, sampler, start_step, proc, cfg)
    signal.signal(signal.SIGTERM, on_signal)  # checkpoint and exit cleanly at the end of the step (left_as_found
    signal.signal(signal.SIGINT, on_signal)  # restores the caller's handlers)

    # ---------------------------------------------------------------- the loop
    metrics_file, tb = open_metrics(run_dir, cfg, rank)
    losses: list[float] = []
    frozen: dict = {}  # validation's other Wan 2.2 expert
    meter = dict(t0=time.time(), seen=0, tokens=0, logged=start_step)  # throughput since the last log line
    step, interrupted = start_step, False  # interrupted: a signal, as all ranks agree (one may have missed it)
    STOP["loop"], data_iter = True, None
    try:
        with stop_signals_blocked():  # a signal while the workers start waits, then is theirs to ignore
            data_iter = iter(loader)
        bar = tqdm(range(start_step, o.max_steps), initial=start_step, total=o.max_steps, disable=rank != 0,
                   desc="train")
        for step in bar:
            seed_step(o, step, proc.dp_rank, state.opt)
            step_loss, viz, refused = accumulate(step, data_iter, state, cfg, run, enc, proc, meter)
            if refused:
                skip_step(step, state, cfg, run_dir)
            else:
                grad_norm = optimizer_step(state.opt, state.params, state.guard, step_loss, step, o, world)
            state.opt.zero_grad(set_to_none=True)
            done = step + 1
            if rank == 0 and not refused:
                for vis in visualizations:
                    visualize(done, viz, vis, enc.vae, run_dir)
            if not refused and (done % cfg.rundir.log_every == 0 or done == o.max_steps or STOP["signal"] is not None):
                rec = step_record(done, step_loss, grad_norm, state, cfg, meter, use_cuda)
                losses.append(rec["loss"])
                log_step(rec, metrics_file, tb)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", sps=f"{rec['samples_per_s']:.2f}")
            interrupted = stop_agreed(world, proc.ctrl)
            checkpoint_if_due(done, interrupted, cfg, state, run_dir, world)
            v = cfg.validation
            if held and not interrupted and (v.eval_every and done % v.eval_every == 0 or done == o.max_steps):
                log_step(evaluate_held_out(done, cfg.objective, o, v, par, run, state, enc, dataset, held, proc, log),
                         metrics_file, tb)
            if v.val_every and done % v.val_every == 0:
                with ema_weights(state.opt, state.params, o.ema_decay > 0):  # the EMA, when kept, is validated
                    log_step(validate(done, *validation_sections(cfg), run, transformer, enc, run_dir, frozen, proc,
                                      evaluators, log), metrics_file, tb)
            if interrupted:
                by = signal.Signals(STOP["signal"]).name if STOP["signal"] else "a signal to another rank"
                log(f"stopped by {by} at step {done}, checkpoint {state.last_ckpt}: exit {EXIT_RESUMABLE} (resumable: "
                    "the same command with --resume auto continues it)")
                break
    finally:  # every exit: the workers ignore SIGTERM, so Python's exit (which stops them with it) would wait forever
        STOP["loop"] = False
        stop_workers(data_iter)
    if state.failures.skipped_steps:
        log(state.failures.summary())

    # ---------------------------------------------------------------- export
    result = dict(run_dir=run_dir, step=step + 1 if o.max_steps > start_step else start_step, losses=losses,
                  interrupted=interrupted)
    if not interrupted:
        result.update(export(run_dir, state, cfg.model, cfg.lora, o, par, run, rank,
                             lambda model: prepare_trainable(model, cfg, run), log))
        if cfg.validation.val_elements and not cfg.validation.val_every:
            with ema_weights(state.opt, state.params, o.ema_decay > 0):
                log_step(validate(o.max_steps, *validation_sections(cfg), run, transformer, enc, run_dir, frozen, proc,
                                  evaluators, log), metrics_file, tb)
    if metrics_file:
        metrics_file.close()
    if dist.is_initialized():
        dist.barrier()  # every rank's export and validation done before left_as_found destroys the group
    lock.release()
    return result


if __name__ == "__main__":
    try:  # a config or data error, a busy run dir, a checkpoint that does not fit: its message, no traceback, exit 2
        result = run_cli(main, CLI_CONFIG)
    except (Diverged, LoaderError, CheckpointError) as e:  # a worker killed or failing outside a sample (a sample's
        # failure is a DatasetError); a full disk: the run dir, the free space and what the checkpoint needs
        print(f"error: {'diverged: ' if isinstance(e, Diverged) else ''}{e}", file=sys.stderr)
        sys.exit(1)
    except Stopped as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    sys.exit(EXIT_RESUMABLE if result.get("interrupted") else 0)
