"""bench.py: the FLOP formula against the figures stated for the real shapes, and a CPU run on tiny."""

import re
from pathlib import Path

import pytest
import torch

import bench
from a2.cli import run_cli
from a2.kinds.kinds import KINDS, V3_SLOTS
from a2.model.transformer import preset_config
from a2.train.step import forward_loss, optimizer_step
from bench import BenchConfig, forward_flops, main
from config import BenchTiming, MemoryConfig


def test_flops_match_the_stated_real_shapes():
    tokens = 21 * (480 // 16) * (832 // 16)  # 81 frames -> 21 latents; 32,760 video tokens
    assert tokens == 32760
    l14, c14 = forward_flops(preset_config("14B"), tokens, 512 + 3 * 257)
    l13, c13 = forward_flops(preset_config("1.3B"), tokens, 512)
    assert (l14 + c14) / 1e15 == pytest.approx(1.70, rel=0.01)
    assert (l13 + c13) / 1e15 == pytest.approx(0.28, rel=0.02)
    assert c14 / (l14 + c14) > 0.5  # at 32k tokens attention dominates


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bench_runs_on_cpu(mode):
    r = main(BenchConfig(preset="tiny", frames=9, height=32, width=32, refs=2, mode=mode, dtype="float32",
                         device="cpu", memory=MemoryConfig(save_attention=mode == "lora"),
                         timing=BenchTiming(steps=1, warmup=1, peak_tflops=1.0)))
    assert r["hfu"] > r["mfu"] > 0  # the recomputed forward is hardware work on top of the model FLOPs
    assert r["tokens"] == 3 * 2 * 2 and r["s_per_step"] > 0 and r["tflops"] > 0


def test_bench_runs_each_memory_piece_on_cpu():
    """bench.py with offload, block swap and fp8 (the flags, as --memory manual): the plan is reported with host
    memory, and the step is timed (that they change no result is tests/test_offload.py's and test_fp8.py's)."""
    r = main(BenchConfig(preset="tiny", frames=9, height=32, width=32, refs=2, mode="lora", dtype="float32",
                         device="cpu", timing=BenchTiming(steps=1, warmup=1, peak_tflops=1.0), memory=MemoryConfig(
                             save_attention=True, offload_activations=True, swap_blocks=1, fp8_base=True)))
    assert (r["offload"], r["swap_blocks"], r["fp8"]) == (True, 1, True)
    assert "1 blocks swapped to host" in r["plan"] and r["host_gb"] > 0 and r["s_per_step"] > 0


# tokens of each kind's input at 9 frames of 32x32 on tiny (3 latent frames of 2x2 tokens) and the reference tokens
# counted in them or beside them (Stand-In's 512x512 image: 32x32 tokens), by hand from each lab's layout
KIND_TOKENS = {"t2v": (12, 0), "prefix": (12, 4), "inplace": (12, 0), "incontext": (20, 8), "phantom": (20, 8),
               "refalign": (20, 8), "v3": (12 + 4 * V3_SLOTS, 4 * V3_SLOTS), "magref": (12, 4), "standin": (12, 1024),
               "clean": (3, 0), "vace": (20, 8),
               "kaleido": (20, 8)}  # (on tiny-ti2v: 16x VAE, 1 token a frame)


@pytest.mark.parametrize("kind", KINDS)
def test_bench_runs_every_kind(kind):
    """bench.py --layout KIND trains the kind's own step (its tokens, its references) for each kind a2 has; VACE's on
    the preset with its context blocks (their FLOPs counted: a hint after each of tiny's 2 blocks)."""
    assert set(KIND_TOKENS) == set(KINDS)
    r = main(BenchConfig(preset="tiny-ti2v" if kind == "clean" else "tiny", frames=9, height=32, width=32, refs=2,
                         layout=kind, dtype="float32", device="cpu", timing=BenchTiming(steps=1, warmup=0)))
    assert r["layout"] == kind and (r["tokens"], r["reference_tokens"]) == KIND_TOKENS[kind]
    assert r["s_per_step"] > 0 and r["forward_pflop"] > 0


def test_bench_vace_trains_its_context_blocks_and_refuses_what_misses_them(capsys):
    """bench.py --layout vace builds the preset's VACE model (1.3B's 15 context blocks, a hint every 2nd block), its
    LoRA on the context blocks as train_a2.py's default; --swap-blocks, whose hooks do not reach them, is refused in
    one line (exit 2)."""
    run, _, cfg = bench.bench_plan(BenchConfig(preset="1.3B", layout="vace", refs=3, frames=81))
    assert cfg["vace_layers"] == list(range(0, 30, 2)) and run.layout.context_blocks
    assert forward_flops(cfg, 1000, 512)[0] > forward_flops({**cfg, "vace_layers": []}, 1000, 512)[0]
    with pytest.raises(SystemExit) as e:
        run_cli(main, BenchConfig(preset="tiny", frames=9, height=32, width=32, refs=1, layout="vace", device="cpu",
                                  memory=MemoryConfig(swap_blocks=1)))
    assert e.value.code == 2 and "VACE's context blocks" in capsys.readouterr().err


def test_bench_times_train_a2s_step(monkeypatch):
    """The timed step is the trainer's (a2/train/step.py): forward_loss on model_inputs' batch, a change to the loss
    reaches bench, the alignment loss (--align-refs) included; and its optimizer_step, which keeps --ema-decay's
    EMA."""
    seen, updates = [], []

    def changed_loss(model, inputs, objective, references, run, amp, dtype):
        loss, viz = forward_loss(model, inputs, objective, references, run, amp, dtype)
        seen.append((run.layout.kind, references.align_loss, inputs["align_targets"], tuple(inputs["x0"].shape), loss))
        return 2 * loss, viz

    def recorded_step(opt, params, guard, step_loss, step, optim, world):
        out = optimizer_step(opt, params, guard, step_loss, step, optim, world)
        updates.append((step, optim.ema_decay, all("ema" in opt.state[p] for p in params)))
        return out

    monkeypatch.setattr(bench, "forward_loss", changed_loss)
    monkeypatch.setattr(bench, "optimizer_step", recorded_step)
    main(BenchConfig(preset="tiny", frames=9, height=32, width=32, align_refs=2, dtype="float32", device="cpu",
                     ema_decay=0.9, timing=BenchTiming(steps=2, warmup=1)))
    assert len(seen) == 3 and updates == [(0, 0.9, True), (1, 0.9, True), (2, 0.9, True)]  # warmup + timed steps
    kind, aligned, targets, x0, loss = seen[-1]
    assert (kind, aligned, x0) == ("phantom", True, (1, 16, 3, 4, 4))  # the video's 3 latents (then 2 references)
    assert targets.shape[:2] == (1, 2) and targets.abs().sum() > 0  # the target model's, not the cache's zeros
    assert torch.isfinite(loss) and loss > 0


def test_bench_refuses_what_the_kind_cannot_take(capsys):
    with pytest.raises(SystemExit) as e:  # as bench.py's __main__ runs it
        run_cli(main, BenchConfig(preset="tiny", frames=9, height=32, width=32, align_refs=2, layout="prefix",
                                  device="cpu"))
    assert e.value.code == 2 and "prefix kind" in capsys.readouterr().err


def test_bench_compares_no_kind_name():
    """What differs between kinds is read from their definitions (a2/kinds/conditioning.py), not compared in
    bench.py."""
    names = "|".join(KINDS)
    source = (Path(bench.__file__)).read_text()
    assert not re.findall(rf'[=!]=\s*"({names})"|"({names})"\s*[=!]=|in\s*\([^)]*"({names})"', source)


def test_bench_plans_with_the_planner():
    """bench.py asks a2/plan.py for its run (bench_plan: the preset's ModelInfo, the kind's flags, the sections its step
    reads) and its loader's data (bench_datasets), as training plans: it constructs no ModelInfo, no training section
    and no dataset config of its own, and imports no test module, so it cannot drift from a training run."""
    import ast

    tree = ast.parse(Path(bench.__file__).read_text())
    made = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    by_hand = {"ModelInfo", "DatasetConfig", "DataConfig", "VaeProcessorConfig", "ClipProcessorConfig", "LoraSection",
               "OptimConfig", "ObjectiveConfig", "ReferencesConfig", "ParallelConfig", "TrainConfig"}
    assert made & by_hand == set()
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert [m for m in imported if m.split(".")[0] == "tests"] == []


def test_bench_dry_run_traces_each_kinds_step():
    """bench.py --dry-run traces the same step as the timed one: Stand-In's 1024 reference tokens beside the video's
    make its traced step larger than T2V's at the same shape; MAGREF's and TI2V's (clean) steps trace too."""
    def traced(layout, preset="tiny"):
        r = bench.bench_dry_run(BenchConfig(preset=preset, frames=9, height=32, width=32, refs=2, layout=layout,
                                            memory=MemoryConfig(compile=False)))
        assert r["fits"]
        return r["tracer"].peak.total

    assert traced("standin") > traced("t2v") > 0
    assert traced("magref") > 0 and traced("clean", "tiny-ti2v") > 0
