import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MEDIA = ROOT / "tests" / "media"  # the Apache-2.0 real clips, in the repository (tests/media/README.md)
# the SkyReels-A2 example photos (Skywork licence: not redistributed here), beside the checkout where there is one
SHARED_DATA = ROOT.parent / "shared" / "data"
A2_PHOTOS = ("a2_human.png", "a2_thing.png", "a2_env.png")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run only where CUDA is present; elsewhere they are reported as skipped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/test_gpu.py; scripts/gpu_check.sh runs them)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def a2_photos() -> list[Path]:
    """The SkyReels-A2 photos found at SHARED_DATA, each file checked: the preprocessing tests (tests/test_pipeline.py)
    take them beside their drawn images where they are; every other test draws its persons (drawn_person)."""
    return [p for p in (SHARED_DATA / n for n in A2_PHOTOS) if p.is_file()]


def pytest_terminal_summary(terminalreporter):
    """One line at the end when some SkyReels-A2 photo is missing: the preprocessing tests ran without it."""
    missing = [n for n in A2_PHOTOS if not (SHARED_DATA / n).is_file()]
    if missing:
        terminalreporter.write_line(f"the preprocessing tests ran on drawn images without {', '.join(missing)} (the "
                                    f"SkyReels-A2 repository's assets/, Skywork community licence) at {SHARED_DATA}; "
                                    f"see tests/media/README.md")


def drawn_person(size: tuple[int, int], seed: int = 0, background: str = "scene") -> Image.Image:
    """A person drawn where a photo is not the point: a figure (head, torso, arms, legs; colours, place and pose from
    the seed), 80% of the picture's height, with a photo's fine texture (seeded noise) so that resamplers and codecs
    have detail to keep. On a scene (sky over ground), on white (a cut-out, as A2's element images are), or on
    transparency (RGBA: alpha 0 around the figure and random colours under it, which a reader ignoring the alpha
    would show). size is (h, w); any aspect."""
    h, w = size
    rng = np.random.default_rng(seed)
    if background == "scene":
        sky, ground = rng.integers(60, 200, (2, 3))
        y = np.linspace(0, 1, h)[:, None, None]
        rows = np.where(y < 0.6, sky + (255 - sky) * y / 1.2, ground * (1.3 - y / 2))  # (h, 1, 3)
        pixels = np.broadcast_to(rows, (h, w, 3)).astype(np.uint8)
    elif background == "white":
        pixels = np.full((h, w, 3), 255, np.uint8)
    elif background == "transparent":
        pixels = rng.integers(0, 256, (h, w, 3), np.uint8)
    else:
        raise ValueError(f"background {background!r}: scene, white or transparent")
    picture = Image.fromarray(pixels)
    figure = Image.new("L", (w, h), 0)
    s, cx = 0.8 * h, w * rng.uniform(0.4, 0.6)  # figure height, its centre line
    top = (h - s) / 2
    skin, shirt, trousers = (tuple(int(c) for c in rng.integers(30, 230, 3)) for _ in range(3))
    lift, arm, leg = rng.uniform(-0.15, 0.15) * s, round(0.06 * s) or 1, round(0.09 * s) or 1  # the arms' pose
    parts = [("ellipse", (cx - 0.09 * s, top, cx + 0.09 * s, top + 0.2 * s), skin, {}),  # head
             ("rounded_rectangle", (cx - 0.14 * s, top + 0.21 * s, cx + 0.14 * s, top + 0.58 * s), shirt,
              dict(radius=0.04 * s)),
             ("line", (cx - 0.12 * s, top + 0.25 * s, cx - 0.3 * s, top + 0.45 * s + lift), shirt, dict(width=arm)),
             ("line", (cx + 0.12 * s, top + 0.25 * s, cx + 0.3 * s, top + 0.45 * s - lift), shirt, dict(width=arm)),
             ("line", (cx - 0.07 * s, top + 0.55 * s, cx - 0.1 * s, top + s), trousers, dict(width=leg)),
             ("line", (cx + 0.07 * s, top + 0.55 * s, cx + 0.1 * s, top + s), trousers, dict(width=leg))]
    for target, paint in ((picture, None), (figure, 255)):
        draw = ImageDraw.Draw(target)
        for shape, box, colour, kw in parts:
            getattr(draw, shape)(box, fill=paint or colour, **kw)
    noise = rng.normal(0, 6, (h, w, 3))
    if background == "white":  # a cut-out: white stays white around the figure
        noise *= np.asarray(figure)[..., None] > 0
    picture = Image.fromarray((np.asarray(picture) + noise).round().clip(0, 255).astype(np.uint8))
    if background == "transparent":
        picture.putalpha(figure)
    return picture


@pytest.fixture(scope="session", autouse=True)
def _a2_cache(tmp_path_factory):
    """`--model tiny` builds into A2_CACHE: keep it inside the test session."""
    os.environ["A2_CACHE"] = str(tmp_path_factory.mktemp("a2cache"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from a2.model.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_t2v_dir(tmp_path_factory):
    from a2.model.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny_t2v") / "model", seed=0, t2v=True)


@pytest.fixture(scope="session")
def dino_dir(tmp_path_factory):
    """A tiny random DINOv3 ViT (patch 16, 4 registers, as the released ones) saved as a model dir."""
    import torch
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    torch.manual_seed(0)
    cfg = DINOv3ViTConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                          patch_size=16, num_register_tokens=4, image_size=32)
    out = tmp_path_factory.mktemp("dino") / "dinov3"
    DINOv3ViTModel(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def media():
    """tests/media: the real clips in the repository (Apache-2.0; tests/media/README.md)."""
    return MEDIA


# ---------------------------------------------------------------- helpers of the training tests


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


def train_config(argv):
    """A TrainConfig as train_a2.main takes it: the flags parsed, the model's recipe filled (its __post_init__)."""
    import tyro

    from config import TrainConfig

    return tyro.cli(TrainConfig, args=list(argv))


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


def assert_rounding(actual, expected, steps: int):
    """`actual` equals `expected` up to `steps` float32 roundings of the values' size (steps · eps32 · max|expected|).

    For the same math computed by other kernels: a batch of 2 against one sample, another memory alignment, another
    CPU's vector width. oneDNN and the BLAS pick their blocking, and so their summation order, by shape, alignment and
    CPU, so such results agree to rounding, not bit for bit. Each call names its steps by its depth: a VAE encode of
    the tiny VAE's ~10 convolutions (summing a few hundred products each) within 64; a whole tiny transformer forward
    within 256. A real mistake (a missed frame, a swapped element, a lost term) moves values by 1e-3 or more."""
    tol = steps * torch.finfo(torch.float32).eps * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol)


def locked_opencv() -> bool:
    """Whether the OpenCV installed is the one requirements.lock holds: the one whose float32 Farneback gives
    OpenS2V-Eval's published motion_fb to the last digit (scripts/held.txt)."""
    import re

    import cv2

    locked = re.search(r"^opencv-python-headless==(\d+\.\d+\.\d+)", (ROOT / "requirements.lock").read_text(), re.M)[1]
    return cv2.__version__ == locked


def assert_their_motion(ours: dict, theirs: dict):
    """OpenS2V-Eval's motion_fb per video ({video: {"motion_fb": v}}): their value to the last digit under the locked
    OpenCV; under another release within 4 float32 steps, as releases round Farneback's last steps differently
    (5.1.0.95: one step, 0.35025981 for their 0.35025984)."""
    import cv2

    assert ours and ours.keys() <= theirs.keys() and all(v.keys() == {"motion_fb"} for v in ours.values()), ours
    for k, v in ours.items():
        got, want = v["motion_fb"], theirs[k]["motion_fb"]
        exact = locked_opencv()
        assert got == want if exact else abs(got - want) <= 4 * np.spacing(np.float32(want)), \
            (k, got, want, f"OpenCV {cv2.__version__}{', the locked one' if exact else ''}")


def losses(run_dir):
    """Per-step loss from metrics.jsonl; a step logged twice (re-run after a kill) keeps its last value."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def wait_for(pred, proc, timeout=300):
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError("training ended before the interruption: " + proc.stdout.read()[-3000:])
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def children(pid):
    """Pids of the processes whose parent is `pid` (torchrun's ranks)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(stat.parent.name))
    return out
