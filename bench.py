"""Time a training step of the A2/Wan transformer at a given shape, with random weights (no download).

    python bench.py --preset tiny --frames 21 --height 64 --width 64            # CPU smoke
    python bench.py --preset 14B --frames 81 --height 480 --width 832 --refs 3 --mode lora   # one H100

Prints the memory plan (a2/memory.py: recomputation, activation offload, fp8 frozen weights, swapped blocks; the
rule's under --memory auto, the flags' otherwise), step time, tokens/s, achieved TFLOP/s, MFU, peak GPU memory and
host memory (resident set, pinned buffers included). --max-memory-gb N plans for an N GB card and caps the CUDA
allocator there for the timed steps (set_per_process_memory_fraction): a smaller card, emulated.

FLOPs (forward, per sample), with L video tokens, Lc = 512 text + 257·refs image tokens, d model dim, f FFN dim,
n layers:
    per layer: self-attn projections 8·L·d² + core 4·L²·d; cross-attn q/o 4·L·d² + text/image k/v 4·Lc·d²
               + core 4·L·Lc·d; FFN 4·L·d·f          (a multiply-add = 2 FLOPs)
    + patch embedding 2·L·(4·in)·d + output 2·L·d·64.
A2-14B at 81×480×832 with 3 refs: F ≈ 1.70 PFLOP. Model FLOPs per step (recomputation not counted):
full fine-tuning 3·F; LoRA 2·(linear FLOPs) + 3·(attention-core FLOPs) (forward + input gradients only
for the frozen linears, the attention core's backward needs both of its inputs' gradients). HFU adds what
checkpointing recomputes: the forward of each recomputed block, less its self-attention core with --save-attention.
--layout magref: one CLIP image (the canvas, 257 tokens) whatever --refs, the canvas a frame of --frames.
--layout standin (T2V): + Lr = 1024 reference tokens (Stand-In's 512x512 image, whatever the video's size) per
layer: projections 8·Lr·d², FFN 4·Lr·d·f, reference LoRA 12·Lr·d·r, no cross-attention; cores 4·L·Lr·d (video queries
on reference keys) + 4·Lr²·d (reference on reference); unrestricted attention would add 4·Lr·L·d (reference queries
on video keys).
--align-refs N: RefAlign's alignment loss (a2/align.py) on N reference latent frames appended after the video (the
phantom layout's tokens), its projectors on --align-blocks trained with the run, and a random DINOv3 ViT of
--align-dim (768: ViT-B/16, 1024: ViT-L/16) computing the targets of N reference images each step (training without
a cache); the memory plan counts both. Its cost: against `--align-refs N --no-align-loss`, the same sequence without
the loss.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from a2 import align, conditioning
from a2.memory import MemoryPlan, apply_plan, plan_for_model, use_expandable_segments
from a2.transformer import CLIP_TOKENS, TEXT_TOKENS, TI2V_Z_DIM, preset_config, random_transformer
from config import OnOffAuto, exit_on_signal, height_width, resolve_compile, run_cli

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16


@dataclass
class BenchConfig:
    """Time a training step (or the data loader) at a real shape with random weights."""

    preset: Literal["tiny", "1.3B", "14B", "5B"] = "tiny"
    """Transformer size: tiny (tests), Wan 1.3B, Wan/A2 14B, or Wan 2.2 TI2V 5B (random weights, no download)."""
    frames: Annotated[int, tyro.conf.arg(aliases=("--num-frames",))] = 21
    """Pixel frames of the whole sequence (4k+1), reference frames included (train_a2.py/infer.py: --num-frames)."""
    height: int | None = None
    """Video height in pixels, a multiple of 16 (default 64)."""
    width: int | None = None
    """Video width in pixels, a multiple of 16 (default 64)."""
    resolution: tuple[int, int] | None = None
    """(height, width) in pixels, train_a2.py's name for --height H --width W (give one form or the other)."""
    refs: int = 3
    """Number of reference images (CLIP tokens 257 each); 0 for T2V."""
    layout: Literal["default", "magref", "standin"] = "default"
    """default: A2's (--refs CLIP images; the reference frames are part of --frames); magref: MAGREF's canvas, one
    CLIP image; standin: Stand-In on T2V, one reference's tokens appended, its reference LoRA (rank --lora-rank)
    trained instead of a peft LoRA (a2/conditioning.py's kinds)."""
    mode: Annotated[Literal["lora", "full"], tyro.conf.arg(aliases=("--training-type",))] = "lora"
    """lora: LoRA on the frozen transformer; full: all weights train (fp32 master weights, bf16 autocast)."""
    lora_rank: int = 32
    """LoRA rank r (alpha = r)."""
    batch: Annotated[int, tyro.conf.arg(aliases=("--micro-batch",))] = 1
    """Samples per forward (train_a2.py: --micro-batch)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: the GPU when there is one."""
    memory: Literal["auto", "manual"] = "auto"
    """auto (CUDA): recomputation planned by train_a2.py's rule (a2/memory.py), so the figures are the defaults';
    manual, and on the CPU: the three flags below."""
    max_memory_gb: float | None = None
    """Emulate a smaller card: --memory auto plans for this many GB instead of the free memory, and the CUDA
    allocator is capped there for the timed steps (torch.cuda.set_per_process_memory_fraction)."""
    gradient_checkpointing: bool = False
    """Recompute transformer blocks in backward (--checkpoint-fraction of them)."""
    checkpoint_fraction: float = 1.0
    """Fraction of blocks recomputed when gradient_checkpointing (a2.transformer.configure_blocks)."""
    save_attention: bool = False
    """Selective checkpointing: recomputed blocks keep their self-attention outputs."""
    offload_activations: bool = False
    """What recomputed blocks keep for backward goes to pinned host memory (a2/offload.py); forced on under auto."""
    swap_blocks: int = 0
    """LoRA: this many blocks' frozen weights live in pinned host memory (a2/offload.py); a minimum under auto."""
    fp8_base: bool = False
    """LoRA: frozen block linears stored as float8 e4m3 with per-channel scales (a2/fp8.py); forced on under auto."""
    fp8_matmul: bool = False
    """With fp8 base weights on an H100: fp8 x fp8 forward matmuls (torch._scaled_mm)."""
    compile: OnOffAuto = None
    """torch.compile the transformer blocks (regional compilation); default: on with CUDA, off on the CPU (as
    train_a2.py); --compile False: eager."""
    attention_backend: str | None = None
    """diffusers attention backend (e.g. native, _native_cudnn, _native_flash, flash, _flash_3)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16" if torch.cuda.is_available() else "float32"
    """Compute dtype (bfloat16: autocast; frozen LoRA base weights are stored in it)."""
    steps: int = 5
    """Timed training steps (loader: timed samples)."""
    warmup: int = 2
    """Untimed steps first (compilation, allocator warmup)."""
    out: str | None = None
    """Append the result as one JSON line to this file."""
    data_root: str | None = None
    """Instead of the transformer: time the data loader (decode, frame sampling, resize, element images) over this
    E2V dataset dir at frames x height x width, A2's elements; samples/s over `steps` samples after `warmup`."""
    num_workers: int = 0
    """--data-root / --opens2v: DataLoader worker processes."""
    opens2v: str | None = None
    """Instead of the transformer: build a synthetic OpenS2V-5M layout in this dir (../shared/data's hiker.mp4 looped
    to 81 frames at 1280x720 with a2_human.png composited under a known mask, --clips records in one part JSON of the
    published schema), time `data.py index opens2v` on it (clips/s, MB/s of JSON), then the loader on 8 of its clips
    at frames x height x width (samples/s, element images built from the RLE masks on the fly)."""
    clips: int = 20000
    """--opens2v: records in the part JSON."""
    check_backends: tuple[str, ...] = ()
    """Instead of timing: relative L2 error of the output and the gradients under bf16 autocast with each of these
    attention backends against an fp32 reference, on the preset cut to 2 blocks (does the fast kernel train right?)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of the device for MFU (default: looked up from the GPU name; none on CPU)."""
    dry_run: bool = False
    """Instead of timing: build the model at real size on fake tensors (no GPU, no weights), plan and apply its
    memory as on a GPU, trace two eager training steps' live bytes (a2/trace.py), print the device peak by
    category beside the plan's estimate; exit 0 if it fits --max-memory-gb (default 80), 3 if not."""
    context_parallel: int = 1
    """With --dry-run: one rank of a context-parallel group of N (a2/parallel.py, emulated in one process): the plan
    and the trace at its share of the tokens (the whole sequence for heads / N in self-attention), and the rank's
    attention FLOPs and all-to-all bytes per block. (The timed step is one process: time CP under torchrun with
    train_a2.py --context-parallel N.)"""
    align_refs: int = 0
    """Reference latent frames appended after the video (Phantom's layout: their tokens are in the sequence), 0: none
    (see the module docstring)."""
    align_loss: bool = True
    """With --align-refs: add RefAlign's alignment loss (projectors + DINOv3 targets); False: the same sequence
    without it, the baseline of its cost."""
    align_dim: Literal[768, 1024] = 768
    """Width of the random DINOv3 target model: 768 ViT-B/16 (RefAlign's for 1.3B), 1024 ViT-L/16 (for 14B)."""
    align_blocks: tuple[int, ...] = tuple(range(9))
    """Blocks whose reference tokens are aligned (RefAlign: the first nine; a tiny preset has fewer, clipped)."""
    compare_run: str | None = None
    """A train_a2.py run dir at the same shape and settings: also print its median s/step (metrics.jsonl, after
    the first logged interval) against this step's, as the training loop's overhead over the bare step."""

    def __post_init__(self):
        self.height, self.width = height_width(self.height, self.width, self.resolution, (64, 64))
        self.resolution = (self.height, self.width)


def host_rss() -> float:
    """This process's resident host memory in bytes (pinned buffers of offload and block swap included)."""
    with open("/proc/self/status") as f:
        return next(float(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def vae_scale(cfg: dict) -> int:
    """Spatial compression of the VAE a preset's latents come from: Wan 2.2's 48-channel VAE (5B) 16, else 8."""
    return 16 if cfg["out_channels"] == TI2V_Z_DIM else 8


def forward_flops(cfg: dict, tokens: int, context: int) -> tuple[float, float]:
    """(linear FLOPs, attention-core FLOPs) of one forward pass for one sample (see the module docstring)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    f, n, L, Lc = cfg["ffn_dim"], cfg["num_layers"], tokens, context
    linear = n * (8 * L * d * d + 4 * L * d * d + 4 * Lc * d * d + 4 * L * d * f)
    linear += 2 * L * (4 * cfg["in_channels"]) * d + 2 * L * d * 4 * cfg["out_channels"]
    core = n * (4 * L * L * d + 4 * L * Lc * d)
    return float(linear), float(core)


def standin_flops(cfg: dict, tokens: int, ref_tokens: int, rank: int) -> tuple[float, float]:
    """(linear, attention-core) FLOPs Stand-In's reference tokens add to one forward (module docstring)."""
    d, f, n, L, Lr = (cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"], cfg["num_layers"],
                      tokens, ref_tokens)
    linear = n * (8 * Lr * d * d + 4 * Lr * d * f + 12 * Lr * d * rank) + 2 * Lr * (4 * cfg["in_channels"]) * d
    return float(linear), float(n * (4 * L * Lr * d + 4 * Lr * Lr * d))


def check_backends(b: BenchConfig) -> dict:
    from diffusers import WanTransformer3DModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = {**preset_config(b.preset, e2v=b.refs > 0), "num_layers": 2}
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**cfg)
        t_lat, h, w = (b.frames - 1) // 4 + 1, b.height // vae_scale(cfg), b.width // vae_scale(cfg)
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
    for backend in b.check_backends:
        out, grad = run(backend, bf16=True)
        res[backend] = dict(out_rel_err=rel(out, ref_out), grad_rel_err=rel(grad, ref_grad))
        print(f"{backend}: output rel err {res[backend]['out_rel_err']:.2e}, grads {res[backend]['grad_rel_err']:.2e}")
    return res


def bench_loader(b: BenchConfig, manifest: str | None = None, dataset_type: str = "e2v") -> dict:
    from a2.conditioning import clip_frames
    from config import A2_ELEMENTS, ClipProcessorConfig, DatasetConfig, VaeProcessorConfig
    from data import BucketBatchSampler, E2VDataset, WorkerContext, collate

    size = (b.height, b.width)
    cfg = DatasetConfig(data_root=b.data_root or str(Path(manifest).parent), target_resolution=size, frame_buckets=(),
                        elements=A2_ELEMENTS, vae=VaeProcessorConfig(resolution=size), manifest=manifest,
                        dataset_type=dataset_type, clip=ClipProcessorConfig(resolution=(512, 512)))
    # a public dataset's clip is what A2's reference latents leave of --frames (81 -> 69), as train_a2.py reads it
    frames = clip_frames(b.frames, cfg.elements, cfg.vae) if manifest else b.frames
    dataset = E2VDataset([cfg], num_frames=frames, verbose=False)
    sampler = BucketBatchSampler(dataset, 1, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=b.num_workers,
                                         multiprocessing_context=WorkerContext() if b.num_workers else None,
                                         persistent_workers=b.num_workers > 0)
    n, t0, epoch = 0, None, 0
    while n < b.warmup + b.steps:
        sampler.set_epoch(epoch)  # the sampler is positional: a new epoch starts its batches again
        epoch += 1
        for batch in loader:
            n, shape = n + 1, tuple(batch["video"].shape)
            if n == b.warmup:
                t0 = time.perf_counter()
            if n == b.warmup + b.steps:
                break
    dt = time.perf_counter() - t0
    del loader  # shut the workers down before exit (a worker killed mid-batch at exit aborts noisily)
    res = dict(data=b.data_root or manifest, shape=f"{b.frames}x{b.height}x{b.width}", num_workers=b.num_workers,
               samples_per_s=b.steps / dt, video=shape)
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return res


def bench_opens2v(b: BenchConfig) -> dict:
    """Index throughput on a synthetic OpenS2V-5M part, then the loader on its index (BenchConfig.opens2v)."""
    import shutil

    import numpy as np
    from PIL import Image

    from a2 import public_data
    from a2.images import read_image
    from data import read_frames

    root, shared = Path(b.opens2v), Path(__file__).resolve().parent.parent / "shared" / "data"
    part = root / "Jsons" / "mask_and_bbox_High-Quality" / "total_part1.json"
    if not part.is_file():
        hiker = read_frames(shared / "hiker.mp4", [i if (i // 48) % 2 == 0 else 48 - i % 48 for i in range(81)])
        frames = np.stack([np.asarray(Image.fromarray(f).resize((1280, 720))) for f in hiker])  # OpenS2V is 720p
        fx = public_data.synthetic_opens2v(root, frames, np.asarray(read_image(shared / "a2_human.png")))
        rec = next(iter(fx["records"].values()))
        bg = next((root / "Background" / "total_part1").glob("*.png"))
        keys = [f"clip{i:06d}_part1_step6" for i in range(b.clips)]
        public_data.write_part(part, ((k, rec) for k in keys))
        for k in keys[:8]:  # the loader's clips need their background png
            shutil.copy(bg, bg.with_name(f"{k}.png"))
    out = root / "index"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    counts = public_data.index_opens2v(public_data.IndexOpenS2V(str(root), str(out), background=False))
    dt = time.perf_counter() - t0
    mb = part.stat().st_size / 2**20
    n = counts["clips read"]
    res = dict(index_clips=n, index_json_mb=mb, index_s=dt, index_clips_per_s=n / dt, index_mb_per_s=mb / dt)
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    few = root / "loader" / "index.jsonl"  # 8 clips with their backgrounds: the loader's checks stay short
    few.parent.mkdir(exist_ok=True)
    public_data.write_index(few.parent, "opens2v", [("total_part1", public_data.opens2v_part(
        part, "total_part1", root, public_data.IndexOpenS2V(str(root), str(few.parent)), {}, limit=8))], "bench")
    res.update(bench_loader(b, str(few), "opens2v"))
    return res


def loop_overhead(run_dir: str, bench_s: float) -> dict:
    """train_a2.py's median s/step (its metrics.jsonl, first logged interval left out: compilation, warm-up) over
    this bare step's: what the real loop (data, conditioning, logging) adds."""
    import statistics
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    s = statistics.median(r["s_per_step"] for r in rows[1:] or rows)
    print(f"train_a2.py {run_dir}: {s:.3f} s/step vs bench {bench_s:.3f} s/step: loop overhead {s / bench_s - 1:+.1%}")
    return dict(train_s_per_step=s, loop_overhead=s / bench_s - 1)


def dry_run(b: BenchConfig, layers: int | None = None) -> dict:
    """bench.py --dry-run (BenchConfig.dry_run): the plan of the whole model at the real token count, traced
    (a2/trace.py) on the model with `layers` blocks (default all; fewer: the plan's per-block choices carried over,
    a2/memory.py cut_plan, and the estimate the cut plan's, since the rule is per block). b.compile as the GPU run
    resolves it (None: on, as on CUDA): the plan is the compiled step's and the traced (eager) peak is also given in
    the compiled accounting (a2/trace.py compiled_peak). Returns the plan, the traced plan, the tracer, the traced
    model's estimates (GPU, pinned host), the compiled accounting (or None) and whether it fits the card."""
    from a2.memory import cut_plan, model_bytes, plan_memory, step_estimate
    from a2.trace import compiled_peak, report
    from a2.trace import dry_run as trace_dry_run

    cfg = preset_config(b.preset, e2v=b.refs > 0)
    n = cfg["num_layers"]
    cut = {**cfg, "num_layers": layers or n}
    compile = resolve_compile(b.compile, "cuda")  # as the GPU run resolves it
    budget = b.max_memory_gb or 80.0
    t_lat, h, w = (b.frames - 1) // 4 + 1, b.height // vae_scale(cfg), b.width // vae_scale(cfg)
    tokens = b.batch * t_lat * (h // 2) * (w // 2)
    cp = b.context_parallel
    if cp > 1:  # one rank's share: what it plans for and keeps
        from a2.parallel import step_costs

        costs = step_costs(cfg, tokens // b.batch, TEXT_TOKENS + CLIP_TOKENS * b.refs, cp)
        tokens = b.batch * costs["tokens"]
        print(f"context parallel {cp}: {tokens} tokens per rank; per rank forward attention cores "
              f"{b.batch * (costs['self_core'] + costs['cross_core']) / 1e12:.1f} TFLOP, all-to-all per block "
              f"{b.batch * costs['all_to_all_forward'] / 2**20:.0f} MiB forward + "
              f"{b.batch * costs['all_to_all_backward'] / 2**20:.0f} MiB backward (+ the forward's again per "
              "recomputed block)")
    full = b.mode == "full"
    got = {}

    def build():
        model = random_transformer(cut, torch.float32 if full else torch.bfloat16, "cpu")
        if not full:
            from peft import LoraConfig

            from config import LORA_TARGETS

            model.requires_grad_(False)
            model.add_adapter(LoraConfig(r=b.lora_rank, lora_alpha=b.lora_rank, target_modules=LORA_TARGETS))
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        if cp > 1:
            from a2.parallel import context_parallel

            context_parallel(model, None, cp)
        model.train()
        return model

    def plan_for(model):
        got["bytes"] = model_bytes(model, full, False)  # the traced model's, for its estimate
        if b.memory == "manual":
            plan = MemoryPlan(b.checkpoint_fraction if b.gradient_checkpointing else 0.0, b.save_attention, None,
                              None, "the flags", b.offload_activations, b.swap_blocks, b.fp8_base)
        else:  # the host is the GPU machine's, not this one's: what the plan pins is printed (report)
            plan = plan_memory(cfg, tokens, budget * 2**30, model_bytes(model, full, False, layers=n), float("inf"),
                               fp8=b.fp8_base, offload=b.offload_activations, swap_blocks=b.swap_blocks,
                               compile=compile)
        got["plan"] = plan
        return cut_plan(plan, n, cut["num_layers"])

    def forward(model):
        x = torch.zeros(b.batch, cfg["in_channels"], t_lat, h, w)
        text = torch.zeros(b.batch, TEXT_TOKENS, cfg["text_dim"])
        image = torch.zeros(b.batch, CLIP_TOKENS * b.refs, cfg["image_dim"]) if b.refs else None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, torch.full((b.batch,), 500.0), text, encoder_hidden_states_image=image,
                        return_dict=False)[0]
        return out.float().pow(2).mean()

    tracer, traced = trace_dry_run(build, plan_for, forward)
    k = round(traced.checkpoint_fraction * cut["num_layers"])
    estimate, host = (x / 2**30 for x in step_estimate(cut, tokens, got["bytes"], k, traced.save_attention,
                                                        traced.offload, traced.fp8, traced.swap_blocks, compile))
    compiled = compiled_peak(tracer, cut, tokens, cut["num_layers"] - k) / 2**30 if compile else None
    print(f"memory: {got['plan']}" + (f"\n  traced with {cut['num_layers']} blocks: {traced.swap_blocks} swapped, "
                                      f"~{estimate:.2f} GiB estimated" if layers else ""))
    lines, fits = report(tracer, traced, budget, estimate, compiled)
    print("\n".join(lines))
    return dict(plan=got["plan"], traced_plan=traced, tracer=tracer, estimate_gb=estimate, host_gb=host,
                compiled_gb=compiled, fits=fits)


def align_target(b: BenchConfig, cfg: dict, model, device, dtype):
    """--align-refs: the projectors installed on `model` (trainable, fp32) and a random DINOv3 ViT-B/16 or ViT-L/16
    (4 registers) resident on `device` in `dtype`, as train_a2.py holds them; returns dino_targets' target."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    blocks = [i for i in b.align_blocks if i < cfg["num_layers"]]
    align.install(model, b.align_dim, blocks)
    model.to(device)  # (the projectors; the transformer is placed by the plan, it is there already or moved there)
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
    dtype = getattr(torch, b.dtype)
    if b.context_parallel > 1:
        raise SystemExit("bench.py --context-parallel N goes with --dry-run (one rank's plan and trace); time a CP "
                         "step with train_a2.py --context-parallel N under torchrun")
    standin = b.layout == "standin"
    refs = 0 if standin else 1 if b.layout == "magref" else b.refs  # CLIP images
    cfg = preset_config(b.preset, e2v=refs > 0)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    # built in place on the device: LoRA in the compute dtype (a 14B model in fp32, 56 GB, beside its bf16 copy
    # would not fit), full fine-tuning in fp32 (master weights, bf16 autocast)
    model = random_transformer(cfg, dtype if b.mode == "lora" else torch.float32, device)
    if b.attention_backend:
        model.set_attention_backend(b.attention_backend)
    if standin:  # train_a2.py's: Stand-In's processors, its forward and reference LoRA (the LoRA run's weights)
        from a2.conditioning import kind_weights, make_layout, prepare_model

        layout = make_layout("standin", b.frames, (1,))
        prepare_model(model, layout, b.lora_rank)
    if b.mode == "lora":
        from peft import LoraConfig

        from config import LORA_TARGETS

        model.requires_grad_(False)
        if standin:
            for p in kind_weights(model, layout):
                p.requires_grad_(True)
        else:
            model.add_adapter(LoraConfig(r=b.lora_rank, lora_alpha=b.lora_rank, target_modules=LORA_TARGETS))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    t_lat, h, w = (b.frames - 1) // 4 + 1, b.height // vae_scale(cfg), b.width // vae_scale(cfg)
    tokens = (t_lat + b.align_refs) * (h // 2) * (w // 2)
    target = None
    if b.align_refs and b.align_loss:  # before the plan: it counts the projectors and the resident target model
        target = align_target(b, cfg, model, device, dtype)
    compile = resolve_compile(b.compile, device.type)
    print(f"blocks {'compiled' if compile else 'eager'}")
    forced = dict(fp8=b.fp8_base, offload=b.offload_activations, swap_blocks=b.swap_blocks, compile=compile)
    if b.memory == "auto" and device.type == "cuda":
        plan = plan_for_model(model, b.batch * tokens, b.max_memory_gb, b.mode == "full", False, device, **forced)
    else:
        plan = MemoryPlan(b.checkpoint_fraction if b.gradient_checkpointing else 0.0, b.save_attention, None, None,
                          "the flags", b.offload_activations, b.swap_blocks, b.fp8_base)
    print(f"memory: {plan}")
    for line in apply_plan(model, plan, device, compile, b.fp8_matmul):
        print(line)
    fraction, save = plan.checkpoint_fraction, plan.save_attention
    if device.type == "cuda" and b.max_memory_gb:  # a smaller card: the allocator may not go past it from here on
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, b.max_memory_gb * 2**30 / total), device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")

    context = TEXT_TOKENS + CLIP_TOKENS * refs
    x = torch.randn(b.batch, cfg["in_channels"], t_lat + b.align_refs, h, w, device=device)
    if standin:  # + the reference latent, packed as a2/conditioning.py's model_input packs it
        from a2.standin import pack_reference

        x = pack_reference(x, torch.randn(b.batch, cfg["in_channels"], 1, *layout.reference_grid, device=device))
    text = torch.randn(b.batch, TEXT_TOKENS, cfg["text_dim"], device=device)
    image = torch.randn(b.batch, CLIP_TOKENS * refs, cfg["image_dim"], device=device) if refs else None
    velocity = torch.randn(b.batch, cfg["out_channels"], t_lat + b.align_refs, h, w, device=device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    ref_images = torch.rand(b.batch, b.align_refs, 3, b.height, b.width, device=device) * 2 - 1
    sigmas = torch.full((b.batch,), 0.5, device=device)
    phantom = conditioning.make_layout("phantom", b.frames, (1,) * max(1, b.align_refs))
    spans = align.reference_spans(phantom, (h // 2, w // 2)) if target else None

    def step():
        with amp, (align.capture(model, spans[:2]) if target else nullcontext()) as features:
            out = model(x, torch.full((b.batch,), 500.0, device=device), text, encoder_hidden_states_image=image,
                        return_dict=False)[0]
        loss = (out.float() - velocity).pow(2).mean()
        if target:  # the targets from the pixels each step, as train_a2.py without a cache
            loss = loss + align.align_loss(features, align.dino_targets(target, ref_images, spans[2]), sigmas,
                                           torch.ones_like(sigmas))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(b.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss0 = host_rss()
    t0 = time.perf_counter()
    for _ in range(b.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / b.steps

    linear, core = forward_flops(cfg, tokens, context)
    ref_tokens = (layout.reference_grid[0] // 2) * (layout.reference_grid[1] // 2) if standin else 0
    if standin:
        extra = standin_flops(cfg, tokens, ref_tokens, b.lora_rank)
        linear, core = linear + extra[0], core + extra[1]
    model_flops = b.batch * (3 * (linear + core) if b.mode == "full" else 2 * linear + 3 * core)
    # what the GPU computes on top: the recomputed forward of checkpointed blocks (less their self-attention cores
    # with save_attention); HFU = hardware FLOP utilisation
    recomputed = round(fraction * cfg["num_layers"]) / cfg["num_layers"]
    self_core = cfg["num_layers"] * 4 * tokens * tokens * cfg["num_attention_heads"] * cfg["attention_head_dim"]
    hardware_flops = model_flops + b.batch * recomputed * (linear + core - (self_core if save else 0))
    tflops = model_flops / dt / 1e12
    peak = b.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    res = dict(preset=b.preset, shape=f"{b.frames}x{b.height}x{b.width}", refs=refs, layout=b.layout, mode=b.mode,
               tokens=tokens, reference_tokens=ref_tokens or b.align_refs * (h // 2) * (w // 2),
               align_loss=bool(target), align_params=sum(p.numel() for p in align.projectors_of(model).parameters())
               if target else 0, forward_pflop=(linear + core) / 1e15, s_per_step=dt,
               tokens_per_s=b.batch * tokens / dt, tflops=tflops, mfu=None if peak is None else tflops / peak,
               hfu=None if peak is None else hardware_flops / dt / 1e12 / peak,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
               host_gb=host_rss() / 2**30, host_step_gb=(host_rss() - rss0) / 2**30, plan=str(plan),
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    res.update(backend=b.attention_backend or "default", compile=compile, checkpointing=fraction,
               save_attention=save and fraction > 0, offload=plan.offload, swap_blocks=plan.swap_blocks, fp8=plan.fp8,
               memory_cap_gb=b.max_memory_gb if device.type == "cuda" else None)
    if b.compare_run:
        res.update(loop_overhead(b.compare_run, dt))
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    if b.out:
        with open(b.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


if __name__ == "__main__":
    exit_on_signal("a benchmark keeps nothing; run it again")
    b = tyro.cli(BenchConfig)
    if b.dry_run:  # an input mistake (a model, data or size it cannot take): its one line, exit 2
        raise SystemExit(0 if run_cli(dry_run, b)["fits"] else 3)
    run_cli(check_backends if b.check_backends else bench_opens2v if b.opens2v else bench_loader if b.data_root else
            main, b)
