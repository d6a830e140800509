"""train_a2.py: DDP == one process == accumulation, resume == uninterrupted (SIGTERM and hard kill),
train/infer conditioning parity, LoRA export loads in infer.py and diffusers, bad configs fail early."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from a2.train.runs import EXIT_RESUMABLE
from tests.conftest import args, children, launch, losses, max_diff, params, train, wait_for


def test_ddp_equals_one_process_and_accumulation(data_dir, tmp_path):
    steps = ["--max-steps", "3", "--lr", "1e-2", "--adam-eps", "1e-4"]  # see OptimConfig.adam_eps
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


# 2 ranks x micro 1 == 1 process x micro 2 (the same global batch; AdamW's eps as in the DDP test): a run stopped
# under torchrun resumes in one process (a DDP checkpoint at another world size), and all compare with one reference
RESUME_TOTAL = 8
RESUMED = ["--max-steps", str(RESUME_TOTAL), "--ckpt-every", "2", "--micro-batch", "2", "--adam-eps", "1e-4"]



@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    return train(*args(data_dir, tmp_path_factory.mktemp("ref"), "full", *RESUMED))["run_dir"]


# how the run is stopped: SIGTERM to the python process, kill -9, SIGTERM to its process group (what a scheduler
# sends on preemption: the loader workers get it too), SIGTERM to torchrun (it forwards it to its 2 ranks), SIGTERM
# to one of torchrun's ranks. Value: processes.
STOPS = {"sigterm": 1, "kill": 1, "group": 1, "torchrun": 2, "one-rank": 2}


@pytest.mark.parametrize("how", list(STOPS))
def test_resume_equals_uninterrupted(data_dir, tmp_path, uninterrupted, how):
    total, nproc = RESUME_TOTAL, STOPS[how]
    run = tmp_path / "cut"
    workers = ["--num-workers", "1"] if how in ("group", "torchrun") else []
    extra = ["--max-steps", "1000", "--ckpt-every", "2", "--micro-batch", str(2 // nproc), "--adam-eps", "1e-4"]
    p = launch(args(data_dir, tmp_path, "cut", *extra, *workers), nproc=nproc, start_new_session=True)
    if how == "kill":  # hard kill once the first checkpoint is complete
        wait_for(lambda: (run / "ckpt-0000002" / "config.json").exists(), p)
        p.kill()
        p.communicate(timeout=60)
    else:  # a signal after step 2 is logged: every rank finishes its step, checkpoints it and exits 143
        wait_for(lambda: (run / "metrics.jsonl").exists() and len(losses(run)) >= 2, p)
        if how == "group":
            os.killpg(p.pid, signal.SIGTERM)
        elif how == "one-rank":
            os.kill(children(p.pid)[0], signal.SIGTERM)
        else:
            p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
        # torchrun itself exits 1 whenever a rank exits non-zero; the ranks exit 143 (EXIT_RESUMABLE)
        assert p.returncode == (1 if nproc > 1 else EXIT_RESUMABLE), out[-3000:]
        assert out.count(f"exit {EXIT_RESUMABLE} (resumable") == 1, out[-3000:]
        assert "DataLoader worker" not in out and "Traceback" not in out.split("(resumable")[0], out[-3000:]
    ckpts = sorted(run.glob("ckpt-*"))
    cut = int(ckpts[-1].name.split("-")[1])
    assert 2 <= cut < total, f"interrupted at {cut}"
    assert all((c / "manifest.json").exists() for c in ckpts)
    assert not list(run.glob(".tmp-ckpt-*")) or how == "kill"
    train(*args(data_dir, tmp_path, "cut", *RESUMED, "--resume", "auto"))
    want, got = losses(uninterrupted), losses(run)
    assert sorted(want) == list(range(1, total + 1)) and sorted(got) == list(range(1, total + 1))
    tol = 1e-6 if nproc == 1 else 1e-5
    assert max(abs(want[s] - got[s]) for s in want) <= tol
    assert max_diff(params(run / f"ckpt-{total:07d}"), params(uninterrupted / f"ckpt-{total:07d}")) <= tol
    # metrics.jsonl was cut back to the checkpoint (each step once); config.json: the run's config + one resume
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, total + 1))
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["max_steps"] == 1000 and [r["step"] for r in cfg["resumes"]] == [cut]
    assert cfg["resumes"][0]["changed"]["max_steps"] == [1000, total]


def test_resume_auto_skips_a_broken_checkpoint(data_dir, tmp_path, uninterrupted, capsys):
    run = tmp_path / "r"
    train(*args(data_dir, tmp_path, "r", *RESUMED[2:], "--max-steps", "6"))
    weights = run / "ckpt-0000006" / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # e.g. a copy cut short by a full disk
    capsys.readouterr()
    train(*args(data_dir, tmp_path, "r", *RESUMED, "--resume", "auto"))
    out = capsys.readouterr().out
    assert f"resume: skipping {run / 'ckpt-0000006'}: trainable.safetensors has" in out
    assert f"resumed from {run / 'ckpt-0000004'} at step 4" in out
    want, got = losses(uninterrupted), losses(run)
    assert sorted(got) == list(range(1, RESUME_TOTAL + 1)) and max(abs(want[s] - got[s]) for s in want) <= 1e-6


def test_main_leaves_the_process_as_it_found_it(data_dir, tmp_path, monkeypatch):
    """train_a2.main called in process (a notebook, a test) leaves no SIGTERM/SIGINT handler and no process group
    behind, whether it refuses its config, raises in the loop or returns, and runs again in the same process. --fsdp
    in one process makes a one-rank group: after a failed run the next one died with "trying to initialize the
    default process group twice", and after any run a SIGTERM to the caller raised the run's Stopped."""
    import torch.distributed as dist

    import train_a2
    from config import ConfigError

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def as_found():
        return {s: signal.getsignal(s) for s in before} == before and not dist.is_initialized()

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a dir to write into"):  # refused once the group exists
        train(*args(data_dir, tmp_path / "file", "r", "--fsdp"))
    assert as_found()

    def fails(*a, **k):
        raise RuntimeError("an error in the loop")

    with monkeypatch.context() as m:
        m.setattr(train_a2, "optimizer_step", fails)
        with pytest.raises(RuntimeError, match="an error in the loop"):  # the loop's signal handlers installed
            train(*args(data_dir, tmp_path, "failed", "--fsdp", "--max-steps", "2"))
    assert as_found()
    r = train(*args(data_dir, tmp_path, "again", "--fsdp", "--max-steps", "1"))
    assert r["step"] == 1 and not r["interrupted"] and as_found()


def test_run_dir_lock_and_resume_refusals(data_dir, tmp_path, monkeypatch, capsys):
    import train_a2
    from a2.train.runs import ResumeError, RunLocked

    run = tmp_path / "busy"
    p = launch(args(data_dir, tmp_path, "busy", "--max-steps", "1000", "--ckpt-every", "1"))
    try:
        wait_for(lambda: (run / "ckpt-0000001" / "config.json").exists(), p)
        with pytest.raises(RunLocked, match=rf"{run}: in use by another run \(pid {p.pid} on "):
            train(*args(data_dir, tmp_path, "busy", "--resume", "auto"))
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=300)
    assert p.returncode == EXIT_RESUMABLE
    before = sorted(x.name for x in run.iterdir())

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(train_a2, "load_transformer", no_model)  # every refusal comes before any model loads
    with pytest.raises(ResumeError, match=rf"{run} already holds checkpoints .* give --resume auto"):
        train(*args(data_dir, tmp_path, "busy"))
    with pytest.raises(ResumeError, match=r"trained with --lora-rank 32, this run has 4: the weights do not fit"):
        train(*args(data_dir, tmp_path, "busy", "--resume", "auto", "--lora-rank", "4"))
    with pytest.raises(ResumeError, match=r"trained with --training-type lora, this run has full"):
        train(*args(data_dir, tmp_path, "busy", "--resume", "auto", "--training-type", "full"))
    assert sorted(x.name for x in run.iterdir()) == before  # refused runs changed nothing
    # --resume auto on a run dir that does not exist says so (a mistyped name starts a new run, visibly)
    monkeypatch.undo()
    capsys.readouterr()
    train(*args(data_dir, tmp_path, "bsuy", "--resume", "auto", "--max-steps", "1"))
    said = capsys.readouterr().out
    assert f"resume: --resume auto: {tmp_path / 'bsuy'} does not exist yet: starting a new run" in said


def test_divergence_stops_naming_the_last_finite_checkpoint(data_dir, tmp_path):
    from a2.train.runs import Diverged

    run = tmp_path / "lr1e6"
    with pytest.raises(Diverged, match="3 times in a row") as e:
        train(*args(data_dir, tmp_path, "lr1e6", "--lr", "1e6", "--ckpt-every", "1", "--max-steps", "50",
                    "--training-type", "full"))
    named = str(e.value).split("the last checkpoint with finite weights: ")[1].split(" ")[0]
    ckpts = sorted(run.glob("ckpt-*"))
    print(e.value, [c.name for c in ckpts])
    assert named == (str(ckpts[-1]) if ckpts else "none")
    for c in ckpts:  # no checkpoint was written from non-finite weights
        assert all(torch.isfinite(t).all() for t in params(c).values()), c


def test_a_non_finite_step_is_skipped(data_dir, tmp_path, monkeypatch):
    """A NaN gradient at step 2 (of 4): its update is skipped, the run goes on; the checkpoint of step 2 waits."""
    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def poisoned(params, max_norm):
        calls.append(1)
        if len(calls) == 2:
            for p in params:
                p.grad.fill_(float("nan"))
        return clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)
    r = train(*args(data_dir, tmp_path, "nan", "--ckpt-every", "1", "--max-steps", "4", "--keep-last", "10"))
    rows = [json.loads(line) for line in (r["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped_steps"] for row in rows] == [0, 1, 1, 1]
    assert sorted(c.name for c in r["run_dir"].glob("ckpt-*")) == ["ckpt-0000001", "ckpt-0000003", "ckpt-0000004"]
    opt = torch.load(r["run_dir"] / "ckpt-0000004" / "optimizer.pt", weights_only=True)
    assert {s["step"].item() for s in opt["state"].values()} == {3.0}  # 4 steps, one skipped
    assert r["weights"].exists() and all(torch.isfinite(t).all() for t in params(r["run_dir"] / "ckpt-0000004")
                                         .values())


def test_train_and_infer_build_the_same_condition(data_dir, tiny_dir):
    """The condition a training sample gets == what A2Pipeline builds at inference from the same files."""
    from a2.config.dataset_config import DatasetConfig
    from a2.data.loader import collate
    from a2.elements import A2_ELEMENTS
    from a2.images import load_references
    from a2.kinds.conditioning import make_layout, prepare_latents
    from a2.pipeline import A2Pipeline
    from data import E2VDataset

    ds = E2VDataset([DatasetConfig(str(data_dir), target_resolution=(32, 32))], num_frames=9, verbose=False)
    batch = collate([ds[0]])
    files = [(e, data_dir / f"{ds.samples[0].id}{e.suffixes[0]}") for e in A2_ELEMENTS]
    refs, clips, repeats, _ = load_references(files, (32, 32), (512, 512))
    assert torch.equal(batch["ref_vae"], refs) and torch.equal(batch["ref_clip"], clips)
    assert batch["repeats"] == repeats == (1, 4, 4)
    pipe = A2Pipeline.from_pretrained(tiny_dir)
    with torch.no_grad():
        layout = make_layout("prefix", 21, batch["repeats"])
        train_cond = prepare_latents(pipe.vae, layout, references=batch["ref_vae"], sample_mode="sample",
                                     generator=[torch.Generator().manual_seed(3)])
    g = torch.Generator().manual_seed(3)
    torch.randn(1, 16, 6, 4, 4, generator=g)  # inference draws its noise first (A2's order)
    with torch.no_grad():
        want = prepare_latents(pipe.vae, make_layout("prefix", 21, repeats), references=refs, sample_mode="sample",
                               generator=g)
    out = pipe("x", refs, clips, layout=pipe.plan(21, repeats), height=32, width=32, num_inference_steps=1,
               generator=torch.Generator().manual_seed(3), decode="none", progress=False, sample_mode="sample")
    assert torch.equal(out["condition"], want.condition)  # A2's draw order (a Wan2.1 I2V dir takes the mean)
    assert not torch.equal(train_cond.condition, want.condition)  # a different posterior draw is visible...
    with torch.no_grad():
        a = prepare_latents(pipe.vae, layout, references=batch["ref_vae"]).condition
        b = prepare_latents(pipe.vae, make_layout("prefix", 21, repeats), references=refs).condition
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
    infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "plain.pt")))
    assert infer.main(infer.InferConfig.from_flags(**base, lora=str(lora), compare=str(tmp_path / "plain.pt"))) == 1
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
    from a2.cli import ConfigError

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
    with pytest.raises(ConfigError, match="--val-elements: .*nope.png: element .subject. image not found"):
        train(*args(data_dir, tmp_path, "v", "--val-elements", str(tmp_path / "nope.png")))
    with pytest.raises(ValueError, match="--val-prompt is empty"):
        train(*args(data_dir, tmp_path, "p", "--val-every", "2", "--val-prompt", " "))
    with pytest.raises(ConfigError, match=r"^--val-elements: the inplace kind conditions on frames of the clip "
                                          r"\(--frame-conditioning first\), which neither validation nor infer.py"):
        train(*args(data_dir, tmp_path, "i", "--frame-conditioning", "first", "--num-frames", "17",
                    "--val-elements", str(data_dir / "000_person.png")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]  # refused runs leave nothing behind


def test_overfit_one_batch(data_dir, tmp_path):
    """One batch, the same sigma/noise each lap (--overfit-batches 1): the loss must collapse, not just drift.
    (With fresh noise each step the loss has a floor: at small sigma the noise cannot be inferred from x_t.)"""
    argv = args(data_dir, tmp_path, "overfit", "--training-type", "full", "--overfit-batches", "1",
                "--max-steps", "40", "--warmup-steps", "5")
    run = train(*argv)
    per_step = losses(run["run_dir"])
    assert per_step[1] / per_step[40] >= 5, per_step
    # the full model is exported twice: a diffusers transformer dir and one bf16 file in original Wan keys (ComfyUI)
    from a2.model.transformer import original_to_diffusers

    exported = load_file(run["weights"] / "diffusion_pytorch_model.safetensors")
    wan = original_to_diffusers(load_file(run["run_dir"] / "transformer_comfy.safetensors"))
    assert wan.keys() == exported.keys() and all(torch.equal(wan[k], exported[k].bfloat16()) for k in exported)
    # the loop really repeated one sample: a run that sees the data normally does not collapse the same way
    normal = losses(train(*args(data_dir, tmp_path, "normal", "--training-type", "full", "--max-steps", "40",
                                "--warmup-steps", "5"))["run_dir"])
    assert normal[40] > 5 * per_step[40], (normal, per_step)


def test_offload_and_block_swap_equal_the_plain_run(data_dir, tmp_path, monkeypatch):
    """--offload-activations and --swap-blocks move tensors to host memory and back, and change nothing
    else: the same losses and LoRA weights, bit for bit, with recomputation keeping the attention."""
    import a2.memory.offload
    from a2.cli import ConfigError

    monkeypatch.setattr(a2.memory.offload, "MIN_BYTES", 0)  # the tiny model's tensors are all far below 1 MB
    offloaded, prefetch = [], a2.memory.offload.Offloaded.prefetch

    def counted(saved):  # each offloaded tensor comes back through here once
        offloaded.append(1)
        prefetch(saved)

    monkeypatch.setattr(a2.memory.offload.Offloaded, "prefetch", counted)
    steps = ("--max-steps", "2", "--save-attention", "--lr", "1e-2")
    plain = train(*args(data_dir, tmp_path, "plain", *steps))
    moved = train(*args(data_dir, tmp_path, "moved", *steps, "--swap-blocks", "1", "--offload-activations"))
    assert offloaded and plain["losses"] == moved["losses"] and len(plain["losses"]) == 2
    a, b = load_file(plain["weights"]), load_file(moved["weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    full = ("--training-type", "full")
    for flags, refused in ((("--swap-blocks", "1"), "--swap-blocks swaps frozen weights: LoRA only"),
                           (("--swap-blocks", "1", "--fsdp"), "--swap-blocks swaps frozen weights: LoRA only"),
                           (("--offload-activations", "--fsdp"), "--offload-activations is not combined with --fsdp")):
        with pytest.raises(ConfigError, match=refused):
            train(*args(data_dir, tmp_path, "r", *full, *flags))
        if torch.distributed.is_initialized():  # --fsdp's one-rank group, made before the config is checked
            torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- every failing run exits
# train_a2.py run as `python train_a2.py` with one function of its dependencies replaced first (a step that raises, a
# signal at a given point, a full disk), with spawned loader workers, which ignore SIGTERM. The subprocess timeout
# only tells a hang (it never ends) from an exit.
PATCHED = """
import os, runpy, signal, sys, time
sys.path.insert(0, {root!r})
{patch}
sys.argv = ["train_a2.py", *sys.argv[1:]]
runpy.run_path({root!r} + "/train_a2.py", run_name="__main__")
"""
RAISE_AT_STEP_3 = """
import a2.train.flow
loss, calls = a2.train.flow.flow_loss, []
def flow_loss(*a, **k):
    calls.append(1)
    if len(calls) == 3:
        raise RuntimeError("injected: the step failed")
    return loss(*a, **k)
a2.train.flow.flow_loss = flow_loss
"""
TWO_SIGNALS_AT_STEP_2 = RAISE_AT_STEP_3.replace(
    'raise RuntimeError("injected: the step failed")',
    "os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGTERM)").replace("== 3", "== 2")
SIGNAL_AT_EXPORT = """
import a2.train.lora
def export_lora(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3600)
a2.train.lora.export_lora = export_lora
"""
DISK_FULL_AFTER_CKPT_1 = """
import shutil
usage, calls = shutil.disk_usage, []
def disk_usage(path):
    calls.append(1)
    return usage(path) if len(calls) == 1 else usage(path)._replace(free=4096)
shutil.disk_usage = disk_usage
"""


def run_patched(patch, argv):
    from tests.conftest import ROOT

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", PATCHED.format(root=str(ROOT), patch=patch), *argv], env=env,
                          capture_output=True, text=True, timeout=600)


class SharedBatches(torch.utils.data.Dataset):
    """Batches large enough that a loader worker is still sharing one into shared memory (its queue's feeder thread,
    in torch's C++ with the GIL released) when it is told to stop."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.ones(16_000_000)  # 64 MB


def test_a_loader_worker_stopped_while_it_sends_a_batch_exits_cleanly():
    """The cause of `terminate called without an active exception` / `DataLoader worker (pid ...) is killed by
    signal: Aborted`: a spawned worker that finalizes the interpreter while its feeder thread is in C++ is aborted
    (with multiprocessing's spawn context this worker exits -6, here on every try); a2.data.loader.WorkerContext's
    workers leave with os._exit like forked ones."""
    from a2.data.loader import WorkerContext, stop_workers

    loader = torch.utils.data.DataLoader(SharedBatches(), batch_size=None, num_workers=1, prefetch_factor=4,
                                         multiprocessing_context=WorkerContext())
    batches = iter(loader)
    assert next(batches).shape == (16_000_000,)
    worker = batches._workers[0]
    stop_workers(batches)  # raises when the worker dies of a signal meanwhile (the DataLoader's SIGCHLD handler)
    assert worker.exitcode == 0


# a loader worker of the run raises on its third sample, in a step of the first epoch, where nothing caught it before
RAISE_IN_WORKER = """
import os
import data
resize, calls = data.resize_frames, []
def resize_frames(*a, **k):
    calls.append(1)
    if len(calls) == 3 and os.environ.get("A2_TEST_WORKER") and data.torch.utils.data.get_worker_info():
        raise RuntimeError("injected: the worker failed")
    return resize(*a, **k)
data.resize_frames = resize_frames
"""


def test_a_loader_worker_raising_mid_epoch_ends_the_run_in_one_line(data_dir, tmp_path):
    """An exception in a loader worker, outside what reading a file raises: the run checkpoints the step before and
    ends with one line naming the step, the sample and its file (exit 2), no traceback, no aborted worker."""
    from tests.conftest import ROOT

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RAISE_IN_WORKER)  # runs in every process, workers too
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "A2_TEST_WORKER": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "train_a2.py"), *args(data_dir, tmp_path, "r", "--num-workers",
                                                                          "1", "--max-steps", "4")],
                       env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "terminate called" not in p.stderr and "DataLoader worker" not in p.stderr
    m = re.fullmatch(r"error: stopped at step 3 on a sample that failed to load: (\S+): (\S+): failed to load "
                     r"\(RuntimeError: injected: the worker failed\); the checkpoint before it is written: .*", err[-1])
    assert m and Path(m[2]) == data_dir / f"{m[1]}.mp4", err[-1]
    assert sorted(c.name for c in (tmp_path / "r").glob("ckpt-*")) == ["ckpt-0000002"]


def test_what_the_dataloader_raises_about_a_worker_is_one_line():
    """A worker killed (the OOM killer) or failing outside a sample: LoaderError, one line (exit 1 in train_a2.py),
    not the DataLoader's multi-line message; anything else is raised as it is."""
    from a2.data.loader import LoaderError, next_batch

    def raising(e):
        raise e
        yield

    caught = ("Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
              '  File "x.py", line 1, in f\nKeyError: 7\n')
    for e, line in ((RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly"),
                     "step 5: a loader worker failed: DataLoader worker (pid(s) 123) exited unexpectedly"),
                    (KeyError(caught), "step 5: a loader worker failed: KeyError: 7")):
        with pytest.raises(LoaderError) as got:
            next_batch(raising(e), 4)
        assert str(got.value) == line
    with pytest.raises(ZeroDivisionError):
        next_batch(raising(ZeroDivisionError("x")), 4)


def test_items_that_cannot_be_batched_fail_naming_each_sample_and_file():
    from a2.data.loader import collate

    items = [dict(index=i, id=f"00{i}", file=f"/d/00{i}.mp4", bucket=(5, 8, 8, ()), prompt="p", element_names=(),
                  repeats=(), video=torch.zeros(3, 5, 8, 8 + i), ref_vae=torch.zeros(0, 3, 8, 8),
                  ref_clip=torch.zeros(0, 3, 4, 4)) for i in range(2)]
    batch = collate(items)
    assert batch["indices"] == [0, 1] and [i for i, _ in batch["failed"]] == [0, 1]
    assert batch["failed"][1][1].startswith("001: /d/001.mp4: failed to batch (RuntimeError: stack expects")


@pytest.mark.parametrize("how", ["exception", "second-signal", "signal-at-export", "disk-full"])
def test_a_failing_run_with_loader_workers_exits(data_dir, tmp_path, how):
    from a2.train.runs import checkpoint_problem

    patch = dict(exception=RAISE_AT_STEP_3, **{"second-signal": TWO_SIGNALS_AT_STEP_2,
                 "signal-at-export": SIGNAL_AT_EXPORT, "disk-full": DISK_FULL_AFTER_CKPT_1})[how]
    steps = "3" if how == "signal-at-export" else "50"
    p = run_patched(patch, args(data_dir, tmp_path, "r", "--num-workers", "1", "--ckpt-every", "1",
                                "--max-steps", steps))
    run = tmp_path / "r"
    err = p.stderr.strip().splitlines()
    want = {"exception": 1, "second-signal": 128 + signal.SIGTERM, "signal-at-export": 128 + signal.SIGTERM,
            "disk-full": 1}[how]
    assert p.returncode == want, p.stderr[-3000:]
    assert "DataLoader worker" not in p.stderr
    if how == "exception":  # a bug: its traceback, ending in the exception
        assert err[-1] == "RuntimeError: injected: the step failed", p.stderr[-3000:]
    else:  # one line, no traceback
        assert "Traceback" not in p.stderr and err[-1].startswith("error: "), p.stderr[-3000:]
    if how == "second-signal":
        assert err[-1].startswith("error: stopped by SIGTERM (a second signal): the current step is not checkpointed")
    if how == "signal-at-export":
        assert err[-1].startswith("error: stopped by SIGTERM (outside the step loop)")
    if how == "disk-full":
        assert err[-1].startswith(f"error: {run}: not enough free space for the checkpoint of step 2: 0.00 GiB (4096 "
                                  "bytes) free, it needs "), err[-1]
    # the checkpoints written before are complete and nothing half-written is left
    ckpts = sorted(run.glob("ckpt-*"))
    assert ckpts and all(checkpoint_problem(c) is None for c in ckpts) and not list(run.glob(".tmp-ckpt-*"))
    assert [c.name for c in ckpts][-1] == ("ckpt-0000003" if how == "signal-at-export" else "ckpt-0000002"
                                          if how == "exception" else "ckpt-0000001")


def test_checkpoint_write_failures_end_the_run_and_resume_continues(data_dir, tmp_path, uninterrupted, monkeypatch):
    """A write that fails midway (what a full disk does to torch.save): CheckpointError naming the run dir, the free
    space and the bytes needed; the partial temp dir removed; the earlier checkpoints untouched; --resume auto
    continues the same curve. (Too little free space, checked before writing: tests/test_runs.py.)"""
    from a2.train.runs import CheckpointError, checkpoint_problem

    run = tmp_path / "full"
    save = torch.save

    def failing(obj, f, *a, **k):  # the second checkpoint's optimizer.pt: the stream breaks midway
        if str(f).endswith(".tmp-ckpt-0000004/optimizer.pt"):
            open(f, "wb").write(b"\0" * 100)
            raise RuntimeError("basic_ios::clear: iostream error")
        return save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(CheckpointError, match=rf"^{run}: writing the checkpoint of step 4 failed \(RuntimeError: "
                                             r"basic_ios::clear: iostream error\); .* free, it needs .*; the partial "
                                             r".tmp-ckpt-0000004 is removed"):
        train(*args(data_dir, tmp_path, "full", *RESUMED, "--resume", "auto"))
    monkeypatch.undo()
    assert [c.name for c in run.glob("*ckpt-*")] == ["ckpt-0000002"]
    assert checkpoint_problem(run / "ckpt-0000002") is None
    train(*args(data_dir, tmp_path, "full", *RESUMED, "--resume", "auto"))
    want, got = losses(uninterrupted), losses(run)
    assert sorted(got) == list(range(1, RESUME_TOTAL + 1)) and max(abs(want[s] - got[s]) for s in want) <= 1e-6
