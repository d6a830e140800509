"""--frame-extraction head | chunk | slide | uniform with --frame-stride / --frame-sample and --source-fps /
--target-fps, on the real hiker clip (49 frames at 8 fps, stored rotated): the windows musubi-tuner's rules give, each
a sample holding exactly those frames; validated as training reads them; cached per window."""

import math
import shutil
from dataclasses import replace

import av
import numpy as np
import pytest
import torch

from a2.config.dataset_config import DatasetConfig
from a2.data.media import _decode, displayed
from a2.images import resize_frames
from a2.plan import cache_key
from data import DatasetError, E2VDataset
from tests.conftest import args, losses, train

F = 17  # clip frames of the windows


@pytest.fixture(scope="module")
def hiker(media, tmp_path_factory):
    """A t2v dataset of one clip: tests/media/hiker_tiny.mp4 (49 frames, 8 fps)."""
    d = tmp_path_factory.mktemp("hiker")
    shutil.copy(media / "hiker_tiny.mp4", d / "hiker.mp4")
    (d / "hiker.txt").write_text("A hiker walks along a mountain trail.")
    with av.open(str(d / "hiker.mp4")) as c:
        assert c.streams.video[0].frames == 49 and c.streams.video[0].average_rate == 8
    return d


def cfg(d, **kw):
    return DatasetConfig(str(d), dataset_type="t2v", elements=(), target_resolution=(32, 48), **kw)


def windows_of(d, frames=F, **kw):
    ds = E2VDataset([cfg(d, **kw)], num_frames=frames, verbose=False)
    return ds, {s.id: list(s.windows[0]) for s in ds.samples}


def run(start, n, step=1):
    return list(range(start, start + n * step, step))


@pytest.mark.parametrize("kw, want", [
    (dict(frame_extraction="head"), {"hiker": run(0, F)}),
    (dict(frame_extraction="chunk"), {"hiker@0": run(0, F), "hiker@17": run(17, F)}),  # 34..50 does not fit
    (dict(frame_extraction="slide", frame_stride=8), {f"hiker@{s}": run(s, F) for s in (0, 8, 16, 24, 32)}),
    (dict(frame_extraction="uniform", frame_sample=3), {f"hiker@{s}": run(s, F) for s in (0, 16, 32)}),
    (dict(frame_extraction="uniform", frame_sample=4), {f"hiker@{s}": run(s, F) for s in (0, 10, 21, 32)}),
    (dict(frame_extraction="uniform"), {"hiker": run(0, F)}),  # frame_sample 1: head, as musubi-tuner
])
def test_windows_as_specified(hiker, kw, want):
    assert windows_of(hiker, **kw)[1] == want


def test_fps_resampling_drops_frames_as_musubi(hiker):
    """8 -> 4 fps keeps every other frame (25 of 49): chunks of 9 are 0,2..16 and 18..34. 12 -> 8 fps (source frame i
    on output frame floor(2i/3), the first of each kept): output frame n is source frame ceil(3n/2)."""
    _, got = windows_of(hiker, 9, frame_extraction="chunk", source_fps=8, target_fps=4)
    assert got == {"hiker@0": run(0, 9, 2), "hiker@18": run(18, 9, 2)}
    _, got = windows_of(hiker, F, frame_extraction="head", source_fps=12, target_fps=8)
    assert got == {"hiker": [math.ceil(3 * n / 2) for n in range(F)]}
    _, got = windows_of(hiker, F, frame_extraction="head", source_fps=8, target_fps=16)  # never upsampled
    assert got == {"hiker": run(0, F)}
    with pytest.raises(DatasetError, match=r"hiker: .*hiker.mp4: 49 frames \(13 at 2 fps\), shorter than the "
                                           r"smallest bucket \(17\)"):
        windows_of(hiker, F, frame_extraction="head", source_fps=8, target_fps=2)


def test_each_window_is_a_sample_holding_exactly_its_frames(hiker):
    """Every frame of the clip decoded once, in order (as displayed: the clip is stored rotated); each window sample's
    video is those frames, framed as training frames a clip."""
    every = np.stack([displayed(f) for _, f in _decode(hiker / "hiker.mp4")])
    assert len(every) == 49
    ds, got = windows_of(hiker, 9, frame_extraction="slide", frame_stride=10, source_fps=8, target_fps=4)
    assert list(got) == ["hiker@0", "hiker@20"]  # output starts 0 and 10 (source 0 and 20); 20+9 > 25
    for i, s in enumerate(ds.samples):
        item = ds[(i, 123)]  # the window, not the sampler's seed, picks the frames
        assert item["bucket"][0] == 9
        want = resize_frames(every[list(s.windows[0])], "center_crop", (32, 48))
        assert torch.equal(item["video"], want), s.id
    assert not torch.equal(ds[(0, 0)]["video"], ds[(1, 0)]["video"])


def test_windows_are_deterministic_and_in_the_cache_key(hiker, tmp_path):
    a, _ = windows_of(hiker, frame_extraction="slide", frame_stride=8)
    b, _ = windows_of(hiker, frame_extraction="slide", frame_stride=8)
    assert [s.windows for s in a.samples] == [s.windows for s in b.samples]
    for sub in ("vae", "text_encoder", "tokenizer"):
        (tmp_path / sub).mkdir()
    key = cache_key(tmp_path, None, a, F, "f32", "vae", 1)
    assert cache_key(tmp_path, None, b, F, "f32", "vae", 1) == key
    b.samples[1] = replace(b.samples[1], windows=(tuple(range(9, 9 + F)),))  # the same clip, settings, a new window
    assert cache_key(tmp_path, None, b, F, "f32", "vae", 1) != key


def test_validation_reads_the_last_window(tmp_path):
    """A clip whose container lists 40 frames but whose data stops half-way: the head window decodes, the slide
    windows reach frames that do not, and validation says so before training."""
    d = tmp_path / "d"
    d.mkdir()
    noise = np.random.default_rng(0).integers(0, 256, (40, 32, 48, 3), dtype=np.uint8)
    with av.open(str(d / "clip.mp4"), "w", options={"movflags": "faststart"}) as c:  # the index in front
        st = c.add_stream("libx264", rate=8)
        st.height, st.width, st.pix_fmt = 32, 48, "yuv420p"
        for f in noise:
            c.mux(st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(st.encode())
    raw = (d / "clip.mp4").read_bytes()
    (d / "clip.mp4").write_bytes(raw[:len(raw) // 2])
    (d / "clip.txt").write_text("noise")
    assert windows_of(d, 9, frame_extraction="head")[1] == {"clip": run(0, 9)}
    with pytest.raises(DatasetError, match=r"clip: .*clip.mp4: only frames 0\.\.\d+ of the 40 it lists decode .* "
                                           r"training reads up to frame 39"):
        windows_of(d, 9, frame_extraction="slide", frame_stride=1)


def test_bad_extraction_settings_fail_with_the_flag(tmp_path):
    from a2.cli import ConfigError

    with pytest.raises(ConfigError, match="--frame-extraction: source_fps resamples .* use head, chunk"):
        train(*args(tmp_path, tmp_path, "r", "--source-fps", "30"))
    with pytest.raises(ConfigError, match="frame_stride and frame_sample must be >= 1"):
        train(*args(tmp_path, tmp_path, "r", "--frame-extraction", "slide", "--frame-stride", "0"))


def test_windows_train_from_the_cache_as_from_pixels(hiker, tmp_path):
    """Each window is cached as a sample of its own; training from the cache equals training from the frames."""
    flags = ["--dataset-type", "t2v", "--num-frames", "9", "--frame-extraction", "chunk", "--source-fps", "8",
             "--target-fps", "4", "--max-steps", "2"]
    cache = tmp_path / "cache"
    raw = train(*args(hiker, tmp_path, "raw", *flags, model="tiny-t2v"))
    train(*args(hiker, tmp_path, "pre", *flags, "--cache-dir", str(cache), "--precompute", model="tiny-t2v"))
    (key,) = cache.iterdir()
    assert sorted(p.name for p in (key / "samples").iterdir()) == ["0.pt", "1.pt"]  # hiker@0, hiker@18
    cached = train(*args(hiker, tmp_path, "cached", *flags, "--cache-dir", str(cache), model="tiny-t2v"))
    assert losses(cached["run_dir"]) == losses(raw["run_dir"]) and len(losses(raw["run_dir"])) == 2
