"""The CUDA tier (marked gpu; skipped where there is no GPU): every training path users run, on the GPU in bf16.

FSDP2 full fine-tuning and LoRA (1 rank) against DDP-style training with recomputation, selective recomputation and
compilation; LoRA; Wan VACE's LoRA, over fp8 base weights too; precompute + cached training; validation videos;
resume after SIGTERM; infer.py; a real-size (random-weight) model through train_a2.py's own loop with the --memory
auto plan. Tolerances are bf16's: two runs that differ only in how the work is split (sharded vs not) agree to ~1e-2
relative in the loss, not bit for bit."""

import signal

import pytest
import torch
from safetensors.torch import load_file

from a2.train.runs import EXIT_RESUMABLE
from tests.conftest import args as cpu_args
from tests.conftest import launch, losses, max_diff, params, train, wait_for

pytestmark = pytest.mark.gpu


def args(*a, **k):
    return cpu_args(*a, **k, device="cuda")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("data") / "e2v", num_samples=4, num_frames=17,
                                  size=(64, 64))


def close(a: dict, b: dict, rel: float) -> bool:
    return sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in a)


FULL = ("--training-type", "full", "--max-steps", "4", "--lr", "1e-4", "--memory", "manual")


@pytest.mark.parametrize("blocks", [(), ("--save-attention",), ("--compile",), ("--compile", "--save-attention")],
                         ids=["checkpointing", "save-attention", "compile", "compile+save-attention"])
def test_fsdp_full_finetune_in_bf16_matches_ddp(data_dir, tmp_path, blocks):
    """The recompute must see the dtypes the forward saw: FSDP2 casts, fp32-kept modules and autocast all meet
    checkpointing here (it failed in the first backward before)."""
    fsdp = train(*args(data_dir, tmp_path, "fsdp", *FULL, "--fsdp", *blocks))
    ddp = train(*args(data_dir, tmp_path, "ddp", *FULL, *blocks))
    a, b = losses(fsdp["run_dir"]), losses(ddp["run_dir"])
    print(blocks, a, b)
    assert all(torch.isfinite(torch.tensor(v)) for v in a.values())
    assert close(a, b, 2e-2), (a, b)
    assert (fsdp["run_dir"] / "transformer").is_dir()


@pytest.mark.parametrize("blocks", [(), ("--compile",)], ids=["eager", "compile"])
def test_fsdp_lora_in_bf16_matches_ddp(data_dir, tmp_path, blocks):
    """--fsdp on a LoRA (the frozen base sharded, here over one rank; the adapter fp32, computed in bf16) trains as the
    unsharded run does on the GPU, within bf16's rounding, and exports the same files."""
    steps = ("--max-steps", "4", "--lr", "1e-3", "--lora-alpha", "32", "--memory", "manual", *blocks)
    fsdp = train(*args(data_dir, tmp_path, "fsdp", *steps, "--fsdp"))
    ddp = train(*args(data_dir, tmp_path, "ddp", *steps))
    a, b = losses(fsdp["run_dir"]), losses(ddp["run_dir"])
    print(blocks, a, b)
    assert all(v == v for v in a.values()) and close(a, b, 2e-2), (a, b)
    assert load_file(fsdp["weights"]).keys() == load_file(ddp["weights"]).keys()


def test_vace_lora_over_fp8_base_trains_and_infers(data_dir, tmp_path):
    """Wan VACE on the GPU: its LoRA on the context blocks (the default) trains in bf16, compiled and recomputed, and
    with --fp8-base (which stores the context blocks' frozen linears in fp8 too) within 10% of that; infer.py samples
    the model with the LoRA, and the LoRA changes the video."""
    import infer

    steps = ("--model", "tiny-vace", "--num-frames", "17", "--max-steps", "4", "--lr", "5e-2", "--warmup-steps", "0",
             "--compile", "--memory", "manual")
    bf16 = train(*args(data_dir, tmp_path, "vace", *steps))
    fp8 = losses(train(*args(data_dir, tmp_path, "vace-fp8", *steps, "--fp8-base"))["run_dir"])
    ref = losses(bf16["run_dir"])
    print(fp8, ref)
    assert all(v == v for v in ref.values()) and close(fp8, ref, 0.1), (fp8, ref)
    base = dict(model="tiny-vace", elements=(str(data_dir / "000_person.png"),), height=64, width=64,
                num_frames=17, steps=3, device="cuda", dtype="bfloat16")
    infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "plain.pt")))
    # the LoRA changes the output
    assert infer.main(infer.InferConfig.from_flags(**base, lora=str(bf16["weights"]), out=str(tmp_path / "lora.mp4"),
                                                   compare=str(tmp_path / "plain.pt"))) == 1


def test_lora_bf16_trains_and_infers(data_dir, tmp_path, tiny_dir):
    import infer

    r = train(*args(data_dir, tmp_path, "lora", "--max-steps", "6", "--lr", "5e-2", "--warmup-steps", "0",
                    model=tiny_dir))
    per_step = losses(r["run_dir"])
    assert len(per_step) == 6 and all(v == v for v in per_step.values())
    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    out = tmp_path / "lora.mp4"
    base = dict(model=str(tiny_dir), elements=els, height=64, width=64, num_frames=21, steps=3, device="cuda",
                dtype="bfloat16")
    infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "plain.pt")))
    # the LoRA changes the output
    assert infer.main(infer.InferConfig.from_flags(**base, lora=str(r["weights"]), out=str(out),
                                                   compare=str(tmp_path / "plain.pt"))) == 1
    import imageio.v3 as iio

    assert iio.imread(out).shape[1] == 64  # frames of the generated height (references beside them)


def test_precompute_then_cached_training(data_dir, tmp_path):
    cache = tmp_path / "cache"
    steps = ("--max-steps", "3")
    raw = train(*args(data_dir, tmp_path, "raw", *steps))
    train(*args(data_dir, tmp_path, "pre", "--cache-dir", str(cache), "--precompute"))
    cached = train(*args(data_dir, tmp_path, "cached", "--cache-dir", str(cache), *steps))
    a, b = losses(cached["run_dir"]), losses(raw["run_dir"])
    assert close(a, b, 1e-3), (a, b)  # the same posteriors and draws; GPU kernels may reorder sums


def test_validation_video(data_dir, tmp_path):
    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    r = train(*args(data_dir, tmp_path, "val", "--max-steps", "2", "--val-every", "2", "--val-steps", "3",
                    "--val-elements", *els))
    assert (r["run_dir"] / "samples" / "step-0000002.mp4").stat().st_size > 0


def test_resume_after_sigterm_on_cuda(data_dir, tmp_path):
    total, run = 6, tmp_path / "cut"
    p = launch(args(data_dir, tmp_path, "cut", "--max-steps", "1000", "--ckpt-every", "2"))
    wait_for(lambda: (run / "metrics.jsonl").exists() and len(losses(run)) >= 2, p, timeout=600)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == EXIT_RESUMABLE and "(resumable" in out, out[-3000:]
    train(*args(data_dir, tmp_path, "cut", "--max-steps", str(total), "--ckpt-every", "2", "--resume", "auto"))
    ref = train(*args(data_dir, tmp_path, "full", "--max-steps", str(total), "--ckpt-every", "2"))
    assert close(losses(run), losses(ref["run_dir"]), 1e-3)
    assert max_diff(params(run / f"ckpt-{total:07d}"), params(ref["run_dir"] / f"ckpt-{total:07d}")) <= 1e-3


def test_real_size_model_through_the_training_loop(tmp_path, capsys):
    """random-1.3B: Wan2.1-T2V-1.3B's shape with random weights, built on the GPU, trained by train_a2.py's own
    loop (LoRA, bf16) with the --memory auto plan printed."""
    from data import make_synthetic_dataset

    data = make_synthetic_dataset(tmp_path / "t2v", num_samples=2, num_frames=17, size=(128, 128))
    r = train("--model", "random-1.3B", "--dataset-type", "t2v", "--data-root", str(data), "--resolution", "128",
              "128", "--num-frames", "17", "--max-steps", "2", "--num-workers", "0", "--output-dir", str(tmp_path),
              "--run-name", "real", "--log-every", "1", "--device", "cuda")
    captured = capsys.readouterr()
    log = captured.out + captured.err
    assert "memory: recompute" in log and "(--memory auto: " in log, log[-2000:]
    weights = load_file(r["weights"])
    assert len(weights) > 0 and all(torch.isfinite(v).all() for v in weights.values())
    assert all(v == v for v in losses(r["run_dir"]).values())


def test_memory_auto_fits_wan_13b_lora_in_12gb(tmp_path, capsys):
    """Issue 13's third target through train_a2.py: random-1.3B LoRA at 81x480x832 planned for a 12 GB card. The
    plan offloads the recomputed blocks' saved tensors, and the step's peak (metrics.jsonl, max_memory_allocated)
    stays within the 12 GB it planned for."""
    import json

    from data import make_synthetic_dataset

    data = make_synthetic_dataset(tmp_path / "t2v", num_samples=2, num_frames=81, size=(480, 832))
    r = train("--model", "random-1.3B", "--dataset-type", "t2v", "--data-root", str(data), "--resolution", "480",
              "832", "--num-frames", "81", "--max-steps", "3", "--num-workers", "0", "--output-dir", str(tmp_path),
              "--run-name", "card12", "--log-every", "1", "--device", "cuda", "--max-memory-gb", "12")
    captured = capsys.readouterr()
    log = captured.out + captured.err
    plan = next(line for line in log.splitlines() if "memory: recompute" in line)
    print(plan)
    assert "DOES NOT FIT" not in plan and "of 12.0 GB" in plan, plan
    rows = [json.loads(line) for line in (r["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    print([row["peak_mem_gb"] for row in rows], [row["s_per_step"] for row in rows])
    assert max(row["peak_mem_gb"] for row in rows) <= 12.0 and all(row["loss"] == row["loss"] for row in rows)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="row-wise fp8 torch._scaled_mm needs compute capability 9.0+ (H100)")
def test_fp8_scaled_mm_linear_against_the_dequantizing_path():
    """--fp8-matmul's linear (a2/memory/fp8.py _ScaledMMLinear) on an A2-14B FFN shape: its output is the dequantizing
    path's up to the input's e4m3 rounding (2.6% RMS relative per element, as the weights'), asserted <= 5%; its
    input gradient is the same computation (bf16 on the dequantized weight), asserted equal. Prints both forward
    times (not a bench: bench.py measures the step)."""
    from torch import nn

    from a2.memory.fp8 import quantize_base_weights

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(5120, 13824, device="cuda", dtype=torch.bfloat16)])
    model.requires_grad_(False)
    quantize_base_weights(model)
    lin = model.blocks[0]
    x = torch.randn(8192, 5120, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, grads, times = {}, {}, {}
    for mode in (False, True):
        lin.scaled_mm = mode
        y = lin(x)
        y.float().square().sum().backward()
        out[mode], grads[mode], x.grad = y.detach().float(), x.grad, None
        with torch.no_grad():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                lin(x)
            end.record()
            torch.cuda.synchronize()
            times[mode] = start.elapsed_time(end) / 20
    print(f"fp8 linear 8192x5120 @ 5120x13824: dequantize + bf16 {times[False]:.2f} ms, "
          f"_scaled_mm {times[True]:.2f} ms")
    rel = ((out[True] - out[False]).norm() / out[False].norm()).item()
    assert 1e-3 < rel <= 0.05, rel
    # the backward's grad_out differs as the outputs do (the loss is y^2): compare the backward itself
    g = torch.randn(8192, 13824, device="cuda", dtype=torch.bfloat16)
    for mode in (False, True):
        lin.scaled_mm = mode
        x.grad = None
        lin(x).backward(g)
        grads[mode] = x.grad
    assert torch.equal(grads[True], grads[False])


def test_lora_over_fp8_base_weights_on_cuda(data_dir, tmp_path):
    """--fp8-base (dequantize to bf16) and, on an H100, --fp8-matmul, compiled and recomputed, against the bf16
    LoRA run: finite losses within 10% of it (fp8 rounding moves gradients ~3-4%, tests/test_fp8.py)."""
    steps = ("--max-steps", "4", "--lr", "5e-2", "--warmup-steps", "0", "--compile", "--memory", "manual")
    ref = losses(train(*args(data_dir, tmp_path, "bf16", *steps))["run_dir"])
    plans = [("--fp8-base",)] + ([("--fp8-base", "--fp8-matmul")] if torch.cuda.get_device_capability() >= (9, 0)
                                 else [])
    for i, extra in enumerate(plans):
        got = losses(train(*args(data_dir, tmp_path, f"fp8-{i}", *steps, *extra))["run_dir"])
        print(extra, got, ref)
        assert all(v == v for v in got.values()) and close(got, ref, 0.1), (extra, got, ref)


def offload_step(activations: bool, swap: int, compile: bool):
    """One bf16 LoRA step of a 6-block Wan-1.3B-shaped transformer (6144 tokens, every block recomputed keeping its
    attention): (loss, LoRA gradients, peak allocated bytes, bytes swapped, bytes of one block's frozen weights).
    The model is built on the host and offloaded before it moves to the GPU, as train_a2 does."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from a2.memory.offload import apply_offload, swap_bytes
    from a2.model.transformer import configure_blocks, preset_config

    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**preset_config("1.3B"), "num_layers": 6}).to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if p.requires_grad:  # fp32 LoRA weights, B nonzero so that every LoRA matrix has a gradient
            p.data = 0.01 * torch.randn(p.shape, generator=g) if "lora_B" in name else p.data.float()
    block = swap_bytes(model, 1)
    cuda = torch.device("cuda")
    torch.cuda.empty_cache()
    swapped = apply_offload(model, activations, swap, cuda)
    model.to(cuda)
    configure_blocks(model, 1.0, True, compile)
    g = torch.Generator(cuda).manual_seed(0)
    x = torch.randn(1, 16, 6, 64, 64, generator=g, device=cuda)  # 6 x 32 x 32 = 6144 tokens
    text = torch.randn(1, 512, 4096, generator=g, device=cuda)
    lora = [p for p in model.parameters() if p.requires_grad]
    for _ in range(2):  # the second step is measured (compiled code in place, allocator warm)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16):
            pred = model(x, torch.tensor([500.0], device=cuda), text, return_dict=False)[0]
        loss = pred.float().pow(2).mean()
        loss.backward()
        torch.cuda.synchronize()
    out = loss.item(), torch.cat([p.grad.flatten() for p in lora]).float().cpu(), torch.cuda.max_memory_allocated()
    del model, pred, loss, lora
    import gc

    torch._dynamo.reset()  # compiled code and the hooks' reference cycles would keep this model on the GPU
    gc.collect()
    torch.cuda.empty_cache()
    return (*out, swapped, block)


@pytest.mark.parametrize("compile", [False, True])
def test_offload_and_swap_bf16_step(compile):
    """Memory reach on the GPU: block swap and activation offload (side-stream copies, pinned memory, events) give the
    plain step's loss and LoRA gradients (bf16 tolerance), and lower the peak: swapping all 6 blocks by their
    bytes less three blocks' (the one computing, the one arriving, the one just released, whose memory returns
    once the compute queued on it is done), offloading the activations by the recomputed blocks' inputs and
    attention outputs less three blocks' (likewise)."""
    loss, grads, peak, _, block = offload_step(False, 0, compile)
    tokens, dim = 6 * 32 * 32, 1536
    saved = 2 * tokens * dim * 2  # bf16 input and attention output of a recomputed block
    for activations, swap in ((False, 6), (True, 0), (True, 6)):
        l2, g2, p2, swapped, _ = offload_step(activations, swap, compile)
        drop = peak - p2
        print(f"compile={compile} offload={activations} swap={swap}: loss {l2:.6f} vs {loss:.6f}, "
              f"peak {p2 / 2**30:.3f} vs {peak / 2**30:.3f} GB (drop {drop / 2**20:.0f} MB, swapped "
              f"{swapped / 2**20:.0f} MB)")
        assert abs(l2 - loss) <= 1e-3 * abs(loss)
        assert ((g2 - grads).norm() / grads.norm()).item() <= 1e-2
        want = (swapped - 3 * block if swap else 0) + ((6 - 3) * saved if activations else 0)
        assert drop >= want, (drop, want)
