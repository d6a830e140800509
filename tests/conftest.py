import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = ROOT.parent / "shared" / "data"  # the SkyReels-A2 photos (Skywork licence: not redistributed here)
MEDIA = ROOT / "tests" / "media"  # the Apache-2.0 real clips, in the repository (tests/media/README.md)
PHOTOS_MISSING = "needs the SkyReels-A2 photos"


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run only where CUDA is present; elsewhere they are reported as skipped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/test_gpu.py; scripts/gpu_check.sh runs them)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line at the end: how many tests skipped for want of the SkyReels-A2 photos, and where those come from."""
    n = sum(PHOTOS_MISSING in str(getattr(r, "longrepr", "")) for r in terminalreporter.stats.get("skipped", []))
    if n:
        terminalreporter.write_line(f"{n} tests skipped: they need the SkyReels-A2 photos (a2_human.png, a2_thing.png, "
                                    f"a2_env.png from the SkyReels-A2 repository's assets/, Skywork community "
                                    f"licence) at {SHARED_DATA}; see tests/media/README.md")


@pytest.fixture(scope="session", autouse=True)
def _a2_cache(tmp_path_factory):
    """`--model tiny` builds into A2_CACHE: keep it inside the test session."""
    os.environ["A2_CACHE"] = str(tmp_path_factory.mktemp("a2cache"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from a2.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_t2v_dir(tmp_path_factory):
    from a2.tiny import save_tiny

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
def shared_data():
    """../shared/data: the SkyReels-A2 photos (and, there too, the clips of tests/media)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{PHOTOS_MISSING} (Skywork community licence) at {SHARED_DATA}")
    return SHARED_DATA


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
