"""a2/train/runs.py: the run-dir lock, checkpoint manifests and what counts as complete, choosing the checkpoint to
resume and checking it against the run before any model loads, config/metrics bookkeeping on resume, skipped non-finite
steps; data.py: loader workers that survive a SIGTERM/SIGINT to the process group."""

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import Metadata

from a2.train.runs import (
    MANIFEST,
    Diverged,
    NonFiniteSteps,
    ResumeError,
    RunLock,
    RunLocked,
    check_compatible,
    checkpoint_problem,
    commit_checkpoint,
    find_resumable,
    params_finite,
    plan_resume,
    record_start,
    truncate_metrics,
)
from config import flat_config, from_flags
from tests.conftest import ROOT


def config(**kw) -> dict:
    """A TrainConfig as a dict, as it reads back from JSON."""
    return json.loads(json.dumps(flat_config(from_flags(**kw), nested=True)))


def make_ckpt(run_dir, step, cfg=None, world=1, sharded=False, keep_last=100):
    """A checkpoint as train_a2.py writes it (small tensors), committed with its manifest."""
    tmp = run_dir / f".tmp-ckpt-{step:07d}"
    tmp.mkdir(parents=True)
    if sharded:
        (tmp / "sharded").mkdir()
        (tmp / "sharded" / "__0_0.distcp").write_bytes(os.urandom(1000))
        (tmp / "sharded" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    else:
        save_file({"w": torch.randn(8, 4)}, tmp / "trainable.safetensors")
        torch.save({"state": {}, "param_groups": []}, tmp / "optimizer.pt")
    torch.save(dict(step=step, data_position=step, rng={}), tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(cfg or config()))
    return commit_checkpoint(tmp, run_dir / f"ckpt-{step:07d}", keep_last, step=step, world_size=world)


# ---------------------------------------------------------------- lock


def test_lock_refuses_a_second_run_names_the_holder_and_is_free_once_it_dies(tmp_path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from a2.train.runs import RunLock; "
            "RunLock(sys.argv[2]).acquire(); print('locked', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(RunLocked, match=rf"in use by another run \(pid {p.pid} on .*, running since "):
            RunLock(tmp_path).acquire()
    finally:
        p.kill()
        p.wait()
    RunLock(tmp_path).acquire().release()  # kill -9 released it: no stale lock


def test_lock_held_by_this_process_from_an_earlier_run_is_taken_over(tmp_path):
    first = RunLock(tmp_path).acquire()  # e.g. train_a2.main called in process, ended by an exception
    second = RunLock(tmp_path).acquire()
    assert first.fd is None and second.fd is not None
    second.release()


# ---------------------------------------------------------------- manifest, completeness


def test_manifest_detects_incomplete_truncated_corrupt_and_missing(tmp_path):
    ckpt = make_ckpt(tmp_path, 10)
    assert checkpoint_problem(ckpt) is None
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert set(manifest["files"]) == {"trainable.safetensors", "optimizer.pt", "state.pt", "config.json"}
    assert manifest["step"] == 10 and all("crc32" in f for f in manifest["files"].values())

    f = ckpt / "trainable.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-7])
    assert "truncated" in checkpoint_problem(ckpt)
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    assert "crc32" in checkpoint_problem(ckpt)
    f.write_bytes(data)
    assert checkpoint_problem(ckpt) is None
    (ckpt / "optimizer.pt").unlink()
    assert checkpoint_problem(ckpt) == "optimizer.pt missing"
    (ckpt / MANIFEST).unlink()
    assert checkpoint_problem(ckpt).startswith("incomplete: no manifest.json")


def test_commit_keeps_the_last_complete_checkpoints(tmp_path):
    for step in (1, 2, 3):
        make_ckpt(tmp_path, step)
    (tmp_path / "ckpt-0000001" / MANIFEST).unlink()  # 1 incomplete
    make_ckpt(tmp_path, 4, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000003", "ckpt-0000004"]
    assert not list(tmp_path.glob(".tmp-*"))
    make_ckpt(tmp_path, 5, keep_last=2)
    (tmp_path / "ckpt-0000005" / MANIFEST).unlink()  # the newest is incomplete: two complete ones are kept
    make_ckpt(tmp_path, 6, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000004", "ckpt-0000005", "ckpt-0000006"]


def test_find_resumable_falls_back_and_says_why(tmp_path):
    assert find_resumable(tmp_path) == (None, [])
    for step in (2, 4, 6):
        make_ckpt(tmp_path, step)
    (tmp_path / "ckpt-0000006" / "trainable.safetensors").write_bytes(b"")  # cut by a full disk
    (tmp_path / "ckpt-0000008").mkdir()  # a dir that was never completed
    ckpt, skipped = find_resumable(tmp_path)
    assert ckpt == tmp_path / "ckpt-0000004"
    assert [(p.name, r.split(" ")[0]) for p, r in skipped] == [("ckpt-0000008", "incomplete:"),
                                                              ("ckpt-0000006", "trainable.safetensors")]


# ---------------------------------------------------------------- resume planning, compatibility


def test_plan_resume(tmp_path):
    run = tmp_path / "run"
    cur = config(lora_rank=8, run_name="run", resume="auto")
    point = plan_resume("auto", run, cur, 1)
    assert point.path is None and point.step == 0 and "does not exist" in point.notes[0]
    with pytest.raises(ResumeError, match="--resume auto continues the run named by --run-name"):
        plan_resume("auto", run, cur, 1, named=False)
    run.mkdir()
    assert plan_resume(None, run, cur, 1).path is None  # an empty (or failed, checkpoint-less) run dir: fresh start
    make_ckpt(run, 3, config(lora_rank=8))
    make_ckpt(run, 5, config(lora_rank=8))
    (run / "ckpt-0000005" / "state.pt").write_bytes(b"garbage")
    point = plan_resume("auto", run, cur, 1)
    assert (point.path, point.step) == (run / "ckpt-0000003", 3)
    assert point.skipped[0][0].name == "ckpt-0000005" and "state.pt" in point.skipped[0][1]
    with pytest.raises(ResumeError, match="already holds checkpoints .* give --resume auto"):
        plan_resume(None, run, cur, 1)
    with pytest.raises(ResumeError, match="ckpt-0000005: state.pt has"):
        plan_resume(str(run / "ckpt-0000005"), run, cur, 1)
    make_ckpt(run, 7, config(lora_rank=8))
    with pytest.raises(ResumeError, match="holds newer checkpoints .*ckpt-0000007.* new --run-name"):
        plan_resume(str(run / "ckpt-0000003"), run, cur, 1)
    # another run dir may start from it (a fork)
    assert plan_resume(str(run / "ckpt-0000003"), tmp_path / "fork", cur, 1).step == 3


@pytest.mark.parametrize("change, error", [
    (dict(lora_rank=16), "trained with --lora-rank 8, this run has 16"),
    (dict(lora_alpha=4.0), "--lora-alpha 320.0, this run has 4.0"),  # the tiny recipe's
    (dict(lora_target="x"), "--lora-target"),
    (dict(model="/models/other"), "trained with --model tiny, this run has /models/other"),
    (dict(training_type="full"), "--training-type lora, this run has full"),
    (dict(expert="high"), "--expert None"),
])
def test_incompatible_checkpoints_fail_in_one_line(tmp_path, change, error):
    ckpt = make_ckpt(tmp_path, 2, config(lora_rank=8))
    with pytest.raises(ResumeError, match=error) as e:
        check_compatible(ckpt, config(**{"lora_rank": 8, **change}), 1)
    assert "\n" not in str(e.value)


def test_world_size_and_fsdp_rules(tmp_path):
    full = dict(training_type="full")
    ddp = make_ckpt(tmp_path / "ddp", 2, config(**full), world=2)
    fsdp = make_ckpt(tmp_path / "fsdp", 2, config(**full, fsdp=True), world=2, sharded=True)
    assert checkpoint_problem(fsdp) is None
    notes = check_compatible(ddp, config(**full, micro_batch=2), 1)  # 1 x 2 == 2 x 1: the same global batch
    assert notes == ["changed since the checkpoint: micro_batch 1 -> 2"]
    assert check_compatible(fsdp, config(**full, fsdp=True), 4)[0].startswith("global batch 2 -> 4")
    with pytest.raises(ResumeError, match="a sharded --fsdp checkpoint; resume it with --fsdp"):
        check_compatible(fsdp, config(**full), 2)
    with pytest.raises(ResumeError, match=r"a DDP \(not --fsdp\) checkpoint; resume it without --fsdp"):
        check_compatible(ddp, config(**full, fsdp=True), 2)
    # the same model dir spelled differently is the same model
    (tmp_path / "m").mkdir()
    ckpt = make_ckpt(tmp_path / "r", 1, config(model=str(tmp_path / "m")))
    (tmp_path / "x").mkdir()
    check_compatible(ckpt, config(model=str(tmp_path / "x" / ".." / "m")), 1)  # no error


# ---------------------------------------------------------------- config history, metrics


def test_record_start_keeps_config_history_and_truncates_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = config(lora_rank=8, max_steps=10)
    record_start(run, first, plan_resume(None, run, first, 1), 1)
    assert json.loads((run / "config.json").read_text()) == {**first, "resumes": []}
    rows = [json.dumps(dict(step=s, loss=1.0 / s)) for s in range(1, 8)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 8, "lo')  # cut by a kill
    make_ckpt(run, 5, first)
    (run / ".tmp-ckpt-0000006").mkdir()  # left by a kill during a checkpoint write
    again = config(lora_rank=8, max_steps=20, resume="auto")
    record_start(run, again, plan_resume("auto", run, again, 2), 2)
    cfg = json.loads((run / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "resumes"} == first  # the run's config, written once
    assert len(cfg["resumes"]) == 1
    r = cfg["resumes"][0]
    assert (r["step"], r["world_size"], r["changed"]) == (5, 2, {"max_steps": [10, 20]})
    assert r["checkpoint"].endswith("ckpt-0000005")
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert not list(run.glob(".tmp-*"))
    assert truncate_metrics(run / "metrics.jsonl", 3) == 2 and truncate_metrics(run / "nope.jsonl", 3) == 0


# ---------------------------------------------------------------- non-finite steps


def test_non_finite_steps_are_skipped_on_the_device():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = NonFiniteSteps(opt, "cpu")
    x = torch.randn(8, 4)

    def step(poison=False):
        loss = model(x).pow(2).mean() * (float("nan") if poison else 1.0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        guard.before_step(loss.detach(), norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    before = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    step(poison=True)
    step(poison=True)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # weights untouched
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())  # as if they never happened
    assert guard.counts() == (2, 2) and params_finite(model.parameters())
    with pytest.raises(Diverged, match=r"steps 2-3: .* 2 times in a row .* finite weights: none$"):
        guard.check(3, 2, None)
    with pytest.raises(Diverged, match=r"finite weights: r/ckpt-0000001 \(the step right after it, 2, was already"):
        guard.check(3, 2, Path("r/ckpt-0000001"))
    assert guard.check(3, 3, None) == (2, 2)
    step()
    assert guard.counts() == (0, 2)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="fused=True"):
        NonFiniteSteps(torch.optim.AdamW(model.parameters()), "cpu")
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    assert not params_finite(model.parameters())


# ---------------------------------------------------------------- loader workers and stop signals


class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        time.sleep(0.01)
        return os.getpid()


def test_loader_workers_survive_stop_signals():
    from a2.data.loader import ignore_stop_signals, stop_signals_blocked

    def loader(init):
        return torch.utils.data.DataLoader(Pids(), batch_size=1, num_workers=1, worker_init_fn=init,
                                           multiprocessing_context="spawn", persistent_workers=True)

    with stop_signals_blocked():
        it = iter(loader(ignore_stop_signals))
    worker = int(next(it))
    for s in (signal.SIGTERM, signal.SIGINT):
        os.kill(worker, s)
    time.sleep(0.5)
    assert [int(next(it)) for _ in range(20)] == [worker] * 20  # still there, still serving
    del it
    # without it a worker dies of the signal and the loader fails mid-epoch (what a preempted run hit)
    it = iter(loader(None))
    worker = int(next(it))
    os.kill(worker, signal.SIGTERM)
    # (the loader's own error, or, when the worker dies while handing a batch over, the connection it breaks)
    with pytest.raises((RuntimeError, ConnectionResetError, EOFError)) as e:
        for _ in range(200):
            next(it)
    assert e.type is not RuntimeError or re.search("DataLoader worker .* (killed by signal|exited unexpectedly)",
                                                   str(e.value))


def test_signals_blocked_while_workers_start_are_delivered_after():
    from a2.data.loader import stop_signals_blocked

    got = []
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        with stop_signals_blocked():
            signal.raise_signal(signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


# ---------------------------------------------------------------- writing checkpoints


def test_save_checkpoint_checks_free_space_first_and_its_size_estimate_holds(tmp_path, monkeypatch):
    """The size a checkpoint takes is known before writing (checkpoint_bytes): the real files never exceed it, and a
    disk with less free space refuses in one line naming the run dir, the free space and the bytes needed, writing
    nothing and leaving the earlier checkpoints as they were."""
    import shutil

    import a2.train.runs
    from a2.train.runs import CheckpointError, checkpoint_bytes, checkpoint_problem, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    model[1].requires_grad_(False)  # frozen weights are not in the checkpoint
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    first = save_checkpoint(tmp_path, 1, model, opt, dict(model="m"), 3, dict(dropped={}, skipped_steps=0))
    written = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
    need = checkpoint_bytes(model, opt)
    tensors = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad) * 3 + 4 * 2  # weights, exp_avg,
    # exp_avg_sq (float32), and the fused AdamW's step of each of the 2 parameters
    assert need == tensors + a2.train.runs.checkpoint_margin(tensors)  # a tenth of the tensors' bytes + 256 KiB
    assert written <= need < 1.1 * written + 2**18  # what it writes fits, and a small checkpoint asks for about that
    before = {f: f.read_bytes() for f in first.rglob("*") if f.is_file()}
    usage = shutil.disk_usage
    monkeypatch.setattr(a2.train.runs.shutil, "disk_usage", lambda p: usage(p)._replace(free=need - 1))
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, 2, model, opt, dict(model="m"), 3, dict(dropped={}, skipped_steps=0))
    free, needed = f"{(need - 1) / 2**30:.2f} GiB ({need - 1} bytes)", f"{need / 2**30:.2f} GiB ({need} bytes)"
    assert str(e.value) == (f"{tmp_path}: not enough free space for the checkpoint of step 2: {free} free, it needs "
                            f"{needed}; nothing written, the earlier checkpoints are untouched; free space and run the "
                            "same command with --resume auto")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000001"]
    assert {f: f.read_bytes() for f in first.rglob("*") if f.is_file()} == before
    assert checkpoint_problem(first) is None
    # what a resume reads back: the weights, the optimizer, the step and the dropped samples; no RNG or data position
    state = load_checkpoint(first, model, opt)
    assert state == dict(step=1, load_failures=dict(dropped={}, skipped_steps=0))


# ---------------------------------------------------------------- resuming runs no code from the run dir


class _RunsCode:
    """Unpickling this calls `pathlib.Path.touch(marker)`: a stand-in for any code a pickle may run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def _adam_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_resuming_a_checkpoint_whose_pickles_hold_code_refuses_it_and_runs_nothing(tmp_path):
    """A run dir from someone else cannot run code on resume: state.pt holding a callable is refused (and the
    checkpoint reported unreadable, so --resume auto passes it over), and so are an --fsdp checkpoint's .metadata and
    non-tensor entries; an honest sharded checkpoint still restores the weights and optimizer exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from a2.train.runs import load_checkpoint

    marker = tmp_path / "code-ran"
    ckpt = make_ckpt(tmp_path / "run", 3)
    torch.save(dict(step=3, load_failures=_RunsCode(marker)), ckpt / "state.pt")
    write_manifest_again = json.loads((ckpt / MANIFEST).read_text())
    write_manifest_again["files"]["state.pt"] = dict(size=(ckpt / "state.pt").stat().st_size)
    (ckpt / MANIFEST).write_text(json.dumps(write_manifest_again))
    assert "Unpickl" in checkpoint_problem(ckpt) and not marker.exists()
    model, opt = _adam_model()
    with pytest.raises(Exception, match="Unpickl"):
        load_checkpoint(ckpt, model, opt)
    assert not marker.exists()
    assert find_resumable(tmp_path / "run")[0] is None

    # sharded (--fsdp): an honest one round-trips through the allow-listed readers
    model, opt = _adam_model()
    model_sd, optim_sd = get_state_dict(model, opt)
    sharded = tmp_path / "fsdp"
    (sharded / "sharded").mkdir(parents=True)
    torch.save(dict(step=3, load_failures=dict(dropped={}, skipped_steps=0)), sharded / "state.pt")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=sharded / "sharded")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    other, other_opt = torch.nn.Linear(4, 3), None
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    other(torch.randn(2, 4)).sum().backward()
    other_opt.step()
    assert load_checkpoint(sharded, other, other_opt, fsdp=True)["step"] == 3
    assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items())
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert not any("ema" in s for s in other_opt.state.values())  # none saved, none made

    # its .metadata replaced by a pickle holding code; then a non-tensor entry (the learning rate) holding code
    honest = (sharded / "sharded" / ".metadata").read_bytes()
    (sharded / "sharded" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(Exception, match="not allowed in a checkpoint's metadata"):
        load_checkpoint(sharded, other, other_opt, fsdp=True)
    (sharded / "sharded" / ".metadata").write_bytes(honest)
    optim_sd["param_groups"][0]["lr"] = _RunsCode(marker)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=sharded / "sharded")
    with pytest.raises(Exception, match="Unpickl|weights_only"):
        load_checkpoint(sharded, other, other_opt, fsdp=True)
    assert not marker.exists()
    torch.load(ckpt / "state.pt", weights_only=False)  # the test's own check that these pickles do run code
    assert marker.exists()
