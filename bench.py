"""Time a training step of the A2/Wan transformer at a given shape, with random weights (no download).

    python bench.py --preset tiny --frames 21 --height 64 --width 64            # CPU smoke
    python bench.py --preset 14B --frames 81 --height 480 --width 832 --refs 3 --mode lora   # one H100

Prints the memory plan (a2/memory/memory.py: recomputation, activation offload, fp8 frozen weights, swapped blocks; the
rule's under --memory auto, the flags' otherwise), step time, tokens/s, achieved TFLOP/s, MFU, peak GPU memory and
host memory (resident set, pinned buffers included). --max-memory-gb N plans for an N GB card and caps the CUDA
allocator there for the timed steps (set_per_process_memory_fraction): a smaller card, emulated.

FLOPs (forward, per sample), with L video tokens, Lc = 512 text + 257·refs image tokens, d model dim, f FFN dim,
n layers:
    per layer: self-attn projections 8·L·d² + core 4·L²·d; cross-attn q/o 4·L·d² + text/image k/v 4·Lc·d²
               + core 4·L·Lc·d; FFN 4·L·d·f          (a multiply-add = 2 FLOPs)
    + patch embedding 2·L·(4·in)·d + output 2·L·d·64;
    VACE (--layout vace): its c context blocks are layers too, + their hints' projections (c + 1)·2·L·d² and the
    context's patch embedding 2·L·(4·96)·d.
A2-14B at 81×480×832 with 3 refs: F ≈ 1.70 PFLOP. Model FLOPs per step (recomputation not counted):
full fine-tuning 3·F; LoRA 2·(linear FLOPs) + 3·(attention-core FLOPs) (forward + input gradients only
for the frozen linears, the attention core's backward needs both of its inputs' gradients). HFU adds what
checkpointing recomputes: the forward of each recomputed block, less its self-attention core with --save-attention.
The step is train_a2.py's (a2/train/step.py: model_inputs + forward_loss, the kind's conditioning, its loss,
--align-refs' alignment loss, then optimizer_step: clipping, AdamW, --ema-decay's EMA) on the batch a precompute cache
of the run would hold (a2/train/trace.py synthetic_batch, zero posteriors and tokens): --layout any kind of
a2/kinds/conditioning.py, planned by a2/plan.py as a training run is (bench_plan); the model made trainable by
a2/train/lora.py make_trainable. --layout magref: one CLIP image (the canvas, 257 tokens) of --refs elements, the canvas
a frame of --frames. --layout standin (T2V): + Lr = 1024 reference tokens (Stand-In's 512x512 image, whatever the
video's size) per layer: projections 8·Lr·d², FFN 4·Lr·d·f, reference LoRA 12·Lr·d·r, no cross-attention; cores 4·L·Lr·d
(video queries on reference keys) + 4·Lr²·d (reference on reference); unrestricted attention would add 4·Lr·L·d
(reference queries on video keys).
--align-refs N: RefAlign's alignment loss (a2/kinds/align.py) on N reference latent frames appended after the video (the
phantom kind's tokens, or those of the --layout kind given), its projectors on --align-blocks trained with the run,
and a random DINOv3 ViT of --align-dim (768: ViT-B/16, 1024: ViT-L/16) computing the targets of N reference images
each step (training without a cache); the memory plan counts both. Its cost: against `--align-refs N
--no-align-loss`, the same sequence without the loss.
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a flag typo or a config error answer before the heavy imports below (torch...)
    from a2.cli import exit_on_signal, parse_cli
    from config import BenchConfig

    exit_on_signal("a benchmark keeps nothing; run it again")
    CLI_CONFIG = parse_cli(BenchConfig)

import json
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from a2.cli import run_cli
from a2.config.sections import resolve_compile
from a2.kinds import align
from a2.kinds.conditioning import lora_target, num_latent_frames
from a2.memory.memory import apply_plan, cut_config, memory_plan, proc_bytes, step_shape, use_expandable_segments
from a2.model.transformer import (
    CLIP_TOKENS,
    TEXT_TOKENS,
    preset_config,
    random_transformer,
)
from a2.plan import Run, bench_datasets, bench_plan, preset_info
from a2.train.lora import make_trainable
from a2.train.step import forward_loss, make_optimizer, model_inputs, optimizer_step
from a2.train.trace import align_zeros, dry_run, synthetic_batch, zero_batch
from config import (
    LORA_TARGETS,
    BenchConfig,
    MemoryConfig,
)

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16


def forward_flops(cfg: dict, tokens: int, context: int, ref_tokens: int = 0, rank: int = 0) -> tuple[float, float]:
    """(linear FLOPs, attention-core FLOPs) of one forward pass for one sample (see the module docstring); ref_tokens:
    Stand-In's reference tokens beside the video's, with its reference LoRA of `rank`."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    c = len(cfg.get("vace_layers") or ())  # VACE's context blocks: blocks, each with its hint's projection
    f, n, L, Lc = cfg["ffn_dim"], cfg["num_layers"] + c, tokens, context
    linear = n * (8 * L * d * d + 4 * L * d * d + 4 * Lc * d * d + 4 * L * d * f)
    linear += 2 * L * (4 * cfg["in_channels"]) * d + 2 * L * d * 4 * cfg["out_channels"]
    if c:  # the hints' projections, the first block's of its input, the context's patch embedding
        linear += (c + 1) * 2 * L * d * d + 2 * L * (4 * cfg["vace_in_channels"]) * d
    core = n * (4 * L * L * d + 4 * L * Lc * d)
    Lr = ref_tokens  # (Stand-In is not VACE: n is its layers)
    linear += n * (8 * Lr * d * d + 4 * Lr * d * f + 12 * Lr * d * rank) + 2 * Lr * (4 * cfg["in_channels"]) * d
    core += n * (4 * L * Lr * d + 4 * Lr * Lr * d)
    return float(linear), float(core)


def check_backends(b: BenchConfig) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = {**preset_config(b.preset, e2v=b.refs > 0), "num_layers": 2}
    model = random_transformer(cfg, torch.float32, device)
    torch.manual_seed(0)
    with torch.device(device):
        s = preset_info(b.preset, cfg).vae_scale
        t_lat, h, w = num_latent_frames(b.frames), b.size[0] // s, b.size[1] // s
        x = torch.randn(1, cfg["in_channels"], t_lat, h, w)
        text = torch.randn(1, TEXT_TOKENS, cfg["text_dim"])
        image = torch.randn(1, CLIP_TOKENS * b.refs, cfg["image_dim"]) if b.refs else None
        timestep = torch.full((1,), 500.0)

    def run(backend, bf16):
        model.set_attention_backend(backend)
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(x, timestep, text, encoder_hidden_states_image=image, return_dict=False)[0].float()
        out.pow(2).mean().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    def rel(a, r):
        return ((a - r).norm() / r.norm()).item()

    ref_out, ref_grad = run("native", bf16=False)  # fp32 SDPA: the reference
    res = {}
    for backend in b.other.check_backends:
        out, grad = run(backend, bf16=True)
        res[backend] = dict(out_rel_err=rel(out, ref_out), grad_rel_err=rel(grad, ref_grad))
        print(f"{backend}: output rel err {res[backend]['out_rel_err']:.2e}, grads {res[backend]['grad_rel_err']:.2e}")
    return res


def bench_loader(b: BenchConfig, manifest: str | None = None, dataset_type: str = "e2v") -> dict:
    from a2.data.loader import WorkerContext, collate
    from data import BucketBatchSampler, E2VDataset

    cfgs, frames = bench_datasets(b, manifest, dataset_type)
    dataset = E2VDataset(cfgs, num_frames=frames, verbose=False)
    sampler = BucketBatchSampler(dataset, 1, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=b.num_workers,
                                         multiprocessing_context=WorkerContext() if b.num_workers else None,
                                         persistent_workers=b.num_workers > 0)
    n, t0, epoch = 0, None, 0
    while n < b.timing.warmup + b.timing.steps:
        sampler.set_epoch(epoch)  # the sampler is positional: a new epoch starts its batches again
        epoch += 1
        for batch in loader:
            n, shape = n + 1, tuple(batch["video"].shape)
            if n == b.timing.warmup:
                t0 = time.perf_counter()
            if n == b.timing.warmup + b.timing.steps:
                break
    dt = time.perf_counter() - t0
    del loader  # shut the workers down before exit (a worker killed mid-batch at exit aborts noisily)
    res = dict(data=b.data_root or manifest, shape=f"{b.frames}x{b.size[0]}x{b.size[1]}", num_workers=b.num_workers,
               samples_per_s=b.timing.steps / dt, video=shape)
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return res


def bench_opens2v(b: BenchConfig) -> dict:
    """Index throughput on a synthetic OpenS2V-5M part, then the loader on its index (BenchConfig.opens2v)."""
    from a2.data import public_index

    root = Path(b.opens2v)
    part = public_index.synthetic_part(root, b.clips, Path(__file__).resolve().parent / "tests" / "media" / "hiker.mp4")
    out = root / "index"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    counts = public_index.index_opens2v(public_index.IndexOpenS2V(str(root), str(out), background=False))
    dt = time.perf_counter() - t0
    mb = part.stat().st_size / 2**20
    n = counts["clips read"]
    res = dict(index_clips=n, index_json_mb=mb, index_s=dt, index_clips_per_s=n / dt, index_mb_per_s=mb / dt)
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    few = root / "loader" / "index.jsonl"  # 8 clips with their backgrounds: the loader's checks stay short
    few.parent.mkdir(exist_ok=True)
    public_index.write_index(few.parent, "opens2v", [("total_part1", public_index.opens2v_part(
        part, "total_part1", root, public_index.IndexOpenS2V(str(root), str(few.parent)), {}, limit=8))], "bench")
    res.update(bench_loader(b, str(few), "opens2v"))
    return res


def loop_overhead(run_dir: str, bench_s: float) -> dict:
    """train_a2.py's median s/step (its metrics.jsonl, first logged interval left out: compilation, warm-up) over
    this bare step's: what the real loop (data, conditioning, logging) adds."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    s = statistics.median(r["s_per_step"] for r in rows[1:] or rows)
    print(f"train_a2.py {run_dir}: {s:.3f} s/step vs bench {bench_s:.3f} s/step: loop overhead {s / bench_s - 1:+.1%}")
    return dict(train_s_per_step=s, loop_overhead=s / bench_s - 1)


def bench_dry_run(b: BenchConfig, layers: int | None = None, trace: bool = True, log=print) -> dict:
    """bench.py --dry-run (MemoryConfig.dry_run): a2/train/trace.py's dry run of bench's step, the one train_a2.py
    --dry-run runs. layers: the model cut to this many blocks, planned as the whole (a2/memory/memory.py cut_plan: the
    rule is per block; a quick check). trace False: the plan alone."""
    run, sections, cfg = bench_plan(b)
    cut = cut_config(cfg, layers or cfg["num_layers"])
    # (the target model of --align-refs runs beside the step, not in the trace)
    return dry_run(*sections, b.size, run, lambda run: bench_model(b, run, cut, torch.bfloat16, "cpu").train(),
                   config=cfg if layers else None, align_dim=b.align_dim, log=log, trace=trace)


def bench_model(b: BenchConfig, run: Run, cfg: dict, dtype: torch.dtype, device):
    """The transformer bench's step trains: random weights of `cfg` on `device`, a LoRA's in `dtype`, full fine-tuning
    in fp32 (master weights, bf16 autocast), made trainable as train_a2.py makes it (VACE: its LoRA on the context
    blocks), with --align-refs' projectors (trainable, fp32) on --align-blocks."""
    model = random_transformer(cfg, dtype if b.mode == "lora" else torch.float32, device)
    make_trainable(model, run.layout, b.mode, b.lora_rank, b.lora_rank, target=lora_target(run.layout, LORA_TARGETS))
    if b.align_refs and b.align_loss:
        align.install(model, b.align_dim, [i for i in b.align_blocks if i < cfg["num_layers"]])
        model.to(device)  # (the projectors)
    return model


A2, V3 = dict(preset="14B", refs=3, frames=81), dict(preset="14B", layout="v3", refs=4, frames=121)
P480, P720 = dict(height=480, width=832), dict(height=720, width=1280)
# docs/memory.md's memory table (bench.py --memory-table): (model and shape, BenchConfig fields, GPUs, card GiB); the
# GPUs of a row are one context-parallel group or, with fsdp, the ranks its weights are sharded over
MEMORY_GRID = (
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480), 1, 80),
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480), 1, 48),
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480), 1, 24),
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480), 1, 141),
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480, fsdp=True), 2, 24),
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480, fsdp=True), 4, 24),
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480, fsdp=True, context_parallel=2), 2, 24),
    ("A2-14B LoRA, 3 refs, 81x480x832", dict(A2, **P480, fsdp=True, context_parallel=4), 4, 24),
    ("A2-14B LoRA, 3 refs, 81x720x1280", dict(A2, **P720), 1, 80),
    ("A2-14B LoRA, 3 refs, 81x720x1280", dict(A2, **P720, context_parallel=2), 2, 80),
    ("A2-14B LoRA, 3 refs, 81x720x1280", dict(A2, **P720, context_parallel=4), 4, 80),
    ("A2-14B LoRA, 3 refs, 81x720x1280", dict(A2, **P720, context_parallel=8), 8, 80),
    ("A2-14B LoRA, 3 refs, 81x720x1280", dict(A2, **P720, context_parallel=8), 8, 24),
    ("A2-14B full, 3 refs, 81x480x832", dict(A2, **P480, mode="full", fsdp=True), 8, 80),
    ("A2-14B full, 3 refs, 81x720x1280", dict(A2, **P720, mode="full", fsdp=True, context_parallel=8), 8, 80),
    ("SkyReels-V3 LoRA, 4 refs, 121x480x832", dict(V3, **P480), 1, 80),
    ("SkyReels-V3 LoRA, 4 refs, 121x480x832", dict(V3, **P480, context_parallel=2), 2, 48),
    ("SkyReels-V3 LoRA, 4 refs, 121x720x1280", dict(V3, **P720, context_parallel=4), 4, 141),
    ("SkyReels-V3 LoRA, 4 refs, 121x720x1280", dict(V3, **P720, context_parallel=8), 8, 80),
    ("SkyReels-V3 full, 4 refs, 121x720x1280", dict(V3, **P720, mode="full", fsdp=True, context_parallel=8), 8, 80),
)


def memory_table(b: BenchConfig, traced: dict[int, float] | None = None) -> list[str]:
    """bench.py --memory-table: docs/memory.md's memory table, MEMORY_GRID planned by the rule (a2/memory/memory.py,
    compiled blocks as on CUDA; the plan made on the model cut to 3 blocks, which plans as the whole: the rule is per
    block) and, with --dry-run, each plan traced at full size (a2/train/trace.py: its compiled accounting and exit
    status; minutes a row on a CPU). traced: the dry-run column to print as given, by row (what the README holds: a test
    checks the rest of the table against the rule without tracing)."""
    lines = ["| model, shape | GPUs x GiB | tokens per rank | plan (`--memory auto`, compiled) | rule, GiB | "
             "dry run, GiB | rule - dry run |", "|---|---|---|---|---|---|---|"]
    for i, (name, fields, gpus, card) in enumerate(MEMORY_GRID):
        row = replace(b, **fields, memory=MemoryConfig(max_memory_gb=card, dry_run_ranks=gpus, dry_run=True))
        how = ("FSDP, " if row.fsdp else "") + (f"CP {row.context_parallel}" if row.context_parallel > 1 else "")
        r = bench_dry_run(row, layers=3, trace=False, log=lambda *_: None)
        plan, shape = r["plan"], r["shape"]
        got = (traced or {}).get(i)
        if b.memory.dry_run and got is None:  # (its report on stderr, the table on stdout)
            print(f"row {i + 1}: {name} on {gpus} x {card} GiB {how}", file=sys.stderr)
            full = bench_dry_run(row, log=lambda *a: print(*a, file=sys.stderr))
            got = full["compiled_gb"] if full["compiled_gb"] is not None else full["peak_gb"]
        fits = "DOES NOT FIT" not in plan.why
        lines.append(f"| {name} | {gpus} x {card}{' (' + how.rstrip(', ') + ')' if how else ''} | {shape.tokens:,} | "
                     f"{str(plan).split(':')[0] if fits else 'does not fit'} | {plan.estimate_gb:.2f} | "
                     + (f"{got:.2f} | {plan.estimate_gb / got - 1:+.1%} |" if got is not None else "| |"))
    return lines


def reference_grid(run: Run, h: int, w: int) -> tuple[int, int]:
    """The references' token grid (rows, cols) at h x w pixels: DINOv3's targets are resized to it
    (a2/kinds/align.py)."""
    s, patch = run.info.vae_scale, run.info.patch_size
    return align.reference_spans(run.layout, (h // s // patch[1], w // s // patch[2]), patch)[2]


def align_target(b: BenchConfig, device, dtype):
    """--align-refs: a random DINOv3 ViT-B/16 or ViT-L/16 (4 registers) resident on `device` in `dtype`, as
    train_a2.py holds it; returns dino_targets' target."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    big = b.align_dim == 1024
    config = DINOv3ViTConfig(hidden_size=b.align_dim, intermediate_size=4 * b.align_dim,
                             num_hidden_layers=24 if big else 12, num_attention_heads=16 if big else 12,
                             patch_size=16, num_register_tokens=4)
    with torch.device(device):
        dino = DINOv3ViTModel(config).to(dtype).eval().requires_grad_(False)
    return dino, align.IMAGENET_MEAN, align.IMAGENET_STD


def main(b: BenchConfig) -> dict:
    use_expandable_segments()  # as train_a2.py: before CUDA initialises
    cuda = b.device == "cuda" or b.device == "auto" and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, b.dtype if b.dtype != "auto" else "bfloat16" if cuda else "float32")
    if b.context_parallel > 1 or b.fsdp:
        raise SystemExit("bench.py --context-parallel N and --fsdp go with --dry-run (one rank's plan and trace); time "
                         "them with train_a2.py under torchrun")
    run, (_, _, _, optim, objective, references), cfg = bench_plan(b)
    layout, info = run.layout, run.info
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    # built in place on the device: a LoRA in the compute dtype (a 14B model in fp32, 56 GB, beside its bf16 copy
    # would not fit)
    model = bench_model(b, run, cfg, dtype, device)
    if b.memory.attention_backend:
        model.set_attention_backend(b.memory.attention_backend)
    h, w = b.size
    tokens = info.latent_tokens(layout.model_frames, h, w)  # the input's tokens
    packed = layout.tokens(info, h, w) - tokens  # reference tokens beside them (Stand-In's), 0 for other kinds
    target = None
    if b.align_refs and b.align_loss:  # before the plan: it counts the projectors and the resident target model
        target = align_target(b, device, dtype)
    compile = resolve_compile(b.memory.compile, device.type)
    print(f"{layout.describe()} | blocks {'compiled' if compile else 'eager'}")
    shape = step_shape(layout, info, b.size, b.batch, 1)
    plan = memory_plan(b.memory, model, shape, b.mode == "full", False, device, compile, ema=b.ema_decay > 0)
    print(f"memory: {plan}")
    for line in apply_plan(model, plan, device, compile, b.memory.fp8_matmul):
        print(line)
    fraction, save = plan.checkpoint_fraction, plan.save_attention
    if device.type == "cuda" and b.memory.max_memory_gb:  # a smaller card: the allocator may not go past it now
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        index = torch.cuda.current_device() if device.index is None else device.index  # torch refuses a bare "cuda"
        torch.cuda.set_per_process_memory_fraction(min(1.0, b.memory.max_memory_gb * 2**30 / total), index)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, guard = make_optimizer(optim, params, device)  # the trainer's AdamW, its guard and (--ema-decay) EMA

    # train_a2.py's step on the batch a precompute cache of this run would hold (zero posteriors, text, CLIP tokens)
    batch, enc = synthetic_batch(run, b.batch, h, w)
    # the cache's DINOv3 targets (zeros); with the loss, replaced each step by the target model's
    batch, enc = zero_batch(batch, enc, run, model.config,
                            align_zeros(run, b.batch, h, w, b.align_dim) if b.align_refs else None, device)
    if device.type == "cuda":  # pinned once, as train_a2.py's loader hands a batch over: model_inputs' copies queue
        batch = {k: [p.pin_memory() for p in v] if k == "posteriors" else
                 v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    ref_images = torch.rand(b.batch, len(layout.repeats), 3, h, w, device=device) * 2 - 1
    steps = iter(range(b.timing.warmup + b.timing.steps))

    def step():  # train_a2.py's: model_inputs, forward_loss, backward, optimizer_step
        n = next(steps)
        inputs = model_inputs(batch, n, 0, optim, objective, references, run, enc, 0, device)
        if target:  # the targets from the pixels each step, as train_a2.py without a cache
            with torch.no_grad():
                inputs["align_targets"] = align.dino_targets(target, ref_images, reference_grid(run, h, w))
        loss = forward_loss(model, inputs, objective, references, run, amp, dtype)[0]
        loss.backward()
        optimizer_step(opt, params, guard, loss.detach(), n, optim, 1)
        opt.zero_grad(set_to_none=True)

    for _ in range(b.timing.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss0 = proc_bytes("/proc/self/status", "VmRSS")
    t0 = time.perf_counter()
    for _ in range(b.timing.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt, rss = (time.perf_counter() - t0) / b.timing.steps, proc_bytes("/proc/self/status", "VmRSS")

    linear, core = forward_flops(cfg, tokens, shape.context, packed, b.lora_rank)
    model_flops = b.batch * (3 * (linear + core) if b.mode == "full" else 2 * linear + 3 * core)
    # what the GPU computes on top: the recomputed forward of checkpointed blocks (less their self-attention cores
    # with save_attention); HFU = hardware FLOP utilisation
    recomputed = round(fraction * cfg["num_layers"]) / cfg["num_layers"]
    layers = cfg["num_layers"] + len(cfg.get("vace_layers") or ())  # (VACE's context blocks recomputed alike)
    self_core = layers * 4 * tokens * tokens * cfg["num_attention_heads"] * cfg["attention_head_dim"]
    hardware_flops = model_flops + b.batch * recomputed * (linear + core - (self_core if save else 0))
    tflops = model_flops / dt / 1e12
    peak = b.timing.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    res = dict(preset=b.preset, shape=f"{b.frames}x{b.size[0]}x{b.size[1]}", refs=len(layout.repeats),
               layout=layout.kind, mode=b.mode, tokens=tokens,
               reference_tokens=layout.tokens(info, h, w) - info.latent_tokens(layout.clip_frames, h, w),
               align_loss=bool(target), align_params=sum(p.numel() for p in align.projectors_of(model).parameters())
               if target else 0, forward_pflop=(linear + core) / 1e15, s_per_step=dt,
               tokens_per_s=b.batch * tokens / dt, tflops=tflops, mfu=None if peak is None else tflops / peak,
               hfu=None if peak is None else hardware_flops / dt / 1e12 / peak,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
               host_gb=rss / 2**30, host_step_gb=(rss - rss0) / 2**30, plan=str(plan),
               estimate_gb=plan.estimate_gb,
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    res.update(backend=b.memory.attention_backend or "default", compile=compile, checkpointing=fraction,
               save_attention=save and fraction > 0, offload=plan.offload, swap_blocks=plan.swap_blocks, fp8=plan.fp8,
               ema=b.ema_decay, memory_cap_gb=b.memory.max_memory_gb if device.type == "cuda" else None)
    if b.timing.compare_run:
        res.update(loop_overhead(b.timing.compare_run, dt))
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    if b.timing.out:
        with open(b.timing.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


if __name__ == "__main__":
    b = CLI_CONFIG
    if b.other.memory_table:
        print("\n".join(memory_table(b)))
        raise SystemExit(0)
    if b.memory.dry_run:  # an input mistake (a model, data or size it cannot take): its one line, exit 2
        raise SystemExit(0 if run_cli(bench_dry_run, b)["fits"] else 3)
    run_cli(check_backends if b.other.check_backends else bench_opens2v if b.opens2v else
            bench_loader if b.data_root else main, b)
