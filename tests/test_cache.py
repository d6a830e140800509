"""Precompute cache: training from the cache equals training from pixels, without the encoders."""

import pytest

from tests.conftest import args, losses, max_diff, params, train


def test_training_from_cache_equals_training_from_pixels(data_dir, tmp_path, monkeypatch):  # noqa: F811
    cache = tmp_path / "cache"
    steps = ["--max-steps", "3", "--text-dropout", "0.5", "--reference-dropout", "0.3"]  # every branch of a step
    raw = train(*args(data_dir, tmp_path, "raw", *steps))
    done = train(*args(data_dir, tmp_path, "pre", "--cache-dir", str(cache), "--precompute"))
    (key_dir,) = cache.iterdir()
    assert done["cache"] == key_dir and len(list((key_dir / "samples").glob("*.pt"))) == 4

    # from the cache nothing but the transformer may be constructed
    import diffusers
    import transformers

    def forbidden(*a, **k):
        raise AssertionError("an encoder was constructed while training from the cache")

    for cls in (diffusers.AutoencoderKLWan, transformers.UMT5EncoderModel, transformers.CLIPVisionModel):
        monkeypatch.setattr(cls, "from_pretrained", forbidden)
    cached = train(*args(data_dir, tmp_path, "cached", "--cache-dir", str(cache), *steps))
    assert losses(cached["run_dir"]) == losses(raw["run_dir"])
    assert max_diff(params(cached["run_dir"] / "ckpt-0000003"), params(raw["run_dir"] / "ckpt-0000003")) == 0.0


def test_cache_is_keyed_by_what_it_depends_on(data_dir, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    train(*args(data_dir, tmp_path, "pre", "--cache-dir", str(cache), "--precompute"))
    # another resolution is another cache: training asks for a precompute instead of reading stale latents
    other = args(data_dir, tmp_path, "other", "--cache-dir", str(cache), "--max-steps", "1")
    other[other.index("--resolution") + 1:other.index("--resolution") + 3] = ["48", "48"]
    with pytest.raises(FileNotFoundError, match="--precompute first"):
        train(*other)
    # a changed caption changes the key too
    caption = sorted(data_dir.glob("*.txt"))[0]
    old = caption.read_text()
    try:
        caption.write_text(old + " at dusk")
        with pytest.raises(FileNotFoundError, match="no precompute cache"):
            train(*args(data_dir, tmp_path, "other2", "--cache-dir", str(cache), "--max-steps", "1"))
    finally:
        caption.write_text(old)


def test_cache_key_covers_the_preprocessing(tmp_path):
    """The key hashes each element's VAE/CLIP preprocessing mode, the video framing and the layout kind (and its
    version, 2 since A2's pad/crop-then-resize, retires caches of the old code), so a cache built with other framing
    is never read."""
    from dataclasses import replace
    from types import SimpleNamespace

    from a2.config.dataset_config import DatasetConfig
    from a2.elements import A2_ELEMENTS
    from a2.plan import cache_key

    for d in ("vae", "text_encoder", "tokenizer"):
        (tmp_path / d).mkdir()

    def key(cfg):
        return cache_key(tmp_path, None, SimpleNamespace(cfgs=[cfg], samples=[], frame_sampling="x"), 9, "f32",
                         "dual", 1)

    base = DatasetConfig(str(tmp_path))
    other_vae = A2_ELEMENTS[:2] + (replace(A2_ELEMENTS[2], vae_preprocess="pad_white"),)
    other_clip = (replace(A2_ELEMENTS[0], clip_preprocess="letterbox"),) + A2_ELEMENTS[1:]
    keys = {key(base), key(replace(base, elements=other_vae)), key(replace(base, elements=other_clip)),
            key(replace(base, reshape_mode="pad_white"))}
    assert len(keys) == 4 and key(base) == key(DatasetConfig(str(tmp_path)))
    # the layout kind: Phantom-Wan's references (one frame each) on Wan2.1-T2V's encoders are not incontext's
    kinds = {cache_key(tmp_path, None, SimpleNamespace(cfgs=[base], samples=[], frame_sampling="x"), 9, "f32", "vae", 1,
                       kind) for kind in ("incontext", "phantom", "v3")}
    assert len(kinds) == 3
