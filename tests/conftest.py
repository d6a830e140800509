import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu run only where CUDA is present; elsewhere they are reported as skipped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/test_gpu.py; scripts/gpu_check.sh runs them)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real media not present at {SHARED_DATA}")
    return SHARED_DATA
