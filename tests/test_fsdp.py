"""--fsdp (FSDP2) on CPU/gloo. Full fine-tuning, 2 ranks with gradient accumulation: the same update as DDP (params,
loss, clipped grad norm), sharded checkpoint -> resume == uninterrupted. A LoRA with its frozen base sharded over 2 and
4 ranks == one process, resumed, exported and loaded by infer.py. Compared weights are full tensors: the export
(gathered on rank 0) and the sharded checkpoint converted to one file."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import args, launch, losses, max_diff, train

# micro-batch 1 x accumulation 2 x 2 ranks; adam-eps: see OptimConfig.adam_eps
STEPS = ["--training-type", "full", "--grad-accum", "2", "--lr", "1e-2", "--adam-eps", "1e-4", "--ckpt-every", "2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("data") / "e2v", num_samples=4, num_frames=17,
                                  size=(32, 32))


def run2(data_dir, out, run, *extra):
    return launch(args(data_dir, out, run, *STEPS, *extra), nproc=2), out / run


def finish(p):
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-4000:]
    return log


def exported(run_dir):
    return load_file(run_dir / "transformer" / "diffusion_pytorch_model.safetensors")


def metrics(run_dir, key):
    return {r["step"]: r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """FSDP and DDP, 2 ranks x micro-batch 1 x accumulation 2, 4 steps, checkpoints at 2 and 4 (launched together)."""
    out = tmp_path_factory.mktemp("runs")
    (pf, fsdp), (pd, ddp) = run2(data_dir, out, "fsdp", "--fsdp", "--max-steps", "4"), run2(data_dir, out, "ddp",
                                                                                              "--max-steps", "4")
    return dict(fsdp=fsdp, ddp=ddp, fsdp_log=finish(pf), ddp_log=finish(pd))


def test_fsdp_equals_ddp(runs):
    fsdp, ddp, log = runs["fsdp"], runs["ddp"], runs["fsdp_log"]
    assert "full, FSDP2" in log and "global batch 4 = micro 1 x accum 2 x world 2" in log
    assert len(list((fsdp / "ckpt-0000004" / "sharded").glob("*.distcp"))) == 2  # one file per rank
    assert not (fsdp / "ckpt-0000004" / "trainable.safetensors").exists()
    a, b = exported(fsdp), exported(ddp)  # fsdp: gathered on rank 0 at the end
    assert all(a[k].shape == b[k].shape for k in a)  # full tensors, not shards
    diff = max_diff(a, b)
    print(f"FSDP vs DDP after 4 steps: max |param diff| {diff:.3g}")
    assert diff <= 1e-6
    assert max_diff(a, load_file(ddp / "ckpt-0000002" / "trainable.safetensors")) > 1e-4  # the weights did move
    for key, tol in (("loss", 1e-6), ("grad_norm", 1e-5)):  # grad_norm: the total norm clipped over DTensor grads
        got, want = metrics(fsdp, key), metrics(ddp, key)
        assert sorted(got) == [1, 2, 3, 4] and max(abs(got[s] - want[s]) for s in want) <= tol, (key, got, want)
    from a2.model.transformer import load_transformer

    load_transformer(fsdp)  # the export is a loadable transformer dir


def test_fsdp_resume_equals_uninterrupted(runs, data_dir, tmp_path):
    """The 4-step run's step-2 checkpoint is what a run stopped at step 2 leaves (the same save at the same
    point); put in a fresh run dir, --resume auto continues it to step 4. The resumed run turns an EMA on, which the
    checkpoint does not hold: it starts at the weights, and changes no weight or moment."""
    full = runs["fsdp"]
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(full / "ckpt-0000002", cut / "ckpt-0000002")
    p, _ = run2(data_dir, tmp_path, "cut", "--fsdp", "--max-steps", "4", "--resume", "auto", "--ema-decay", "0.9")
    log = finish(p)
    assert (cut / "transformer_ema").is_dir()
    assert f"resumed from {cut / 'ckpt-0000002'} at step 2" in log
    want, got = losses(full), losses(cut)
    assert sorted(got) == [3, 4] and max(abs(want[s] - got[s]) for s in got) <= 1e-6, (want, got)
    assert max_diff(exported(full), exported(cut)) <= 1e-6
    # the sharded checkpoints themselves, gathered into one file: model and optimizer state equal, full shapes
    ckpts = []
    for r in (full, cut):
        dcp_to_torch_save(r / "ckpt-0000004" / "sharded", tmp_path / f"{r.name}.pt")
        ckpts.append(torch.load(tmp_path / f"{r.name}.pt", weights_only=False))
    (m1, o1), (m2, o2) = ((c["model"], c["optim"]["state"]) for c in ckpts)
    ref = exported(full)
    assert m1.keys() == ref.keys() and all(m1[k].shape == ref[k].shape for k in ref)
    assert max_diff(m1, m2) <= 1e-6 and max_diff(m1, ref) == 0
    for k in ref:
        assert o1[k]["step"] == o2[k]["step"] == 4
        assert max_diff({s: o1[k][s] for s in ("exp_avg", "exp_avg_sq")},
                        {s: o2[k][s] for s in ("exp_avg", "exp_avg_sq")}) <= 1e-6


def _replica_rank(rank: int, init_file: str, out: str, preset: str) -> None:
    """One of two gloo ranks: only rank 0 has a transformer; both end with sharded copies of it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    from a2.model.parallel import meta_replica, shard_from_rank0
    from a2.model.transformer import preset_config, transformer_class

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = None
    if rank == 0:
        torch.manual_seed(0)
        model = transformer_class(preset_config(preset))(**preset_config(preset))
        torch.save(model.state_dict() | dict(model.named_buffers()), f"{out}/want.pt")
    replica, source = meta_replica(model, lambda m: m)
    assert all(p.is_meta for p in replica.parameters()) and (source is None) == (rank != 0)
    shard_from_rank0(replica, source, torch.device("cpu"), torch.float32)
    assert all(isinstance(b, FSDPModule) for b in [*replica.blocks, *getattr(replica, "vace_blocks", ())])
    full = get_model_state_dict(replica, options=StateDictOptions(full_state_dict=True))  # a collective
    torch.save(full | dict(replica.named_buffers()), f"{out}/got{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("preset", ["tiny", "tiny-vace"])
def test_fsdp_weights_come_from_rank0(tmp_path, preset):
    """--fsdp reads the weights on rank 0 only: the other ranks build the model on the meta device and receive
    their shards, and the RoPE tables (buffers outside the state dict), from rank 0; each block is sharded alone,
    VACE's context blocks too."""
    import torch.multiprocessing as mp

    mp.spawn(_replica_rank, args=(str(tmp_path / "init"), str(tmp_path), preset), nprocs=2)
    want = torch.load(tmp_path / "want.pt")
    assert {"rope.freqs_cos", "rope.freqs_sin"} <= want.keys()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"got{rank}.pt")
        assert got.keys() == want.keys()
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want), rank


def test_fsdp_compile_follows_eager(runs, data_dir, tmp_path):
    """--fsdp --compile, also with --save-attention: each block's forward (its checkpoint inside) is compiled and
    FSDP2's hooks stay outside it; the same losses as eager FSDP."""
    launched = [run2(data_dir, tmp_path, name, "--fsdp", "--compile", *extra, "--max-steps", "2")
                for name, extra in (("compiled", ()), ("compiled-sac", ("--save-attention",)))]
    for p, run in launched:
        finish(p)
        for key, tol in (("loss", 1e-5), ("grad_norm", 1e-4)):
            got, want = metrics(run, key), metrics(runs["fsdp"], key)
            assert sorted(got) == [1, 2] and max(abs(got[s] - want[s]) for s in got) <= tol, (run, key, got, want)


# LoRA, global batch 4, 4 steps, checkpoints at 2 and 4; adam-eps: see OptimConfig.adam_eps; alpha = rank (scale 1),
# not the tiny recipe's 10x, which at lr 1e-2 diverges by step 4 (loss 20) where fp32 summation order shows
LORA = ["--lr", "1e-2", "--lora-alpha", "32", "--adam-eps", "1e-4", "--ckpt-every", "2", "--max-steps", "4"]


@pytest.fixture(scope="module")
def lora_runs(data_dir, tmp_path_factory):
    """A LoRA's global batch of 4 in one process (accumulation 4) and with --fsdp on 2 (accumulation 2) and 4 gloo
    ranks, launched together."""
    out = tmp_path_factory.mktemp("lora")
    procs = dict(one=launch(args(data_dir, out, "one", *LORA, "--grad-accum", "4")),
                 fsdp2=launch(args(data_dir, out, "fsdp2", *LORA, "--fsdp", "--grad-accum", "2"), nproc=2),
                 fsdp4=launch(args(data_dir, out, "fsdp4", *LORA, "--fsdp"), nproc=4))
    return out, {k: finish(p) for k, p in procs.items()}


def adapter(run_dir):
    return load_file(run_dir / "pytorch_lora_weights.safetensors")


def test_fsdp_lora_equals_one_process(lora_runs):
    """--fsdp shards a LoRA's frozen base over 2 and 4 ranks (each holds 1/N of every weight) and trains its adapter as
    one process does: the same losses (1e-6) and exported adapter (1e-5); each sharded checkpoint holds the adapter
    and its optimizer state alone, one file per rank."""
    from torch.distributed.checkpoint import FileSystemReader

    out, logs = lora_runs
    for run, ranks in (("fsdp2", 2), ("fsdp4", 4)):
        assert "(lora, FSDP2)" in logs[run] and f"micro 1 x accum {4 // ranks} x world {ranks}" in logs[run]
        got, want = metrics(out / run, "loss"), metrics(out / "one", "loss")
        assert sorted(got) == [1, 2, 3, 4] and max(abs(got[s] - want[s]) for s in want) <= 1e-6, (run, got, want)
        diff = max_diff(adapter(out / run), adapter(out / "one"))
        print(f"LoRA --fsdp on {ranks} ranks vs one process after 4 steps: max |adapter diff| {diff:.3g}")
        assert diff <= 1e-5
        sharded = out / run / "ckpt-0000004" / "sharded"
        assert len(list(sharded.glob("*.distcp"))) == ranks
        keys = [k for k in FileSystemReader(str(sharded)).read_metadata().state_dict_metadata if k.startswith("model.")]
        assert keys and all(".lora_" in k for k in keys), keys[:4]  # the frozen base is not written
    trained = adapter(out / "one")
    assert max(v.abs().max() for k, v in trained.items() if ".lora_B." in k) > 1e-3  # (lora_B starts at zero)


def test_fsdp_lora_resumes(lora_runs, data_dir, tmp_path):
    """The 2-rank run's step-2 checkpoint, put in a fresh run dir, resumes with --fsdp on 2 ranks to step 4: the
    uninterrupted run's losses and adapter."""
    out, _ = lora_runs
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(out / "fsdp2" / "ckpt-0000002", cut / "ckpt-0000002")
    log = finish(launch(args(data_dir, tmp_path, "cut", *LORA, "--fsdp", "--grad-accum", "2", "--resume", "auto"),
                        nproc=2))
    assert f"resumed from {cut / 'ckpt-0000002'} at step 2" in log
    want, got = losses(out / "fsdp2"), losses(cut)
    assert sorted(got) == [3, 4] and max(abs(want[s] - got[s]) for s in got) <= 1e-6, (want, got)
    assert max_diff(adapter(cut), adapter(out / "fsdp2")) <= 1e-6


def test_fsdp_lora_loads_in_infer(lora_runs, data_dir, tmp_path):
    """The LoRA exported by the 4-rank --fsdp run loads in infer.py as the one-process run's does: the same latents
    (its weights equal to 1e-5), and not the base model's."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out, _ = lora_runs
    common = ["--model", "tiny", "--height", "32", "--width", "32", "--num-frames", "21", "--steps", "2", "--device",
              "cpu", "--prompt", "a person", "--seed", "1", "--elements",
              *(str(data_dir / f"000_{e}.png") for e in ("person", "object", "background"))]
    latents = {}
    for name, lora in (("one", ["--lora", str(out / "one")]), ("fsdp4", ["--lora", str(out / "fsdp4")]),
                       ("base", [])):
        subprocess.run([sys.executable, str(ROOT / "infer.py"), *common, *lora, "--out", str(tmp_path / f"{name}.mp4"),
                        "--save-latents", str(tmp_path / f"{name}.pt")], check=True, capture_output=True)
        latents[name] = torch.load(tmp_path / f"{name}.pt")["latents"]
    assert (latents["fsdp4"] - latents["one"]).abs().max() <= 1e-4 * latents["one"].abs().max()
    assert (latents["base"] - latents["one"]).abs().max() > 1e-3 * latents["one"].abs().max()


def test_fsdp_on_mixed_element_sets_equals_one_process(tmp_path):
    """2 FSDP ranks x micro-batch 1 on clips of three element sets (3, 2 and 1 element images, two clips each: a
    global batch holds one bucket, so both ranks take the same set and the same sequence length) == one process x
    micro-batch 2 on the same samples: the losses and the weights after an epoch of every bucket."""
    from data import make_synthetic_dataset

    d = make_synthetic_dataset(tmp_path / "data", num_samples=6, num_frames=17, size=(32, 32))
    for f in ("002_object.png", "003_object.png", "004_object.png", "004_background.png", "005_object.png",
              "005_background.png"):
        (d / f).unlink()
    steps = ["--training-type", "full", "--lr", "1e-2", "--adam-eps", "1e-4", "--max-steps", "3"]
    p = launch(args(d, tmp_path, "fsdp", *steps, "--fsdp", "--micro-batch", "1"), nproc=2)
    log = finish(p)
    one = train(*args(d, tmp_path, "one", *steps, "--micro-batch", "2"))["run_dir"]
    for names in ("subject, object, background", "subject, background", "subject"):
        assert f"[{names}]: 2 samples" in log, log[-3000:]
    assert "global batch 2 = micro 1 x accum 1 x world 2" in log
    fsdp = tmp_path / "fsdp"
    diff = max_diff(exported(fsdp), exported(one))
    print(f"FSDP on mixed element sets vs one process after 3 steps: max |param diff| {diff:.3g}")
    assert diff <= 1e-6
    from a2.model.tiny import model_path

    assert max_diff(exported(one), exported(model_path("tiny"))) > 1e-4  # the weights did move
    got, want = metrics(fsdp, "loss"), metrics(one, "loss")
    assert sorted(got) == sorted(want) == [1, 2, 3] and max(abs(got[s] - want[s]) for s in want) <= 1e-6, (got, want)
    assert len({round(v, 4) for v in want.values()}) == 3  # three different batches
