"""--ema-decay: the EMA recurrence with its warm-up, kept in the optimizer state; resume == uninterrupted (bit for bit);
2 DDP ranks == one process; --fsdp (sharded EMA) == DDP and resumes; the exported EMA LoRA / transformer loads in
infer.py."""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import args, assert_rounding, launch, max_diff, train

EMA = ["--ema-decay", "0.9"]
# full fine-tuning, 2 ranks x micro 1 x accumulation 2 (one process: micro 2 x accumulation 2); adam-eps: see
# OptimConfig.adam_eps
FULL = ["--training-type", "full", "--grad-accum", "2", "--lr", "1e-2", "--adam-eps", "1e-4", "--ckpt-every", "2",
        "--max-steps", "4", *EMA]


def test_ema_recurrence_and_swap():
    """After optimizer step t: ema = lerp(ema, w, 1 - min(d, (1+t)/(10+t))), starting at the weights after the first
    step; ema_weights puts the EMA in and the trained weights back, bit for bit."""
    from a2.train.step import ema_decay, ema_weights, update_ema

    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    want = None
    for t in range(6):
        m(torch.randn(3, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        update_ema(opt, params, ema_decay(0.8, t))
        w = [p.detach().clone() for p in params]
        want = w if want is None else [e.lerp(x, 1 - min(0.8, (1 + t) / (10 + t))) for e, x in zip(want, w)]
    assert [ema_decay(0.8, t) for t in (0, 10, 1000)] == [0.1, 11 / 20, 0.8]
    assert all(torch.equal(opt.state[p]["ema"], e) for p, e in zip(params, want))
    trained = [p.detach().clone() for p in params]
    with ema_weights(opt, params):
        assert all(torch.equal(p, e) for p, e in zip(params, want))
    assert all(torch.equal(p, w) for p, w in zip(params, trained)) and max_diff(
        dict(enumerate(trained)), dict(enumerate(want))) > 1e-3


def emas(ckpt) -> dict:
    """The EMA of each trainable weight from a DDP checkpoint's optimizer state."""
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    return {i: s["ema"] for i, s in state.items()}


def test_ema_resume_equals_uninterrupted_bit_for_bit(data_dir, tmp_path):
    """The 4-step run's step-2 checkpoint is what a run stopped at step 2 leaves; resumed to step 4 its EMA (in the
    checkpoint and exported) equals the uninterrupted run's bit for bit."""
    flags = ["--max-steps", "4", "--ckpt-every", "2", "--micro-batch", "2", "--lr", "1e-2", *EMA]
    full = train(*args(data_dir, tmp_path, "full", *flags))
    assert full["ema_weights"].name == "pytorch_lora_weights_ema.safetensors"
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(full["run_dir"] / "ckpt-0000002", cut / "ckpt-0000002")
    resumed = train(*args(data_dir, tmp_path, "cut", *flags, "--resume", "auto"))
    a, b = emas(full["run_dir"] / "ckpt-0000004"), emas(cut / "ckpt-0000004")
    assert a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("pytorch_lora_weights_ema.safetensors", "pytorch_lora_weights_ema_comfy.safetensors"):
        x, y = load_file(full["run_dir"] / name), load_file(resumed["run_dir"] / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    # not vacuous: the EMA moved between the checkpoints and differs from the trained weights
    assert max_diff(a, emas(full["run_dir"] / "ckpt-0000002")) > 1e-5
    assert max_diff(load_file(full["weights"]), load_file(full["ema_weights"])) > 1e-5


def test_ema_lora_export_loads_in_infer(data_dir, tmp_path, tiny_dir):
    import infer

    r = train(*args(data_dir, tmp_path, "lora", "--max-steps", "4", "--lr", "5e-2", "--warmup-steps", "0", *EMA,
                    model=tiny_dir))
    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    base = dict(model=str(tiny_dir), elements=els, height=32, width=32, num_frames=21, steps=2, device="cpu",
                decode="none")
    infer.main(infer.InferConfig.from_flags(**base, lora=str(r["weights"]), save_latents=str(tmp_path / "plain.pt")))
    for f in (r["ema_weights"], r["run_dir"] / "pytorch_lora_weights_ema_comfy.safetensors"):
        # loads, adapts the model, and is not the plain LoRA (infer exits 1 when the latents differ)
        assert infer.main(infer.InferConfig.from_flags(**base, lora=str(f), compare=str(tmp_path / "plain.pt"))) == 1
    infer.main(infer.InferConfig.from_flags(**base, lora=str(r["ema_weights"]), save_latents=str(tmp_path / "ema.pt")))
    comfy = r["run_dir"] / "pytorch_lora_weights_ema_comfy.safetensors"
    assert infer.main(infer.InferConfig.from_flags(**base, lora=str(comfy),
                                                   compare=str(tmp_path / "ema.pt"))) == 0  # both formats: one EMA


@pytest.fixture(scope="module")
def full_runs(data_dir, tmp_path_factory):
    """Full fine-tuning with EMA: --fsdp on 2 ranks and DDP on 2 ranks (launched together), one process."""
    out = tmp_path_factory.mktemp("runs")
    procs = {name: launch(args(data_dir, out, name, *FULL, *extra), nproc=2) for name, extra in
             (("fsdp", ["--fsdp"]), ("ddp", []))}
    train(*args(data_dir, out, "one", *FULL, "--micro-batch", "2", "--grad-accum", "2"))
    for p in procs.values():
        log, _ = p.communicate(timeout=900)
        assert p.returncode == 0, log[-4000:]
    return {name: out / name for name in ("fsdp", "ddp", "one")}


def ema_dir(run):
    return load_file(run / "transformer_ema" / "diffusion_pytorch_model.safetensors")


def test_ddp_ema_equals_one_process(full_runs):
    ddp, one = full_runs["ddp"], full_runs["one"]
    assert max_diff(emas(ddp / "ckpt-0000004"), emas(one / "ckpt-0000004")) <= 1e-6
    assert max_diff(ema_dir(ddp), ema_dir(one)) <= 1e-6
    plain = load_file(one / "transformer" / "diffusion_pytorch_model.safetensors")
    assert max_diff(ema_dir(one), plain) > 1e-4


def test_fsdp_ema_is_sharded_equals_ddp_and_resumes(full_runs, data_dir, tmp_path, tiny_dir):
    fsdp, ddp = full_runs["fsdp"], full_runs["ddp"]
    assert max_diff(ema_dir(fsdp), ema_dir(ddp)) <= 1e-6  # gathered from the shards at export
    dcp_to_torch_save(fsdp / "ckpt-0000004" / "sharded", tmp_path / "fsdp.pt")
    state = torch.load(tmp_path / "fsdp.pt", weights_only=False)["optim"]["state"]
    ema = {k: s["ema"] for k, s in state.items()}
    assert max_diff(ema, ema_dir(fsdp)) == 0  # the checkpoint's (full-shape) EMA is what was exported
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(fsdp / "ckpt-0000002", cut / "ckpt-0000002")
    p = launch(args(data_dir, tmp_path, "cut", *FULL, "--fsdp", "--resume", "auto"), nproc=2)
    log, _ = p.communicate(timeout=900)
    assert p.returncode == 0 and "resumed from" in log, log[-4000:]
    assert max_diff(ema_dir(cut), ema_dir(fsdp)) <= 1e-6
    import infer  # the EMA transformer dir is a full fine-tune infer.py loads

    out = infer.main(infer.InferConfig.from_flags(model="tiny", transformer=str(fsdp / "transformer_ema"), height=32,
                                                  width=32, num_frames=21, steps=2, device="cpu", decode="none",
                                                  elements=(str(data_dir / "000_person.png"),),
                                                  save_latents=str(tmp_path / "ema.pt")))
    assert out == 0 and (tmp_path / "ema.pt").exists()


def test_the_loops_ema_follows_the_warm_up_schedule(data_dir, tmp_path):
    """The training loop applies the EMA of step s (0-based) with decay min(0.9, (1 + s) / (10 + s)), written out
    here: each checkpoint's EMA is the previous one moved towards that checkpoint's weights by 1 - decay (a loop
    that passed another step to the schedule would not match)."""
    train(*args(data_dir, tmp_path, "ema", "--max-steps", "3", "--ckpt-every", "1", "--keep-last", "5", "--lr",
                "1e-2", "--warmup-steps", "0", *EMA))
    run = tmp_path / "ema"
    from a2.train.lora import read_base_metadata

    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors",
                 "pytorch_lora_weights_ema_comfy.safetensors"):  # every export records its base and kind
        assert read_base_metadata(run / name) == dict(
            a2_base_model="tiny", a2_base_family="Wan2.1 I2V", a2_kind="prefix",
            a2_base_shapes="layers 2, width 128, ffn 256, in 36, out 16, text 32, image 32, patch 1x2x2"), name
    ckpts = [run / f"ckpt-{k:07d}" for k in (1, 2, 3)]
    weights = [load_file(c / "trainable.safetensors") for c in ckpts]
    ema = [emas(c) for c in ckpts]
    # which weight each optimizer index is: after the first step the EMA is that weight itself
    names = {}
    for i, e in ema[0].items():
        same = [n for n, w in weights[0].items() if w.shape == e.shape and torch.equal(w, e)]
        assert len(same) == 1, (i, same)
        names[i] = same[0]
    assert len(names) == len(weights[0]) > 0
    for s in (1, 2):
        decay = min(0.9, (1 + s) / (10 + s))
        for i, name in names.items():
            want = ema[s - 1][i] + (1 - decay) * (weights[s][name] - ema[s - 1][i])
            assert_rounding(ema[s][i], want, 8)  # the update's own op order (lerp) against this formula's
        assert max((ema[s][i] - ema[s - 1][i]).abs().max().item() for i in names) > 1e-4  # it moved
