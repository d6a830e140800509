"""--model / --image-encoder as a Hugging Face Hub id, resolved through a Hub cache built here (no network)."""

import pytest
import torch

from tests.conftest import args, train
from tests.test_infer import element_images, infer_main  # noqa: F401  (element_images: fixture)

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """The Hub cache's own layout: models--org--name/{refs/main, snapshots/<rev>/...}, holding the tiny A2 model."""
    from a2.model.tiny import save_tiny

    cache = tmp_path_factory.mktemp("hf_hub")
    repo = cache / "models--Skywork--SkyReels-A2"
    save_tiny(repo / "snapshots" / REV, seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache / "models--Skywork--SkyReels-A2" / "snapshots" / REV


def test_hub_id_resolves_to_the_cached_snapshot(offline, tiny_t2v_dir, tmp_path, monkeypatch):
    from a2.model.tiny import model_path
    from a2.model.transformer import detect_model

    assert model_path("Skywork/SkyReels-A2") == offline
    info = detect_model(model_path("Skywork/SkyReels-A2"))
    assert info.path == offline and info.image_encoder_dir == offline
    # --image-encoder takes an id too (the CLIP of a T2V base expanded to E2V)
    assert detect_model(tiny_t2v_dir, model_path("Skywork/SkyReels-A2")).image_encoder_dir == offline
    # a local dir of the same spelling wins over the Hub
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Skywork" / "SkyReels-A2").mkdir(parents=True)
    assert model_path("Skywork/SkyReels-A2").resolve() == tmp_path / "Skywork" / "SkyReels-A2"


def test_offline_and_absent_is_one_clear_line(offline):
    from a2.model.tiny import model_path
    from a2.model.transformer import UnsupportedModel

    with pytest.raises(UnsupportedModel) as e:
        model_path("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Wan-AI/Wan2.1-T2V-1.3B-Diffusers: ")
    assert "HF_HUB_OFFLINE" in msg and "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in msg


def test_train_and_infer_from_a_hub_id(offline, data_dir, tmp_path, element_images):  # noqa: F811
    out = train(*args(data_dir, tmp_path, "hub", "--max-steps", "2", model="Skywork/SkyReels-A2"))
    assert out["step"] == 2 and len(out["losses"]) == 2
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    els = tuple(element_images)
    assert infer_main("Skywork/SkyReels-A2", elements=els, out=str(tmp_path / "a.mp4"), save_latents=str(a)) == 0
    assert infer_main(str(offline), elements=els, out=str(tmp_path / "b.mp4"), save_latents=str(b)) == 0
    assert torch.equal(torch.load(a)["latents"], torch.load(b)["latents"])  # the id is that dir, nothing else
