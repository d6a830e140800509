"""Block recomputation and compilation (a2.transformer.configure_blocks): every setting computes the same
gradients, and each recomputes exactly the attention it should in backward (counted at the aten op level, which
sees compiled code's attention kernels too)."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch.utils._python_dispatch import TorchDispatchMode

from a2.transformer import configure_blocks, preset_config

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
    """train_a2.py --save-attention --compile (LoRA, full checkpointing) sets its blocks up so and follows the
    default run's losses."""
    from safetensors.torch import load_file

    import a2.transformer
    from data import make_synthetic_dataset
    from tests.conftest import args, losses, max_diff, train

    setups = []
    # train_a2 sets its blocks up through a2.memory.apply_plan, which calls a2.transformer.configure_blocks
    monkeypatch.setattr(a2.transformer, "configure_blocks", lambda *a: (setups.append(a[1:]), configure_blocks(*a)))
    data = make_synthetic_dataset(tmp_path / "data", num_samples=2, num_frames=17, size=(32, 32))
    runs = [train(*args(data, tmp_path, name, "--max-steps", "3", *extra))
            for name, extra in (("default", ()), ("fast", ("--save-attention", "--compile")))]
    assert setups == [(1.0, False, False), (1.0, True, True)]  # fraction, save, compile
    (a, b) = (losses(r["run_dir"]) for r in runs)
    assert sorted(a) == sorted(b) == [1, 2, 3] and max(abs(a[s] - b[s]) for s in a) <= 1e-5, (a, b)
    assert max_diff(load_file(runs[0]["weights"]), load_file(runs[1]["weights"])) <= 1e-5
