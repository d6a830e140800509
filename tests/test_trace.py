"""a2/train/trace.py: the live-bytes count of a step, checked against a hand count, and the same on fake tensors (no
data) as on real ones."""

import pytest
import torch

from a2.train.trace import GB, LiveBytes, fake_tensors, trace_steps
from config import ADAMW, OptimConfig


def test_live_bytes_match_a_hand_count():
    """Three fp32 tensors of 1 MiB made and freed in a known order: the count follows each allocation and each last
    reference (views share their storage; an in-place op makes nothing), and the peak is the most at once."""
    n = 1 << 18  # fp32: 1 MiB
    tracer = LiveBytes(device="cpu")
    with tracer:
        tracer.phase = "forward"
        a = torch.ones(n)
        b = a * 2  # 2 MiB live
        view = b[: n // 2]  # a view: no storage of its own
        b.add_(1)  # in place: nothing new
        del b  # the view keeps b's storage
        assert tracer.live["device"] == 2 << 20
        c = a + view.sum()  # 0-dim sum (4 bytes), then c: 3 MiB + 4 bytes at the peak
        del view  # b's storage freed
        assert tracer.live["device"] == 2 << 20
        del a, c
    assert tracer.live["device"] == 0
    assert tracer.peak.total == (3 << 20) + 4



def test_a_storage_resized_to_nothing_and_back_counts_again():
    """FSDP2 frees a gathered weight by resizing its storage to 0 bytes and gathers it again by resizing it back
    (no op is dispatched for either): each size counts from its resize (the backward's gathers are counted), and the
    storage's last reference frees what it holds then."""
    n = 1 << 18  # fp32: 1 MiB
    tracer = LiveBytes(device="cpu")
    with tracer:
        tracer.phase = "forward"
        w = torch.ones(n)
        for size, live in ((0, 0), (4 * n, 1 << 20), (0, 0), (4 * n, 1 << 20)):
            w.untyped_storage().resize_(size)
            tracer.resized(w)
            assert tracer.live["device"] == live, (size, tracer.live)
        del w
    assert tracer.live["device"] == 0

def tiny_lora_step(tracer):
    """Two steps of the tiny Wan transformer with LoRA (fp32, CPU) under `tracer`; inputs made inside it."""
    from peft import LoraConfig

    from a2.model.transformer import preset_config, random_transformer
    from config import LORA_TARGETS

    cfg = preset_config("tiny")
    model = random_transformer(cfg, torch.float32, "cpu")
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))
    model.train()
    x = torch.zeros(1, cfg["in_channels"], 3, 8, 8)
    text = torch.zeros(1, 512, cfg["text_dim"])
    image = torch.zeros(1, 257, cfg["image_dim"])

    def forward():
        out = model(x, torch.full((1,), 500.0), text, encoder_hidden_states_image=image, return_dict=False)[0]
        return out.pow(2).mean()

    trace_steps(tracer, model, forward, OptimConfig(lr=1e-3, **ADAMW))
    return model


def test_fake_tensors_count_what_real_ones_allocate():
    """The tiny model's LoRA step counted on real CPU tensors and on fake ones (shapes only): the same live bytes at
    every point, so the same peak and categories; the peak is above the weights and below weights + all
    activations of a step, and it falls in the backward."""
    real, fake = LiveBytes(device="cpu"), LiveBytes(device="cpu")
    with real:
        model = tiny_lora_step(real)
    with fake_tensors(), fake:
        tiny_lora_step(fake)
    r, f = real.peak.by_category(), fake.peak.by_category()
    # what the step makes (activations, gradients in flight) is counted the same to the byte; the fake mode's
    # 0-dim constants (the optimizer's step counters) can differ by a few hundred bytes
    assert (r["kept"], r["transient"]) == (f["kept"], f["transient"])
    assert abs(real.peak.total - fake.peak.total) < 4096 and real.peak.phase == fake.peak.phase == "backward"
    weights = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size()
                                                                  for b in model.buffers())
    cats = real.peak.by_category()
    assert cats["weights"] + cats["state"] >= weights and cats["kept"] > 0 and cats["transient"] > 0
    assert real.peak.total < 2 * GB


def record_ops(device: str, layers: int, frames: int = 5, h: int = 16, w: int = 16):
    """(op, dtypes and shapes of its outputs) of the forward of a 14B-wide LoRA model with recomputed blocks keeping
    attention, on fake tensors of `device` under that device's bf16 autocast and emulated_cuda(device)."""
    from peft import LoraConfig
    from torch.utils._python_dispatch import TorchDispatchMode

    from a2.model.transformer import configure_blocks, preset_config, random_transformer
    from a2.train.trace import emulated_cuda
    from config import LORA_TARGETS

    class Record(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__ != "device.default":  # (a device query, no tensor)
                outs = [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                self.ops.append((func.__name__, [(t.dtype, tuple(t.shape)) for t in outs]))
            return out

    cfg = {**preset_config("14B"), "num_layers": layers}
    with fake_tensors(), emulated_cuda(device):
        model = random_transformer(cfg, torch.bfloat16, "cpu").to(device)
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS))
        configure_blocks(model, 1.0, True)
        x = torch.zeros(1, 36, frames, h, w, device=device, dtype=torch.bfloat16)
        text = torch.zeros(1, 512, 4096, device=device, dtype=torch.bfloat16)
        image = torch.zeros(1, 771, 1280, device=device, dtype=torch.bfloat16)
        with Record() as rec, torch.autocast(device, dtype=torch.bfloat16):
            model(x, torch.full((1,), 500.0, device=device), text, encoder_hidden_states_image=image,
                  return_dict=False)
    return rec.ops


@pytest.mark.skipif(torch.version.cuda is None, reason="fake CUDA tensors need a CUDA build of torch")
def test_cpu_emulation_runs_the_ops_cuda_runs():
    """The dry run's GPU emulated on fake CPU tensors (CPU autocast + emulated_cuda's CUDA ops) runs the forward's
    ops with the dtypes and shapes of the same forward on fake CUDA tensors under CUDA autocast (which a CUDA build
    runs without a GPU, forward only), op for op: the memory of one is the memory of the other."""
    cuda, cpu = record_ops("cuda", 1), record_ops("cpu", 1)
    assert len(cuda) > 300 and cuda == cpu


DRY_RUN_CASES = {  # bench.py's flags for the memory targets (docs/memory.md), LoRA unless said
    "A2-14B 3 refs 81x480x832 80GB": dict(preset="14B", refs=3, height=480, width=832),
    "A2-14B 3 refs 81x720x1280 80GB": dict(preset="14B", refs=3, height=720, width=1280),
    "A2-14B 3 refs 81x480x832 24GB": dict(preset="14B", refs=3, height=480, width=832, max_memory_gb=24),
    "Wan-1.3B 81x480x832 12GB": dict(preset="1.3B", refs=0, height=480, width=832, max_memory_gb=12),
    "Wan-1.3B full FT 81x480x832 80GB": dict(preset="1.3B", refs=0, height=480, width=832, mode="full"),
    "A2-14B 3 refs 81x720x1280 CP 2 80GB (offload)": dict(preset="14B", refs=3, height=720, width=1280,
                                                         context_parallel=2),
    "A2-14B full FT 81x720x1280 CP 8, FSDP 8": dict(preset="14B", refs=3, height=720, width=1280, mode="full",
                                                   context_parallel=8, fsdp=True, dry_run_ranks=8),
}


@pytest.mark.parametrize("case", DRY_RUN_CASES)
def test_dry_run_within_the_rule(case):
    """bench.py --dry-run for each memory target, planned for the whole model at the real token count and width and
    traced (two steps) on the model cut to 3 blocks with the plan's per-block choices (a2/memory/memory.py cut_plan: the
    rule is per block; the whole grid at full size, within 3%, is docs/memory.md's table, tests/test_memory.py): the
    rule's estimate of the traced step within 10% of the trace (a cut model's terms outside the blocks and its
    first and last blocks weigh more; FSDP's gathers at a backward peak come and go), eager (the eager plan
    traced) and in the compiled accounting (the compiled plan traced, what compiled blocks keep and hold replaced by
    the rule's compiled terms, the H100 measurement, not a trace: a2/train/trace.py compiled_peak), category by category
    within 0.3 GiB + 10%, and the pinned host memory the cut plan's to the MiB. The context-parallel FSDP case
    emulates one rank of 8 (its collectives on a fake process group)."""
    from bench import BenchConfig, bench_dry_run
    from config import MemoryConfig

    fields = dict(DRY_RUN_CASES[case])
    memory = {k: fields.pop(k) for k in ("max_memory_gb", "dry_run_ranks") if k in fields}
    for compile in (False, True):
        r = bench_dry_run(BenchConfig(**fields, frames=81, memory=MemoryConfig(**memory, compile=compile)), layers=3)
        peak = r["compiled_gb"] if compile else r["peak_gb"]
        assert abs(r["estimate_gb"] / peak - 1) <= 0.1, (compile, peak, r["estimate_gb"], str(r["plan"]))
        assert abs(r["tracer"].host_peak / GB - r["host_gb"]) < 2**-10, (r["tracer"].host_peak / GB, r["host_gb"])
        if not compile:  # the terms, at the traced peak's phase
            traced, phase = r["tracer"].peak.by_category(), r["tracer"].peak.phase
            rule = r["rule"][phase] if phase in r["rule"] else None
            if rule:
                for c, v in traced.items():
                    assert abs(rule[c] - v) <= 0.3 * GB + 0.1 * v, (c, phase, rule[c] / GB, v / GB)


def test_train_dry_run_exits_3_when_it_does_not_fit(data_dir, tmp_path):
    """train_a2.py --dry-run on the tiny model: its real step's peak, traced without data or weights, is at least
    the trainable state and the kept inputs of its blocks; a card smaller than the rule's margin exits 3; no run dir
    is made."""
    from tests.conftest import args, train

    res = train(*args(data_dir, tmp_path, "dry", "--dry-run", "--max-memory-gb", "2", "--memory", "auto"))
    assert 0 < res["peak_gb"] * GB < 2 * GB and res["estimate_gb"] > 0
    with pytest.raises(SystemExit) as e:
        train(*args(data_dir, tmp_path, "dry", "--dry-run", "--max-memory-gb", "1"))
    assert e.value.code == 3 and not (tmp_path / "dry").exists()


@pytest.mark.parametrize("name", ["phantom", "standin"])  # two it once refused; each case costs ~4 s
def test_train_dry_run_runs_the_training_step_of_every_kind(data_dir, tmp_path, name):
    """--dry-run traces the step training runs (model_inputs + forward_loss on a synthetic batch of zero posteriors
    in the kind's VAE calls), so it covers the kinds it once refused: it traces a peak under the card, no run dir."""
    from tests.conftest import args, train
    from tests.test_conditioning import KINDS

    model, extra = KINDS[name]
    res = train(*args(data_dir, tmp_path, "dry", "--dry-run", "--max-memory-gb", "2", "--memory", "auto", *extra,
                      model=model))
    assert 0 < res["peak_gb"] * GB < 2 * GB and not (tmp_path / "dry").exists()


VACE_CASES = {  # bench.py --layout vace at 81x480x832 with 3 references (37,440 tokens), on the model cut to its first
    # blocks and their context blocks: (preset, mode, blocks, recomputed fraction)
    "Wan2.1-VACE-1.3B LoRA, half recomputed": ("1.3B", "lora", 6, 0.5),  # 3 context blocks, 2 of them recomputed
    "Wan2.1-VACE-1.3B full, every block recomputed": ("1.3B", "full", 5, 1.0),
    "Wan2.1-VACE-14B LoRA, every block recomputed": ("14B", "lora", 6, 1.0),  # its context blocks hint 0 and 5
}


@pytest.mark.parametrize("case", VACE_CASES)
def test_dry_run_of_vace_within_the_rule(case):
    """VACE's context blocks in the rule (a2/memory/memory.py step_memory: their weights, what they keep, the hints and
    their gradients, their backward, the phase "context"): the rule's estimate of the traced step within 3% at
    every phase, eager, and in the compiled accounting (what compiled blocks keep and hold, the blocks' and the
    context blocks', replaced by the rule's compiled terms), at the full token count and width, the LoRA on the
    context blocks (train_a2.py's default) or full fine-tuning; its LoRA's blocks frozen, their own coefficients."""
    from bench import BenchConfig, bench_dry_run
    from config import MemoryConfig

    preset, mode, layers, fraction = VACE_CASES[case]
    memory = MemoryConfig(compile=True, mode="manual", checkpoint_fraction=fraction)  # (the flags' plan: eager's too)
    r = bench_dry_run(BenchConfig(preset=preset, layout="vace", refs=3, frames=81, height=480, width=832, mode=mode,
                                  memory=memory), layers=layers, log=lambda *_: None)
    assert abs(r["eager_estimate_gb"] / r["peak_gb"] - 1) <= 0.03, (r["peak_gb"], r["eager_estimate_gb"])
    assert abs(r["estimate_gb"] / r["compiled_gb"] - 1) <= 0.03, (r["compiled_gb"], r["estimate_gb"])
    # each phase, eager (full fine-tuning: the first block's backward falls in "recompute" or "context", whichever
    # comes first, so those two as one)
    traced = {p: peak.total for p, peak in r["tracer"].phases().items()}
    rule = {p: sum(c.values()) for p, c in r["rule"].items()}
    assert "context" in traced and set(traced) <= set(rule)
    if mode == "full":
        for t in (traced, rule):
            t["recompute"] = t["context"] = max(t["recompute"], t["context"])
    for phase, total in traced.items():
        assert abs(rule[phase] - total) <= 0.03 * max(traced.values()), (phase, rule[phase] / GB, total / GB)
