"""train_a2.main and infer.main leave the process as they found it on every exit: a return, an input error, a
failure mid-run and a stop signal. What main may touch, compared before and after: the SIGTERM / SIGINT handlers,
train_a2's STOP flags and RANK, the default process group, the environment (every variable), the global random
generators (`random`'s, torch's and numpy's: train_a2.main reseeds the first two each step), torch's default dtype,
its thread count and grad mode, and the working directory. A notebook or a test calls main again in the same process:
whatever one run leaves is the next one's starting point."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch

from tests.conftest import args, drawn_person, train_config


def state() -> dict:
    import torch.distributed as dist

    import train_a2

    return dict(handlers={s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)},
                stop=dict(train_a2.STOP), rank=train_a2.RANK, group=dist.is_initialized(), environ=dict(os.environ),
                dtype=torch.get_default_dtype(), threads=torch.get_num_threads(), grad=torch.is_grad_enabled(),
                cwd=os.getcwd(), random=random.getstate(), torch_rng=torch.random.get_rng_state().tolist(),
                numpy_rng=np.random.get_state()[1].tolist())


def assert_as_found(before: dict) -> None:
    after = state()
    env = {k for k in before["environ"].keys() | after["environ"].keys()
           if before["environ"].get(k) != after["environ"].get(k)}
    assert not env, f"environment variables changed: {sorted(env)}"
    assert after == before


@pytest.mark.parametrize("exit_path", ["return", "input error", "failure", "stop"])
def test_train_main_leaves_nothing(exit_path, data_dir, tmp_path, monkeypatch):
    """One-rank --fsdp: main creates the process group itself; the stop is a SIGTERM during the first step (the
    loop's handler: checkpoint, exit resumable)."""
    import train_a2
    from a2.cli import InputError

    (tmp_path / "file").write_text("")
    # parsed before: tyro's cache draws from `random` (its eviction), outside main
    cfg = train_config(args(data_dir, tmp_path / "file" if exit_path == "input error" else tmp_path, "r", "--fsdp",
                            "--max-steps", "2"))
    random.seed(12345)  # a caller's own draws go on from where they were after main
    torch.manual_seed(12345)
    before = state()
    if exit_path == "return":
        assert train_a2.main(cfg)["step"] == 2
    elif exit_path == "input error":
        with pytest.raises(InputError, match="is a file, not a dir to write into"):  # refused once the group exists
            train_a2.main(cfg)
    else:
        real = train_a2.optimizer_step

        def step(*a, **k):
            if exit_path == "failure":
                raise RuntimeError("an error in the loop")
            os.kill(os.getpid(), signal.SIGTERM)  # handled by main's handler, between two bytecodes
            return real(*a, **k)

        with monkeypatch.context() as m:
            m.setattr(train_a2, "optimizer_step", step)
            if exit_path == "failure":
                with pytest.raises(RuntimeError, match="an error in the loop"):
                    train_a2.main(cfg)
            else:
                r = train_a2.main(cfg)
                assert r["interrupted"] and r["step"] == 1
    assert_as_found(before)


@pytest.mark.parametrize("exit_path", ["return", "input error", "failure", "stop"])
def test_infer_main_leaves_nothing(exit_path, tmp_path, monkeypatch):
    """infer.main with the handlers infer.py's __main__ installs (exit_on_signal) in place: a stop is their
    SystemExit raised mid-run."""
    import a2.pipeline as pipeline
    import infer
    from a2.cli import InputError, exit_on_signal, parse_cli
    from config import InferConfig

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    exit_on_signal("the videos written so far are kept")
    try:
        drawn_person((40, 28)).save(tmp_path / "me.png")
        argv = ["--model", "tiny", "--resolution", "32", "48", "--num-frames", "9", "--steps", "2", "--device", "cpu",
                "--elements", str(tmp_path / "me.png"), "--out", str(tmp_path / "v.mp4")]
        real = pipeline.decode_vae

        def decode(*a, **k):
            if exit_path == "failure":
                raise RuntimeError("an error in the decode")
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)

        monkeypatch.setattr(pipeline, "decode_vae", decode if exit_path in ("failure", "stop") else real)
        if exit_path == "input error":
            argv += ["--lora", str(tmp_path / "missing.safetensors")]
        cfg = parse_cli(InferConfig, args=argv)  # (tyro's cache draws from `random`: parsed before)
        before = state()
        if exit_path == "return":
            assert infer.main(cfg) == 0
        else:
            error = dict(failure=RuntimeError, stop=SystemExit)[exit_path] if exit_path != "input error" else InputError
            with pytest.raises(error):
                infer.main(cfg)
        assert_as_found(before)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _infer_rank(rank: int, port: int, argv: list[str], out: str) -> None:
    """One of two ranks as torchrun starts them (its environment variables): infer.main samples one video split over
    both, in the process group it starts, and leaves the process as it found it."""
    import infer
    from a2.cli import parse_cli
    from config import InferConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = parse_cli(InferConfig, args=argv + ["--out", f"{out}/v{rank}.mp4"])
    before = state()
    assert infer.main(cfg) == 0
    assert_as_found(before)
    open(f"{out}/done{rank}", "w").close()


def test_infer_main_under_torchrun_closes_its_process_group(tmp_path):
    """infer.py under torchrun (WORLD_SIZE 2) starts a gloo group to split the video's tokens (a2/model/parallel.py
    sampling_group); main destroys it as it returns on each rank, and leaves the rest as found."""
    import socket

    import torch.multiprocessing as mp

    drawn_person((40, 28)).save(tmp_path / "me.png")
    argv = ["--model", "tiny", "--resolution", "32", "48", "--num-frames", "9", "--steps", "2", "--device", "cpu",
            "--elements", str(tmp_path / "me.png")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_infer_rank, args=(port, argv, str(tmp_path)), nprocs=2)
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists() and (tmp_path / "v0.mp4").exists()
