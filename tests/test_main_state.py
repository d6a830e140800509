"""train_a2.main and infer.main leave the process as they found it on every exit: a return, an input error, a
failure mid-run and a stop signal. What main may touch, compared before and after: the SIGTERM / SIGINT handlers,
train_a2's STOP flags and RANK, the default process group, the environment (every variable), torch's default dtype,
its thread count and grad mode, and the working directory. A notebook or a test calls main again in the same process:
whatever one run leaves is the next one's starting point."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.conftest import args, drawn_person, train


def state() -> dict:
    import torch.distributed as dist

    import train_a2

    return dict(handlers={s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)},
                stop=dict(train_a2.STOP), rank=train_a2.RANK, group=dist.is_initialized(), environ=dict(os.environ),
                dtype=torch.get_default_dtype(), threads=torch.get_num_threads(), grad=torch.is_grad_enabled(),
                cwd=os.getcwd())


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

    before = state()
    run = args(data_dir, tmp_path, "r", "--fsdp", "--max-steps", "2")
    if exit_path == "return":
        assert train(*run)["step"] == 2
    elif exit_path == "input error":
        (tmp_path / "file").write_text("")
        with pytest.raises(InputError, match="is a file, not a dir to write into"):  # refused once the group exists
            train(*args(data_dir, tmp_path / "file", "r", "--fsdp"))
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
                    train(*run)
            else:
                r = train(*run)
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
        before = state()
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
        cfg = parse_cli(InferConfig, args=argv)
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
