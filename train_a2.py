"""Elements-to-Video training on Wan / SkyReels-A2: one main(cfg), a hand-written DDP loop.

    python train_a2.py --model tiny --data-root sample_data --max-steps 20          # CPU, built-in tiny model
    python train_a2.py --model /models/Wan2.1-T2V-1.3B-Diffusers --dataset-type t2v --manifest data/train.jsonl
    torchrun --nproc_per_node 8 train_a2.py --model /models/SkyReels-A2 --data-root /data/e2v \
        --elements "subject=_person.png,_mask.png:required,repeat=1" "object=_object.png:repeat=4" \
        "background=_background.png:repeat=4,vae=center_crop"

Everything random in a step (sigma, noise, dropout, VAE posterior) is drawn from a generator seeded by
(seed, step, index of the sample in the global batch), so N ranks, gradient accumulation and one process
compute the same update, and a resumed run continues the same loss curve.
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
from dataclasses import asdict
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

from a2.pipeline import (
    A2Pipeline,
    PosteriorCache,
    check_size,
    conditioning_frame_indices,
    decode_vae,
    encode_image,
    encode_prompt,
    encode_vae,
    load_encoders,
    load_references,
    model_flow_shift,
    num_ref_latents,
    prepare_latents,
    save_video,
    tensor_to_uint8,
)
from a2.transformer import (
    EXPERTS,
    configure_blocks,
    detect_model,
    expand_to_e2v,
    expert_sigma_range,
    is_e2v,
    load_transformer,
    resolve_e2v_type,
)
from config import TrainConfig, dataset_configs, pair_elements
from data import BucketBatchSampler, E2VDataset, cache_key, collate, rank_slice, write_cache

RANK = int(os.environ.get("RANK", 0))


def log(*args, **kwargs):
    """The one rank-0 print."""
    if RANK == 0:
        tqdm.write(" ".join(str(a) for a in args), **kwargs)


def sample_generator(seed: int, step: int, k: int, device="cpu") -> torch.Generator:
    """The generator of the k-th sample of the global batch at `step`: independent of rank and split."""
    s = int(np.random.SeedSequence([seed, step, k]).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator(device=device).manual_seed(s)


def sigma_cdf(cfg: TrainConfig, s: float) -> float:
    """P(sigma <= s) under cfg's sigma distribution."""
    if s <= 0.0 or s >= 1.0:
        return min(max(s, 0.0), 1.0)
    if cfg.sigma_sampling == "logit_normal":
        return 0.5 * (1 + math.erf((math.log(s / (1 - s)) - cfg.logit_mean) / (cfg.logit_std * math.sqrt(2))))
    if cfg.sigma_sampling == "uniform":
        return s
    return s / (cfg.sigma_shift - (cfg.sigma_shift - 1) * s)  # shifted: the inverse of the shift map


def sigma_quantile(cfg: TrainConfig, u: float) -> float:
    """The inverse of sigma_cdf: u in [0, 1] -> sigma."""
    if cfg.sigma_sampling == "logit_normal":
        z = math.sqrt(2) * torch.erfinv(torch.tensor(2 * u - 1, dtype=torch.float64)).item()
        return 1 / (1 + math.exp(-(cfg.logit_mean + cfg.logit_std * z))) if math.isfinite(z) else float(z > 0)
    if cfg.sigma_sampling == "uniform":
        return u
    return cfg.sigma_shift * u / (1 + (cfg.sigma_shift - 1) * u)  # shifted


def sample_sigma(cfg: TrainConfig, g: torch.Generator, lo: float = 0.0, hi: float = 1.0) -> float:
    """sigma from cfg's distribution; with [lo, hi) narrower than [0, 1] (a Wan 2.2 expert's range) from that
    distribution truncated to the range: one uniform draw between the CDF's values at lo and hi, mapped back
    by the quantile function. The shape inside the range is kept, so the high- and low-noise experts together
    are trained on exactly the configured distribution (rescaling it into each range would not)."""
    if lo <= 0.0 and hi >= 1.0:
        if cfg.sigma_sampling == "logit_normal":
            return torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn((), generator=g)).item()
        return sigma_quantile(cfg, torch.rand((), generator=g).item())
    a, b = sigma_cdf(cfg, lo), sigma_cdf(cfg, hi)
    s = sigma_quantile(cfg, a + (b - a) * torch.rand((), generator=g, dtype=torch.float64).item())
    # rounding must not cross the boundary: below hi strictly (in float32, the dtype the timestep is made in)
    top = 1.0 if hi >= 1.0 else float(np.nextafter(np.float32(hi), np.float32(0)))
    return min(max(s, lo), top)


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


def save_checkpoint(run_dir: Path, step: int, model, opt, cfg: TrainConfig, keep_last: int) -> Path:
    """Write ckpt-<step> atomically (temp dir, then rename) and keep the last `keep_last`.
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
    torch.save(dict(step=step, data_position=step, rng=rng), tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(run_dir.glob("ckpt-*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_sharded(ckpt: Path, model, opt) -> None:
    """--fsdp resume: every rank reads its shards of the model and optimizer state (any world size)."""
    if not (ckpt / "sharded").is_dir():
        raise ValueError(f"{ckpt}: not an --fsdp checkpoint (no sharded/); resume it without --fsdp")
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt / "sharded")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


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
    broadcast once and every rank keeps its own shard; unsharded buffers are copied whole."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
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


def main(cfg: TrainConfig) -> dict:
    # ---------------------------------------------------------------- distributed setup
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    global RANK
    RANK = rank
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if cfg.fsdp and cfg.training_type != "full":
        raise ValueError("--fsdp shards full fine-tuning (--training-type full); LoRA trains a few weights "
                         "of a frozen model: drop --fsdp (DDP)")
    if cfg.fsdp and cfg.compile and cfg.save_attention and cfg.gradient_checkpointing:
        raise ValueError("--fsdp --compile cannot --save-attention: FSDP2's hooks keep the checkpoint outside the "
                         "compiled forward, where the selective policy would undo compilation (a2/transformer.py)")
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
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if use_cuda and cfg.mixed_precision == "bf16"
           else nullcontext())

    # ---------------------------------------------------------------- checks that need no data or model
    h, w = cfg.resolution
    check_size(h, w, cfg.num_frames)
    if cfg.micro_batch < 1 or cfg.grad_accum < 1:
        raise ValueError("micro_batch and grad_accum must be >= 1")
    global_batch = cfg.micro_batch * cfg.grad_accum * world
    ds_cfgs = dataset_configs(cfg)
    vae_cfg = ds_cfgs[0].vae
    if any(d.vae != vae_cfg for d in ds_cfgs[1:]):
        raise ValueError("all datasets of one run must share processors.vae (combine, frame conditioning)")
    elements = ds_cfgs[0].elements
    prefix = vae_cfg.frame_conditioning == "full" and bool(elements)
    text_only = vae_cfg.frame_conditioning == "full" and not elements  # T2V: no condition input at all
    # in the prefix layout the target clip is what the reference latents leave of num_frames (A2: 81 -> 69)
    l_ref = num_ref_latents([e.repeat for e in elements], vae_cfg.combine) if prefix else 0
    clip_frames = 4 * ((cfg.num_frames - 1) // 4 - l_ref) + 1
    if clip_frames < 1:
        raise ValueError(f"num_frames={cfg.num_frames} leaves no video frames after {l_ref} reference latents")

    # ---------------------------------------------------------------- run dir, resolved config
    run_dir = Path(cfg.output_dir) / (cfg.run_name or time.strftime("%Y%m%d-%H%M%S"))
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    log(f"run dir {run_dir} | world {world} | global batch {global_batch} = micro {cfg.micro_batch} x accum "
        f"{cfg.grad_accum} x world {world} | seed {cfg.seed} (noise keyed by seed, step, sample index)")

    # ---------------------------------------------------------------- data (validated before any model loads)
    dataset = E2VDataset(ds_cfgs, num_frames=clip_frames, skip_bad_samples=cfg.skip_bad_samples,
                         verbose=rank == 0)
    sampler = BucketBatchSampler(dataset, global_batch, seed=cfg.seed)

    # ---------------------------------------------------------------- models
    from a2.tiny import model_path

    if cfg.model.startswith("tiny") and dist.is_initialized():  # rank 0 builds it: transformers' save_pretrained
        if rank == 0:  # silently writes no weights on another rank of an initialised process group
            model_path(cfg.model)
        dist.barrier()
    info = detect_model(cfg.model, cfg.image_encoder)  # clear errors for unsupported dirs, before any weights load
    model_dir = info.path
    subfolder = info.subfolder(cfg.expert)  # a Wan 2.2 pair trains one expert: only it is loaded
    conditioned = not text_only
    e2v_type = resolve_e2v_type(info, cfg.e2v_type, conditioned)
    sigma_range = expert_sigma_range(cfg.expert, info.boundary_ratio)
    log(f"model {model_dir}: {info.name}" + (f", E2V type {e2v_type}" if conditioned else ", T2V"))
    if cfg.expert:
        log(f"training the {cfg.expert}-noise expert {subfolder}/ on sigma in [{sigma_range[0]}, {sigma_range[1]}"
            + ("]" if cfg.expert == "high" else ")"))
    expand = conditioned and not info.e2v  # a T2V base gets the E2V inputs (a2/transformer.py: expand_to_e2v)
    image_branch = info.image_branch or (expand and e2v_type != "vae")
    use_clip = prefix and e2v_type != "vae" and image_branch
    image_src = info.image_encoder_dir
    frozen_dtype = torch.bfloat16 if use_cuda and cfg.mixed_precision == "bf16" else torch.float32
    cache = None
    if cfg.cache_dir:  # the encoders' outputs for this exact data/preprocessing/encoders, or a new dir for them
        if vae_cfg.frame_conditioning == "random":
            raise ValueError("--cache-dir: random conditioning frames are drawn per step; they cannot be cached")
        cache = Path(cfg.cache_dir) / cache_key(model_dir, image_src if use_clip else None, dataset, clip_frames,
                                                str(frozen_dtype), e2v_type, cfg.prefix_frames)
        if not cfg.precompute and not (cache / "done").exists():
            raise FileNotFoundError(f"{cache}: no precompute cache for this config; run the same command with "
                                    "--precompute first")
    need_encoders = cache is None or cfg.precompute or bool(cfg.val_elements or text_only and cfg.val_every) or any(
        p["type"] == "vae_decode" for p in ds_cfgs[0].visualization.processors if ds_cfgs[0].visualization.enabled)
    vae = tokenizer = text_encoder = image_encoder = image_processor = None
    if need_encoders:
        vae, tokenizer, text_encoder, image_encoder, image_processor = load_encoders(
            model_dir, image_src if image_branch else None, frozen_dtype)
        for m in (vae, text_encoder, image_encoder):
            if m is not None:
                m.to(device)

    # ---------------------------------------------------------------- precompute cache (then exit)
    def h2d(x: torch.Tensor) -> torch.Tensor:
        """Host -> device with no host sync: a copy from pinned memory, queued behind the GPU's work (a plain
        .to(device) from pageable memory waits for the GPU to drain). From the cache a step has no host sync."""
        if not use_cuda:
            return x
        return (x if x.is_pinned() else x.pin_memory()).to(device, non_blocking=True)

    def total_frames(batch) -> int:
        """Pixel frames of the whole sequence: the clip, plus the reference latents' frames in the prefix layout."""
        if not prefix:
            return clip_frames
        return 4 * ((clip_frames - 1) // 4 + num_ref_latents(batch["repeats"], vae_cfg.combine)) + 1

    def encode_latents(vae_, batch, gens, sample_mode):
        """x0 (B, 16, T, h, w) and the Conditioning of a micro-batch: the VAE calls only, in a fixed order, so
        that a recording PosteriorCache (--precompute) and a replaying one (training from the cache) see the
        same calls as the live VAE."""
        cached = "posteriors" in batch
        # from the cache the pixels are meta tensors: shapes for prepare_latents, no memory, never read
        video = torch.empty(batch["video_shape"], device="meta") if cached else h2d(batch["video"])
        if prefix:
            refs = torch.empty(batch["ref_shape"], device="meta") if cached else h2d(batch["ref_vae"])
            cond = prepare_latents(vae_, total_frames(batch), references=refs, repeats=batch["repeats"],
                                   combine=vae_cfg.combine, sample_mode=sample_mode, generator=gens)
            return torch.cat([cond.ref_latents, encode_vae(vae_, video, sample_mode, gens)], dim=2), cond
        x0 = encode_vae(vae_, video, sample_mode, gens)
        if vae_cfg.frame_conditioning == "full":
            return x0, None
        idx = conditioning_frame_indices(vae_cfg.frame_conditioning, clip_frames, vae_cfg.frame_index,
                                         cfg.prefix_frames, gens[0] if gens else None)
        return x0, prepare_latents(vae_, clip_frames, video=video, cond_frame_indices=idx, sample_mode=sample_mode,
                                   generator=gens)

    if cfg.precompute:
        if cache is None:
            raise ValueError("--precompute needs --cache-dir")

        def encode(batch):  # one sample: posteriors (recorded, no draw), T5 trimmed to its tokens, CLIP
            rec = PosteriorCache(dict(vae.config), vae=vae)
            with torch.no_grad():
                encode_latents(rec, batch, None, "argmax")
                text = encode_prompt(tokenizer, text_encoder, batch["prompts"])[0]  # (512, D), zeros after the tokens
                clip = encode_image(image_encoder, image_processor, batch["ref_clip"])[0] if use_clip else None
            n = int(text.abs().sum(-1).nonzero().max()) + 1 if text.abs().sum() > 0 else 0
            return dict(prompt=batch["prompts"][0], posteriors=[p[0].cpu() for p in rec.posteriors],
                        text=text[:n].cpu(), clip=None if clip is None else clip.cpu())

        write_cache(cache, dataset, encode, rank, world)
        if world > 1:
            dist.barrier()
        if rank == 0:
            torch.save(dict(empty_text=encode_prompt(tokenizer, text_encoder, [""]).cpu(),
                            latents_config=dict(latents_mean=list(vae.config.latents_mean),
                                                latents_std=list(vae.config.latents_std))), cache / "meta.pt")
            (cache / "done").write_text(f"{len(dataset)} samples\n")
            log(f"precomputed {len(dataset)} samples into {cache}")
        if dist.is_initialized():
            dist.destroy_process_group()
        return dict(cache=cache)
    if cache is not None:
        dataset.cache_dir = cache
        meta = torch.load(cache / "meta.pt", weights_only=True)
        latents_config, empty_text = meta["latents_config"], meta["empty_text"].to(device)
        log(f"training from the precompute cache {cache}" + ("" if vae is None else
                                                             " (encoders loaded for validation/visualisation)"))
    else:
        latents_config = dict(latents_mean=list(vae.config.latents_mean), latents_std=list(vae.config.latents_std))
        empty_text = encode_prompt(tokenizer, text_encoder, [""]).to(device)  # the CFG-dropout prompt

    if expand and cfg.training_type == "lora":  # the new input channels (and image K/V) must train and ship
        raise ValueError(f"{model_dir} is a T2V model: E2V training widens its input layer, which a LoRA cannot "
                         "train or carry; use --training-type full (infer.py --transformer <run>/transformer)")
    torch.manual_seed(cfg.seed)  # LoRA's A matrices (and an expansion's new weights) start from this seed
    transformer = None
    if rank == 0 or not cfg.fsdp:  # --fsdp: rank 0 alone reads the weights and broadcasts them once sharded
        transformer = load_transformer(model_dir, torch.float32, subfolder)
        if expand:
            log("expanding the T2V transformer to the E2V inputs (output unchanged at init)")
            transformer = expand_to_e2v(transformer, image_dim=info.image_encoder_dim if e2v_type != "vae" else None,
                                        seed=cfg.seed)
    if cfg.fsdp:
        transformer, rank0_weights = meta_replica(transformer)
    assert is_e2v(transformer) or not (prefix or vae_cfg.frame_conditioning != "full")

    if cfg.training_type == "lora":
        from peft import LoraConfig

        transformer.requires_grad_(False)
        transformer.to(frozen_dtype)
        target = cfg.lora_target if use_clip else cfg.lora_target.replace("|add_k_proj|add_v_proj", "")
        transformer.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                           target_modules=target, init_lora_weights=True))
        for p in transformer.parameters():  # LoRA weights train in fp32
            if p.requires_grad:
                p.data = p.data.float()
    configure_blocks(transformer, cfg.checkpoint_fraction if cfg.gradient_checkpointing else 0.0, cfg.save_attention,
                     cfg.compile, cfg.fsdp)
    transformer.train()
    if not cfg.fsdp:  # --fsdp: shard_from_rank0 puts each rank's shards on the device
        transformer.to(device)
    if cfg.attention_backend:
        transformer.set_attention_backend(cfg.attention_backend)
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M params, "
        f"{sum(p.numel() for p in transformer.parameters() if p.requires_grad) / 1e6:.3f}M trainable "
        f"({cfg.training_type}{', FSDP2' if cfg.fsdp else ''})")
    if cfg.fsdp:
        shard_from_rank0(transformer, rank0_weights, device, frozen_dtype)  # bf16 compute on CUDA
        del rank0_weights
    params = [p for p in transformer.parameters() if p.requires_grad]  # DTensor shards with --fsdp
    ddp = world > 1 and not cfg.fsdp
    model = DDP(transformer, device_ids=[local_rank] if use_cuda else None) if ddp else transformer

    # ---------------------------------------------------------------- optimiser, resume
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=cfg.adam_eps,
                            fused=use_cuda)
    start_step = 0
    resume = cfg.resume
    if resume == "auto":
        ckpts = sorted(run_dir.glob("ckpt-*"))
        resume = str(ckpts[-1]) if ckpts else None
    if resume:
        ckpt = Path(resume)
        state = torch.load(ckpt / "state.pt", weights_only=False)
        if cfg.fsdp:
            load_sharded(ckpt, model, opt)
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
        start_step = state["step"]
        log(f"resumed from {ckpt} at step {start_step}")

    micro_batches = RankMicroBatches(sampler, start_step, rank, world, cfg.micro_batch, cfg.grad_accum,
                                     cfg.overfit_batches)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=micro_batches, collate_fn=collate,
                                         num_workers=cfg.num_workers, pin_memory=use_cuda,
                                         persistent_workers=cfg.num_workers > 0,
                                         # forked workers of a process that runs CUDA and OpenMP threads can hang
                                         # (seen on an H100 machine); spawned ones cannot
                                         multiprocessing_context="spawn" if cfg.num_workers > 0 else None)

    # ---------------------------------------------------------------- signals: checkpoint and exit cleanly
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # ---------------------------------------------------------------- one training step
    def forward_loss(batch, step: int, j: int):
        """Loss of this rank's j-th micro-batch of `step`, each sample with its own generator."""
        cached = "posteriors" in batch
        b, _, _, height, width = batch["video_shape"] if cached else batch["video"].shape
        ks = [(j * world + rank) * cfg.micro_batch + i for i in range(b)]
        key = step % cfg.overfit_batches if cfg.overfit_batches else step  # overfit: the same draws every lap
        gens = [sample_generator(cfg.seed, key, k) for k in ks]
        drop_text = [torch.rand((), generator=g).item() < cfg.text_dropout for g in gens]
        drop_refs = [torch.rand((), generator=g).item() < cfg.reference_dropout for g in gens]
        sigmas = h2d(torch.tensor([sample_sigma(cfg, g, *sigma_range) for g in gens]))
        with torch.no_grad():
            # noise first, then the VAE posteriors, as A2's inference orders its draws
            t_lat = (total_frames(batch) - 1) // 4 + 1
            noise = h2d(torch.stack([torch.randn(16, t_lat, height // 8, width // 8, generator=g) for g in gens]))
            vae_ = PosteriorCache(latents_config, [h2d(p) for p in batch["posteriors"]]) if cached else vae
            x0, cond = encode_latents(vae_, batch, gens, cfg.vae_sample_mode)
            condition = None if cond is None else cond.condition  # (B, 20, T, h, w)
            if condition is not None and e2v_type == "clip":
                condition = torch.zeros_like(condition)
            text = h2d(batch["text"]) if cached else encode_prompt(tokenizer, text_encoder, batch["prompts"])
            text = torch.where(h2d(torch.tensor(drop_text))[:, None, None], empty_text, text)
            image = None
            if use_clip:
                image = (h2d(batch["clip"]) if cached else
                         encode_image(image_encoder, image_processor, batch["ref_clip"]))
            keep_refs = h2d(torch.tensor([not d for d in drop_refs], dtype=torch.float32))
            if condition is not None:
                condition = condition * keep_refs[:, None, None, None, None]
            if image is not None:
                image = image * keep_refs[:, None, None].to(image.dtype)
        s = sigmas[:, None, None, None, None]
        x_t = (1 - s) * x0 + s * noise  # flow matching: x_t on the straight line from x0 to noise
        target = noise - x0
        x_in = x_t if condition is None else torch.cat([x_t, condition], dim=1)
        with amp:
            pred = model(hidden_states=x_in.to(transformer.dtype), timestep=sigmas * 1000,
                         encoder_hidden_states=text.to(transformer.dtype),
                         encoder_hidden_states_image=None if image is None else image.to(transformer.dtype),
                         return_dict=False)[0]
        err = (pred.float() - target).pow(2)  # (B, 16, T, h, w)
        if prefix and not cfg.loss_on_references:
            err = err[:, :, t_lat - (clip_frames - 1) // 4 - 1:]
        per_sample = err.mean(dim=(1, 2, 3, 4))
        if cfg.loss_weighting == "cosmap":
            per_sample = per_sample * 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
        viz = dict(input_latents=x0, noisy_latents=x_t, conditioned_latents=x_in, predicted_latents=x_t - s * pred,
                   reference_images=batch.get("ref_vae"))
        tokens = b * t_lat * (height // 16) * (width // 16)
        return per_sample.mean(), tokens, viz

    # ---------------------------------------------------------------- validation videos
    frozen = {}

    def validate(step: int):
        if not (cfg.val_elements or text_only) or (rank != 0 and not cfg.fsdp):  # FSDP: all ranks run the forwards
            return
        refs = clips = None
        repeats: tuple[int, ...] = ()
        if cfg.val_elements:
            items = pair_elements(cfg.val_elements, elements)
            refs, clips, repeats = load_references(items, (h, w), (cfg.clip_size, cfg.clip_size))
        transformer.eval()
        experts = {}
        if info.two_experts:  # the other expert, frozen, loaded at the first validation; between validations it
            if "other" not in frozen:  # waits in host memory: on the GPU it would add a whole model to every step
                other = "low" if cfg.expert == "high" else "high"
                frozen["other"] = load_transformer(model_dir, frozen_dtype, EXPERTS[other]).eval()
            frozen["other"].to(device)
            high, low = ((transformer, frozen["other"]) if cfg.expert == "high" else (frozen["other"], transformer))
            experts = dict(transformer_2=low, boundary_ratio=info.boundary_ratio)
        else:
            high = transformer
        pipe = A2Pipeline(high, vae, tokenizer, text_encoder, image_encoder, image_processor, **experts,
                          flow_shift=model_flow_shift(model_dir))
        with amp:
            out = pipe(cfg.val_prompt, refs, clips, repeats, height=h, width=w, num_frames=cfg.num_frames,
                       num_inference_steps=cfg.val_steps, guidance_scale=cfg.val_guidance_scale,
                       flow_shift=cfg.val_flow_shift, combine=vae_cfg.combine,
                       generator=torch.Generator(device).manual_seed(cfg.seed), progress=False)
        transformer.train()
        if "other" in frozen:
            frozen["other"].to("cpu")
        if rank == 0:
            path = save_video(run_dir / "samples" / f"step-{step:07d}.mp4", out["video"][0], 15,
                              None if refs is None else refs[0])
            log(f"validation video: {path}")

    def visualize(step: int, viz: dict):
        vis = ds_cfgs[0].visualization
        if rank != 0 or not vis.enabled or step % vis.frequency:
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
                        frames = decode_vae(vae, x[:, :16].detach().float())[0]  # (3, F, H, W)
                    from PIL import Image

                    for fi in proc.get("frames", [0, -1]):
                        Image.fromarray(tensor_to_uint8(frames[:, fi])).save(out / f"step{step:07d}_{key}_f{fi}.png")

    # ---------------------------------------------------------------- the loop
    metrics_file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    tb = None
    if cfg.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(run_dir / "tb")
    losses: list[float] = []
    data_iter = iter(loader)
    bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps, disable=rank != 0,
               desc="train")
    t0, seen, tok, step = time.time(), 0, 0, start_step
    interrupted = False  # a signal, as agreed by all ranks (a rank may have missed it, or got it after the loop)
    for step in bar:
        random.seed(cfg.seed * 1000003 + step)  # anything left random in the step is keyed by (seed, step, rank)
        torch.manual_seed(cfg.seed * 1000003 + step * 1009 + rank)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        step_loss = torch.zeros((), device=device)
        for j in range(cfg.grad_accum):
            batch = next(data_iter)
            sync = j == cfg.grad_accum - 1
            if cfg.fsdp:
                model.set_requires_gradient_sync(sync)  # FSDP2: reduce-scatter on the last micro-step only
            with (model.no_sync() if ddp and not sync else nullcontext()):
                loss, tokens, viz = forward_loss(batch, step, j)
                (loss / cfg.grad_accum).backward()
            step_loss += loss.detach() / cfg.grad_accum
            seen += len(batch["prompts"]) * world
            tok += tokens * world
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        done = step + 1
        visualize(done, viz)
        if done % cfg.log_every == 0 or done == cfg.max_steps or stop["signal"] is not None:
            value = step_loss.item()  # the only host sync of the step, at log intervals
            if not math.isfinite(value):
                log(f"loss is {value} at step {done}: stopping; the last good checkpoint is intact in {run_dir}")
                raise FloatingPointError(f"non-finite loss {value} at step {done}")
            dt = time.time() - t0
            rec = dict(step=done, loss=value, lr=opt.param_groups[0]["lr"], grad_norm=float(grad_norm),
                       samples_per_s=seen / dt, tokens_per_s=tok / dt,
                       peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if use_cuda else None)
            losses.append(value)
            if metrics_file:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
            if tb:
                for k_, v_ in rec.items():
                    if v_ is not None and k_ != "step":
                        tb.add_scalar(k_, v_, done)
            bar.set_postfix(loss=f"{value:.4f}", lr=f"{rec['lr']:.2e}", sps=f"{rec['samples_per_s']:.2f}")
            t0, seen, tok = time.time(), 0, 0
        interrupted = stop["signal"] is not None
        if world > 1:
            flag = torch.tensor([float(interrupted)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctrl)
            interrupted = bool(flag.item())
        if done % cfg.ckpt_every == 0 or done == cfg.max_steps or interrupted:
            if not math.isfinite(step_loss.item()):
                raise FloatingPointError(f"non-finite loss at step {done}; not checkpointing it")
            if rank == 0 or cfg.fsdp:
                path = save_checkpoint(run_dir, done, transformer, opt, cfg, cfg.keep_last)
                log(f"checkpoint {path}")
            if world > 1:
                dist.barrier()
        if cfg.val_every and done % cfg.val_every == 0:
            validate(done)
        if interrupted:
            log(f"signal {stop['signal']}: checkpoint written at step {done}, exiting")
            break

    del data_iter, loader  # stop the loader workers now, not mid-batch at interpreter exit
    # ---------------------------------------------------------------- export
    result = dict(run_dir=run_dir, step=step + 1 if cfg.max_steps > start_step else start_step, losses=losses)
    full_state = None
    if cfg.fsdp and not interrupted:  # a collective: rank 0 gets the full weights on CPU, the others {}
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and not interrupted:
        result["weights"] = export_weights(run_dir, transformer, cfg, full_state)
        log(f"exported {result['weights']}")
    del full_state
    if cfg.val_elements and not cfg.val_every and not interrupted:
        validate(cfg.max_steps)
    if metrics_file:
        metrics_file.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main(tyro.cli(TrainConfig))
    sys.exit(0)
