"""infer.py end to end on the tiny model: mp4 written with the right frames/size, parity checks, bad input."""

import subprocess
import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def element_images(tmp_path_factory):
    d = tmp_path_factory.mktemp("elements")
    rng = np.random.default_rng(0)
    paths = []
    for name, size in (("subject", (40, 30)), ("object", (50, 50)), ("background", (64, 96))):
        p = d / f"{name}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    return paths


def infer_main(tiny_dir, **kw):
    """infer.main in-process (the CLI itself is exercised once by the first test)."""
    import infer

    base = dict(model=str(tiny_dir), height=32, width=48, num_frames=17, steps=2, device="cpu")
    return infer.main(infer.InferConfig.from_flags(**{**base, **kw}))


def run_infer(tiny_dir, tmp_path, *args):
    cmd = [sys.executable, str(ROOT / "infer.py"), "--model", str(tiny_dir), "--height", "32", "--width", "48",
           "--num-frames", "17", "--steps", "2", "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)


def test_infer_writes_video_and_parity(tiny_dir, tmp_path, element_images, capsys):
    out = tmp_path / "a.mp4"
    r = run_infer(tiny_dir, tmp_path, "--elements", *element_images, "--out", str(out), "--save-latents",
                  str(tmp_path / "a.pt"), "--seed", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    frames = iio.imread(out, plugin="pyav")
    # 17 frames, 3 reference latents (repeats 1/4/4) dropped: 4*(5-1)+1 - 12 = 5 frames; refs side by side
    assert frames.shape == (5, 32, 48 * 4, 3)
    els = tuple(element_images)
    assert infer_main(tiny_dir, elements=els, out=str(tmp_path / "b.mp4"), compare=str(tmp_path / "a.pt"),
                      seed=1, tolerance=0.0) == 0
    printed = capsys.readouterr().out
    assert "parity: PASS" in printed and "max|Δ|=0.000e+00" in printed
    assert infer_main(tiny_dir, elements=els, out=str(tmp_path / "c.mp4"), compare=str(tmp_path / "a.pt"),
                      seed=2) == 1
    assert "parity: FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("kw,message", [
    (dict(elements=("missing.png",)), "missing.png: element 'subject' image not found"),
    (dict(height=30), "multiples of 16"),
    (dict(num_frames=16), r"4k\+1"),
    (dict(num_frames=9, elements="ALL"), "leaves no frame to generate"),
    (dict(elements=("nosuch=x.png",)), "unknown element name 'nosuch'"),
])
def test_infer_bad_input(tiny_dir, element_images, kw, message):
    if kw.get("elements") == "ALL":
        kw["elements"] = tuple(element_images)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        infer_main(tiny_dir, **kw)


def test_infer_unreadable_image(tiny_dir, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(ValueError, match="broken.png: element 'subject' is not a readable image"):
        infer_main(tiny_dir, elements=(str(bad),))


def test_flow_shift_defaults_to_the_model_dirs(tiny_t2v_dir, tmp_path):
    """A T2V model ships its own sampler shift (Wan2.1 T2V: 3): with no --flow-shift infer.py samples with it."""
    import json
    import shutil

    model = tmp_path / "t2v_shift3"
    shutil.copytree(tiny_t2v_dir, model)
    cfg_path = model / "scheduler" / "scheduler_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "flow_shift": 3.0}))
    runs = {}
    for name, shift in (("default", None), ("three", 3.0), ("eight", 8.0)):
        out = tmp_path / f"{name}.pt"
        assert infer_main(model, flow_shift=shift, decode="none", save_latents=str(out)) == 0
        runs[name] = torch.load(out)["latents"]
    assert torch.equal(runs["default"], runs["three"])
    assert (runs["default"] - runs["eight"]).abs().max() > 1e-3


def test_size_defaults_of_built_in_tiny_models_and_model_help(capsys):
    """A built-in tiny model samples at the README demo's size unless told (a real model's 480x832, 81 frames, 50
    steps take ~30 min on a CPU) and says so; real models and the random real-size ones keep the real defaults.
    --help lists every built-in model name."""
    import tyro

    import infer
    from config import TrainConfig

    def parsed(*argv):  # the config as infer.main resolves it, and where each default came from
        return infer.resolve(tyro.cli(infer.InferConfig, args=list(argv)))

    tiny, source = parsed("--model", "tiny-t2v")
    assert (tiny.height, tiny.width, tiny.num_frames, tiny.sampling.steps) == (64, 64, 33, 10)
    assert infer.size_banner(tiny, tiny.sampling.steps, source).startswith(
        "--model tiny-t2v: a built-in model, sampled at 64x64 (tiny model's default), 33 frames (tiny model's "
        "default), 10 steps (tiny model's default);")
    given, source = parsed("--resolution", "32", "48", "--num-frames", "17", "--steps", "2")
    assert (given.height, given.width, given.num_frames, given.sampling.steps, source) == (32, 48, 17, 2, {})
    for model in ("random-1.3B", "/models/SkyReels-A2"):
        real, source = parsed("--model", model)
        # the steps: the model's own sampler's, filled by A2Pipeline
        assert (real.height, real.width, real.num_frames, real.sampling.steps) == (480, 832, 81, None)
        assert source == dict(size="default", frames="default")
    for cls in (infer.InferConfig, TrainConfig):
        with pytest.raises(SystemExit):
            tyro.cli(cls, args=["--help"])
        said = " ".join(capsys.readouterr().out.split())
        assert all(name in said for name in ("tiny-wan22-i2v", "tiny-ti2v", "random-1.3B", "random-14B", "random-5B"))
