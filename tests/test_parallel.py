"""Context parallel (a2/model/parallel.py) on CPU/gloo: the forward and the gradients of a model split over 2 and 4
ranks equal one process's, for every way the references enter the sequence (t2v, A2's channel prefix with CLIP tokens,
Phantom's and SkyReels-V3's frames, Kaleido's before the video at their own RoPE positions, in-context references at
timestep 0 (per-token timesteps), Stand-In's reference tokens with their attention restriction and LoRA) and a token
count no rank count divides. One process group per size runs all of them (a group costs more to start than the tiny
forwards)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from a2 import kaleido
from a2.kinds import standin
from a2.kinds.conditioning import Conditioning, model_input
from a2.model.parallel import context_parallel
from a2.model.tiny import TINY_BUILD
from a2.model.transformer import CLIP_TOKENS, TEXT_TOKENS, configure_blocks, preset_config, random_transformer
from tests.conftest import ROOT, args, launch, max_diff, params

FORWARD = 1e-6  # |CP - one process| / max(1, |one process|): summation order of the attention over fewer heads
GRADS = 1e-5  # per parameter: max |sum over the group - one process| / max |one process|


def _model(kind: str):
    cfg = preset_config("tiny", e2v=kind == "prefix")
    model = random_transformer(cfg, torch.float32, "cpu", seed=1)
    if kind == "standin":
        standin.install(model)
        g = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if "_lora." in name:  # seeded here (install draws from the global RNG); up's zero init would leave
                # the LoRA path untested
                p.data.normal_(0, 0.02, generator=g)
        standin.packed_forward(model, (8, 6))
    if kind == "kaleido":  # its RoPE for 2 references before the video
        kaleido.prepare(model, 2)
    return model.train()


def _inputs(kind: str):
    """(hidden_states, timestep, text, image) as model_input builds them for a tiny sample of `kind`."""
    g = torch.Generator().manual_seed(3)
    frames, h, w = (3, 6, 6) if kind in ("uneven", "standin") else (2, 4, 8)
    x_t = torch.randn(1, 16, frames, h, w, generator=g)
    t = torch.tensor([700.0])
    text = torch.randn(1, TEXT_TOKENS, 32, generator=g)
    image = None
    if kind == "prefix":  # 2 references: 1 latent frame of condition, mask on it, CLIP tokens of both
        cond = Conditioning("prefix", condition=torch.randn(1, 20, frames, h, w, generator=g),
                            ref_latents=torch.randn(1, 16, 1, h, w, generator=g),
                            image=torch.randn(1, 2 * CLIP_TOKENS, 32, generator=g))
        image = cond.image
    elif kind in ("phantom", "v3", "incontext", "kaleido"):  # v3: 4 slots, the last two empty; kaleido's first
        refs = torch.randn(1, 16, 4 if kind == "v3" else 2, h, w, generator=g)
        if kind == "v3":
            refs[:, :, 2:] = 0
        cond = Conditioning(kind, ref_latents=refs, reference_timestep="zero" if kind == "incontext" else "shared")
    elif kind == "standin":  # an 8x6 reference latent: 12 tokens after 27 video tokens (39: over 4 ranks the
        # reference straddles two)
        cond = Conditioning("standin", ref_latents=torch.randn(1, 16, 1, 8, 6, generator=g))
    else:
        cond = Conditioning("t2v")
    x, t = model_input(x_t, cond, t)
    return x, t, text, image


def _step(model, kind: str, device="cpu"):
    x, t, text, image = (None if v is None else v.to(device) for v in _inputs(kind))
    model.to(device)
    out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=image,
                return_dict=False)[0]
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device)
    ((out - target) ** 2).mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


KINDS = ("t2v", "prefix", "phantom", "v3", "incontext", "standin", "kaleido", "uneven")


def _rank(rank: int, world: int, init: str, backend: str = "gloo", forward: float = FORWARD, grads: float = GRADS):
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        for kind in KINDS + ("recompute",):
            model = _model("t2v" if kind == "recompute" else kind)
            split = context_parallel(model, dist.group.WORLD)
            if kind == "recompute":  # every block recomputed, self-attention outputs kept (the save-attention policy)
                configure_blocks(model, 1.0, save_attention=True)
            out, got = _step(model, "uneven" if kind == "recompute" else kind, device)
            for g in got.values():
                dist.all_reduce(g)  # the group's partial gradients sum to the whole one
            if rank:
                continue
            reference, want = _step(_model("t2v" if kind == "recompute" else kind),
                                    "uneven" if kind == "recompute" else kind, device)
            assert out.shape == reference.shape, kind
            assert (out - reference).abs().max() <= forward * max(1.0, reference.abs().max()), kind
            assert got.keys() == want.keys(), kind
            for name, g in want.items():
                err = (got[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)
                assert err <= grads, (kind, name, float(err))
            if kind in ("uneven", "standin"):
                assert split.length % world, (kind, split.length)  # the padded path was the one tested
    finally:
        dist.destroy_process_group()


def test_context_parallel_equals_one_process(tmp_path):
    """2 and 4 gloo ranks against one process: forward within FORWARD, summed gradients within GRADS, for every
    kind, with a padded split (27 and 39 tokens over 2 and 4 ranks: Stand-In's reference tokens straddle ranks), and
    with block recomputation keeping the attention."""
    for world in (2, 4):
        mp.start_processes(_rank, args=(world, f"file://{tmp_path}/init{world}"), nprocs=world, start_method="fork")


@pytest.mark.gpu
def test_context_parallel_nccl_equals_one_gpu(tmp_path):
    """The same checks over NCCL on 2 GPUs in fp32 (TF32 off); GPU kernels may pick other reduction orders for
    other row counts, so the bounds are 10x the CPU's. Needs 2 GPUs (skipped otherwise)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    mp.start_processes(_rank, args=(2, f"file://{tmp_path}/init", "nccl", 10 * FORWARD, 10 * GRADS), nprocs=2,
                       start_method="fork")


# ---------------------------------------------------------------- train_a2.py --context-parallel under torchrun

# AdamW's eps as in tests/test_train.py; one held-out clip for the eval loss at 2 sigmas, at steps 2 and 3
STEPS = ["--lr", "1e-2", "--adam-eps", "1e-4", "--eval-split", "1", "--eval-quantiles", "2", "--eval-every", "2",
         "--ckpt-every", "2"]


def _nodes(argv, tmp_path, nnodes=2, nproc=2):
    """torchrun on `nnodes` "nodes" of this machine, as docs/multinode.md's commands: a c10d rendezvous on
    loopback, each node with its own A2_CACHE (its own disk: the built-in tiny model is built on each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "a2-test",
           str(ROOT / "train_a2.py"), *argv]
    return [subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", "A2_CACHE": str(tmp_path / f"node{n}")},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in range(nnodes)]


def _finish(p):
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-4000:]
    return log


def _metric(run_dir, key):
    return {r["step"]: r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if key in r}


def test_training_with_context_parallel_equals_one_process(data_dir, tmp_path):
    """Global batch 2 in one process (accumulation 2) against 4 torchrun ranks = 2 data-parallel x CP 2, under DDP
    on two torchrun "nodes" of 2 ranks (c10d rendezvous on loopback, a CP group per node) and under FSDP2 (one
    node, sharded over the 4 ranks): the same losses, gradient norms, weights and eval loss, each checkpoint
    written once (no temp dir left). The two-node run's step-2 checkpoint resumes on one node at CP 4 (4 ranks, one
    data-parallel rank, accumulation 2): its step 3 equals the one-process run's. The validation video sampled at
    CP 2 is the one-process video. Full fine-tuning (FSDP2's); LoRA
    takes the same path (its weights are the only change)."""
    full = [*STEPS, "--training-type", "full"]
    cp2 = ["--max-steps", "2", "--context-parallel", "2"]
    val = ["--val-elements", *(str(data_dir / f"000_{e}.png") for e in ("person", "object", "background")),
           "--val-steps", "2", "--val-every", "2", "--no-val-metrics"]
    runs = dict(one=launch(args(data_dir, tmp_path, "one", *full, *val, "--max-steps", "3", "--grad-accum", "2")),
                fsdp=launch(args(data_dir, tmp_path, "fsdp", *full, *cp2, "--fsdp"), nproc=4))
    nodes = _nodes(args(data_dir, tmp_path, "ddp", *full, *cp2, *val), tmp_path)
    logs = {k: _finish(p) for k, p in runs.items()}
    logs["ddp"] = "".join(_finish(p) for p in nodes)
    assert "global batch 2 = micro 1 x accum 1 x world 2 (x context parallel 2)" in logs["ddp"]
    assert all((tmp_path / f"node{n}" / f"built-{TINY_BUILD}" / "tiny" / "transformer").is_dir()
               for n in range(2))  # built per node
    assert not list((tmp_path / "ddp").glob(".tmp-*")) and sorted(p.name for p in (tmp_path / "ddp").glob("ckpt-*")) \
        == ["ckpt-0000002"]
    one = tmp_path / "one"
    video = "samples/step-0000002.mp4"  # the validation video, sampled by the CP group of rank 0: the same bytes
    assert (tmp_path / "ddp" / video).read_bytes() == (one / video).read_bytes()
    assert max_diff(params(one / "ckpt-0000002"), params(one / "ckpt-0000003")) > 1e-5  # the weights move
    step2 = load_file(one / "ckpt-0000002" / "trainable.safetensors")
    assert max_diff(params(tmp_path / "ddp" / "ckpt-0000002"), step2) <= 1e-6
    assert max_diff(load_file(tmp_path / "fsdp" / "transformer" / "diffusion_pytorch_model.safetensors"), step2) \
        <= 1e-6
    for run in ("ddp", "fsdp"):
        for key, tol in (("loss", 1e-6), ("grad_norm", 1e-5), ("eval/loss", 1e-6)):
            got, want = _metric(tmp_path / run, key), _metric(one, key)
            assert sorted(got) == ([2] if key == "eval/loss" else [1, 2]), (run, key, got)
            assert all(abs(got[s] - want[s]) <= tol for s in got), (run, key, got, want)

    cut = tmp_path / "cp4"
    cut.mkdir()
    shutil.copytree(tmp_path / "ddp" / "ckpt-0000002", cut / "ckpt-0000002")
    log = _finish(launch(args(data_dir, tmp_path, "cp4", *full, "--max-steps", "3", "--grad-accum", "2",
                              "--context-parallel", "4", "--resume", "auto"), nproc=4))
    assert f"resumed from {cut / 'ckpt-0000002'} at step 2" in log and "global batch 2 -> " not in log
    assert max_diff(params(cut / "ckpt-0000003"), params(one / "ckpt-0000003")) <= 1e-6
    for key in ("loss", "eval/loss"):
        got, want = _metric(cut, key), _metric(one, key)
        assert sorted(got) == [3] and abs(got[3] - want[3]) <= 1e-6, (key, got, want)


def test_infer_under_torchrun_samples_the_one_process_video(data_dir, tmp_path):
    """infer.py under torchrun (2 ranks, gloo) samples one video with its tokens split over the ranks: the latents
    and the mp4 rank 0 writes equal one process's."""
    common = ["--model", "tiny", "--height", "32", "--width", "48", "--num-frames", "17", "--steps", "2", "--device",
              "cpu", "--prompt", "a person", "--seed", "1", "--elements",
              *(str(data_dir / f"000_{e}.png") for e in ("person", "object", "background"))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    runs = [subprocess.Popen([*pre, str(ROOT / "infer.py"), *common, "--out", str(tmp_path / f"{n}.mp4"),
                              "--save-latents", str(tmp_path / f"{n}.pt")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for n, pre in (("one", [sys.executable]),
                           ("split", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc-per-node", "2"]))]
    for p in runs:
        _finish(p)
    one, split = (torch.load(tmp_path / f"{n}.pt")["latents"] for n in ("one", "split"))
    assert (split - one).abs().max() <= 1e-5 * one.abs().max()
    assert (tmp_path / "split.mp4").read_bytes() == (tmp_path / "one.mp4").read_bytes()
