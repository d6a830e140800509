"""train_a2.py: DDP == one process == accumulation, resume == uninterrupted (SIGTERM and hard kill),
train/infer conditioning parity, LoRA export loads in infer.py and diffusers, bad configs fail early."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("data") / "e2v", num_samples=4, num_frames=17,
                                  size=(32, 32))


def args(data_dir, out, run, *extra, model="tiny", device="cpu"):
    """A tiny run's flags. The CPU suite pins the CPU (and gloo), also on a machine with a GPU: its tolerances are
    the CPU's; tests/test_gpu.py runs the same helpers with device="cuda"."""
    return ["--model", str(model), "--data-root", str(data_dir), "--resolution", "32", "32", "--num-frames", "21",
            "--num-workers", "0", "--output-dir", str(out), "--run-name", run, "--log-every", "1",
            "--warmup-steps", "2", "--lr", "1e-3", "--ckpt-every", "1000", "--device", device, *extra]


def train(*argv):
    import tyro

    import train_a2
    from config import TrainConfig

    return train_a2.main(tyro.cli(TrainConfig, args=list(argv)))


def launch(argv, nproc=1, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    pre = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
           if nproc > 1 else [sys.executable])
    return subprocess.Popen(pre + [str(ROOT / "train_a2.py"), *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def params(ckpt):
    return load_file(ckpt / "trainable.safetensors")


def max_diff(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    return max((a[k] - b[k]).abs().max().item() for k in a)


def losses(run_dir):
    """Per-step loss from metrics.jsonl; a step logged twice (re-run after a kill) keeps its last value."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def test_ddp_equals_one_process_and_accumulation(data_dir, tmp_path):
    steps = ["--max-steps", "3", "--lr", "1e-2", "--adam-eps", "1e-4"]  # see TrainConfig.adam_eps
    p = launch(args(data_dir, tmp_path, "ddp", "--micro-batch", "1", *steps), nproc=2)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    train(*args(data_dir, tmp_path, "micro2", "--micro-batch", "2", *steps))
    train(*args(data_dir, tmp_path, "accum2", "--micro-batch", "1", "--grad-accum", "2", *steps))
    ddp, micro2, accum2 = (params(tmp_path / r / "ckpt-0000003") for r in ("ddp", "micro2", "accum2"))
    assert max_diff(ddp, micro2) <= 1e-6
    assert max_diff(accum2, micro2) <= 1e-6
    # the comparison is not vacuous: the parameters did move
    first = train(*args(data_dir, tmp_path, "one", "--micro-batch", "2", *steps[2:], "--max-steps", "1"))
    assert max_diff(params(first["run_dir"] / "ckpt-0000001"), micro2) > 1e-5
    assert "global batch 2 = micro 1 x accum 1 x world 2" in out


def wait_for(pred, proc, timeout=300):
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError("training ended before the interruption: " + proc.stdout.read()[-3000:])
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_resume_equals_uninterrupted(data_dir, tmp_path, how):
    total = 8
    run = tmp_path / "cut"
    extra = ["--max-steps", "1000", "--ckpt-every", "2"]
    p = launch(args(data_dir, tmp_path, "cut", *extra))
    if how == "sigterm":  # SIGTERM after step 2 is logged: checkpoint at the current step, clean exit
        wait_for(lambda: (run / "metrics.jsonl").exists() and len(losses(run)) >= 2, p)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        assert "checkpoint written" in out
    else:  # hard kill once the first checkpoint is complete
        wait_for(lambda: (run / "ckpt-0000002" / "config.json").exists(), p)
        p.kill()
        p.communicate(timeout=60)
    ckpts = sorted(run.glob("ckpt-*"))
    cut = int(ckpts[-1].name.split("-")[1])
    assert 2 <= cut < total, f"interrupted at {cut}"
    assert not list(run.glob(".tmp-ckpt-*")) or how == "kill"
    train(*args(data_dir, tmp_path, "cut", "--max-steps", str(total), "--ckpt-every", "2", "--resume", "auto"))
    ref = train(*args(data_dir, tmp_path, "full", "--max-steps", str(total), "--ckpt-every", "2"))
    want, got = losses(ref["run_dir"]), losses(run)
    assert sorted(want) == list(range(1, total + 1)) and sorted(got) == list(range(1, total + 1))
    assert max(abs(want[s] - got[s]) for s in want) <= 1e-6
    assert max_diff(params(run / f"ckpt-{total:07d}"), params(ref["run_dir"] / f"ckpt-{total:07d}")) <= 1e-6


def test_train_and_infer_build_the_same_condition(data_dir, tiny_dir):
    """The condition a training sample gets == what A2Pipeline builds at inference from the same files."""
    from a2.pipeline import A2Pipeline, load_references, prepare_latents
    from config import A2_ELEMENTS, DatasetConfig
    from data import E2VDataset, collate

    ds = E2VDataset([DatasetConfig(str(data_dir), target_resolution=(32, 32))], num_frames=9, verbose=False)
    batch = collate([ds[0]])
    files = [(e, data_dir / f"{ds.samples[0].id}{e.suffixes[0]}") for e in A2_ELEMENTS]
    refs, clips, repeats = load_references(files, (32, 32), (512, 512))
    assert torch.equal(batch["ref_vae"], refs) and torch.equal(batch["ref_clip"], clips)
    assert batch["repeats"] == repeats == (1, 4, 4)
    pipe = A2Pipeline.from_pretrained(tiny_dir)
    with torch.no_grad():
        train_cond = prepare_latents(pipe.vae, 21, references=batch["ref_vae"], repeats=batch["repeats"],
                                     sample_mode="sample", generator=[torch.Generator().manual_seed(3)])
    g = torch.Generator().manual_seed(3)
    torch.randn(1, 16, 6, 4, 4, generator=g)  # inference draws its noise first (A2's order)
    with torch.no_grad():
        want = prepare_latents(pipe.vae, 21, references=refs, repeats=repeats, sample_mode="sample", generator=g)
    out = pipe("x", refs, clips, repeats, height=32, width=32, num_frames=21, num_inference_steps=1,
               generator=torch.Generator().manual_seed(3), decode="none", progress=False)
    assert torch.equal(out["condition"], want.condition)
    assert not torch.equal(train_cond.condition, want.condition)  # a different posterior draw is visible...
    with torch.no_grad():
        a = prepare_latents(pipe.vae, 21, references=batch["ref_vae"], repeats=batch["repeats"]).condition
        b = prepare_latents(pipe.vae, 21, references=refs, repeats=repeats).condition
    assert torch.equal(a, b)  # ...and the same draw (posterior mode) gives the same tensor


def test_lora_export_loads_in_infer_and_diffusers(data_dir, tmp_path, tiny_dir):
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    import infer

    r = train(*args(data_dir, tmp_path, "lora", "--max-steps", "4", "--lr", "5e-2", "--warmup-steps", "0",
                    model=tiny_dir))
    lora = r["weights"]
    assert lora.name == "pytorch_lora_weights.safetensors" and lora.exists()
    sd = load_file(lora)
    assert all(k.startswith("transformer.") for k in sd) and any("lora_B" in k for k in sd)
    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    base = dict(model=str(tiny_dir), elements=els, height=32, width=32, num_frames=21, steps=2, device="cpu",
                decode="none")
    infer.main(infer.InferConfig(**base, save_latents=str(tmp_path / "plain.pt")))
    assert infer.main(infer.InferConfig(**base, lora=str(lora), compare=str(tmp_path / "plain.pt"))) == 1
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    image = Image.open(els[0]).convert("RGB").resize((32, 32))
    kw = dict(image=image, prompt="a square", height=32, width=32, num_frames=9, num_inference_steps=2,
              output_type="latent")
    before = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
    pipe.load_lora_weights(str(lora.parent))
    after = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
    assert (after - before).abs().max() > 1e-4


def test_bad_configs_fail_before_training(data_dir, tmp_path):
    from config import ConfigError

    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "elements": [
        {"name": "subject", "suffixes": ["_person.png"], "vae_repeet": 1}]}]}))
    with pytest.raises(ConfigError, match=r"bad.json: datasets\[0\].elements\[0\]: unknown key\(s\) \['vae_repeet'\]"):
        train("--dataset-config", str(cfg), "--output-dir", str(tmp_path))
    with pytest.raises(ValueError, match="multiples of 16"):
        train(*args(data_dir, tmp_path, "r"), "--resolution", "30", "32")
    with pytest.raises(ValueError, match="global batch 8 .* larger than every bucket"):
        train(*args(data_dir, tmp_path, "b", "--micro-batch", "4", "--grad-accum", "2"))
    with pytest.raises(ValueError, match="unknown option 'repeat4'"):
        train(*args(data_dir, tmp_path, "e", "--elements", "subject=_person.png:repeat4"))
    assert not list(tmp_path.glob("*/ckpt-*"))  # nothing trained


def test_overfit_one_batch(data_dir, tmp_path):
    """One batch, the same sigma/noise each lap (--overfit-batches 1): the loss must collapse, not just drift.
    (With fresh noise each step the loss has a floor: at small sigma the noise cannot be inferred from x_t.)"""
    argv = args(data_dir, tmp_path, "overfit", "--training-type", "full", "--overfit-batches", "1",
                "--max-steps", "40", "--warmup-steps", "5")
    run = train(*argv)
    per_step = losses(run["run_dir"])
    assert per_step[1] / per_step[40] >= 5, per_step
    # the loop really repeated one sample: a run that sees the data normally does not collapse the same way
    normal = losses(train(*args(data_dir, tmp_path, "normal", "--training-type", "full", "--max-steps", "40",
                                "--warmup-steps", "5"))["run_dir"])
    assert normal[40] > 5 * per_step[40], (normal, per_step)
