"""Block recomputation and compilation (a2.model.transformer.configure_blocks): every setting computes the same
gradients, and each recomputes exactly the attention it should in backward (counted at the aten op level, which
sees compiled code's attention kernels too)."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch.utils._python_dispatch import TorchDispatchMode

from a2.model.transformer import configure_blocks, preset_config

LAYERS = 4


class CountAttention(TorchDispatchMode):
    """Counts forward attention-core ops: self (as many keys as queries) and cross."""

    def __init__(self):
        super().__init__()
        self.n = {"self": 0, "cross": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "scaled_dot_product" in name and "backward" not in name:
            self.n["self" if args[0].shape == args[1].shape else "cross"] += 1
        return func(*args, **(kwargs or {}))


def grads_and_recomputed_attention(fraction, save_attention, compile):
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**preset_config("tiny"), "num_layers": LAYERS})
    configure_blocks(model, fraction, save_attention, compile)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 36, 3, 8, 8, generator=g)  # 48 video tokens; 512 text and 2 x 257 image keys
    text, image = torch.randn(1, 512, 32, generator=g), torch.randn(1, 2 * 257, 32, generator=g)
    for _ in range(2):  # the second step runs what the first compiled
        model.zero_grad(set_to_none=True)
        out = model(x, torch.tensor([500.0]), text, encoder_hidden_states_image=image, return_dict=False)[0]
        count = CountAttention()
        with count:
            out.pow(2).mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), count.n


def without_gpu(compile):
    """The test below in a process that sees no GPU. It is a CPU test, and on a machine with a GPU the compiled
    recomputation goes through run_with_rng_state, which a counting dispatch mode cannot enter (seen on an H100)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = f"from tests.test_recompute import test_recomputation_settings as t; t({compile}, _subprocess=True)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                       capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("compile", [False, True])
def test_recomputation_settings(compile, _subprocess=False):
    if compile and torch.cuda.is_available() and not _subprocess:
        return without_gpu(compile)
    ref, n = grads_and_recomputed_attention(0.0, False, False)
    assert n == {"self": 0, "cross": 0}  # nothing recomputed without checkpointing
    cross = 2 * LAYERS  # the text and the image attention of each block
    for fraction, save, want in ((1.0, False, {"self": LAYERS, "cross": cross}),
                                 (0.5, False, {"self": LAYERS // 2, "cross": cross // 2}),
                                 (1.0, True, {"self": 0, "cross": cross}),
                                 (0.5, True, {"self": 0, "cross": cross // 2})):
        if compile and fraction == 0.5 and not save:
            continue  # the same compiled block as 1.0; keeps the test short
        grads, n = grads_and_recomputed_attention(fraction, save, compile)
        err = ((grads - ref).norm() / ref.norm()).item()
        print(f"compile={compile} fraction={fraction} save_attention={save}: recomputed {n}, grad rel err {err:.1e}")
        assert n == want, (fraction, save)
        assert err <= (1e-5 if compile else 1e-7), (fraction, save)


def test_training_with_save_attention_and_compile(tmp_path, monkeypatch):
    """train_a2.py --save-attention --compile (LoRA, full checkpointing) sets its blocks up so and computes the default
    run's first step: the same loss and gradients up to float32 reassociation. Compiled code may fuse and reorder
    float32 sums (inductor's choices differ per CPU), hence the same relative bound as test_recomputation_settings
    (1e-5); a recomputation that sees other inputs or dtypes (bf16 rounding alone is ~4e-3) is far outside it. Only
    the first step is compared: after it, AdamW's normalised update (about lr x sign(g) where |g| is tiny) turns
    rounding-level gradient differences into lr-sized weight differences."""
    import a2.memory.memory
    from data import make_synthetic_dataset
    from tests.conftest import args, losses, train

    setups, grads = [], []
    # train_a2 sets its blocks up through a2.memory.memory.apply_plan, which calls configure_blocks
    monkeypatch.setattr(a2.memory.memory, "configure_blocks", lambda *a: (setups.append(a[1:]), configure_blocks(*a)))
    clip = torch.nn.utils.clip_grad_norm_

    def record(params, max_norm):  # the step's gradients, as the optimizer gets them
        grads.append(torch.cat([p.grad.flatten() for p in params]).clone())
        return clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record)
    data = make_synthetic_dataset(tmp_path / "data", num_samples=2, num_frames=17, size=(32, 32))
    runs = [train(*args(data, tmp_path, name, "--max-steps", "1", *extra))
            for name, extra in (("default", ()), ("fast", ("--save-attention", "--compile")))]
    assert setups == [(1.0, False, False), (1.0, True, True)]  # fraction, save, compile
    (a, b) = (losses(r["run_dir"])[1] for r in runs)
    assert abs(a - b) <= 1e-5 * abs(a), (a, b)
    err = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    print(f"first step: loss {a:.7f} | {b:.7f}, gradient rel err {err:.1e}")
    assert grads[0].norm() > 0 and err <= 1e-5, err


def test_recompile_limit_covers_the_runs_shapes():
    """Compiled blocks recompile per bucket shape, with and without grad; past torch._dynamo's recompile limit a block
    would run eager in a plan made for compiled blocks. The limit is raised to 2 per shape + 8, never lowered."""
    import torch._dynamo.config as dynamo_config

    from a2.model.transformer import allow_recompiles

    # (config.patch restores it; monkeypatch's undo leaves the config module without the name on torch 2.14)
    with dynamo_config.patch(recompile_limit=8):
        allow_recompiles(12)
        assert dynamo_config.recompile_limit == 2 * 12 + 8
        allow_recompiles(1)  # a later, smaller run in the same process keeps the larger limit
        assert dynamo_config.recompile_limit == 32


def test_compiled_runs_in_one_process(data_dir, tmp_path, monkeypatch):
    """The CUDA tier's order effect: Wan VACE's compiled LoRA runs failed after the FSDP tests in the same process,
    and passed alone. torch._dynamo keeps each code object's cache entries for the process's life, those of models
    that are gone too (invalidated but counted against the recompile limit), every compiled block shares code objects
    (torch.compile's wrapper of a recomputed block, a block class's forward), and a fullgraph block past the limit
    is an error (FailOnRecompileLimitHit). Here a compiled FSDP LoRA run, its unsharded twin, then VACE's LoRA in
    bf16 and over fp8 base weights, in one process: each run must compile its blocks afresh. Compiled with
    dynamo's eager backend: the cache and its limit are dynamo's whatever the backend, and inductor takes minutes
    on the CPU."""
    import torch._dynamo

    from tests.conftest import args, losses, train

    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile(fn, **{**kw, "backend": "eager"}))
    lora = ("--max-steps", "1", "--lr", "1e-3", "--memory", "manual", "--compile")
    vace = ("--model", "tiny-vace", "--num-frames", "17", "--max-steps", "1", "--memory", "manual", "--compile")
    try:
        for name, extra in (("fsdp", (*lora, "--fsdp")), ("ddp", lora), ("vace", vace),
                            ("vace-fp8", (*vace, "--fp8-base"))):
            r = train(*args(data_dir, tmp_path, name, *extra))
            assert all(v == v for v in losses(r["run_dir"]).values()), name
    finally:
        torch._dynamo.reset()  # the eager backend's entries stay out of later tests
