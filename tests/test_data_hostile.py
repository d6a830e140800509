"""Hostile data: what real datasets hold (phone videos, Windows/macOS files, Excel manifests, cut-outs, damaged
downloads) is read as the file means it, or reported in one line naming the sample, the file and the problem, before
training; what still fails mid-run is dropped the same way on every rank. Every file is generated here."""

import codecs
import json
import os
import re
import shutil
import subprocess
import sys

import av
import numpy as np
import pytest
import torch
from PIL import Image

from a2.cli import ConfigError
from a2.config.dataset_config import DatasetConfig, load_dataset_config
from a2.data.loader import LoadFailures, collate
from a2.data.media import read_frames
from a2.elements import A2_ELEMENTS
from a2.images import read_image
from a2.kinds.conditioning import clip_frames
from data import DatasetError, E2VDataset, make_synthetic_dataset
from tests.conftest import ROOT, drawn_person
from tests.test_data import copy_of

RED, WHITE = [255, 0, 0], [255, 255, 255]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("synth") / "d", num_samples=4, num_frames=17,
                                  size=(32, 48))


def write_video(path, frames: np.ndarray, rotation: int | None = None, faststart: bool = False):
    """(F, H, W, 3) uint8 -> H.264 mp4, optionally with a display-matrix rotation (as phones write) and the index
    in front (moov before mdat, as web downloads have it)."""
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as c:
        s = c.add_stream("libx264", rate=8)
        s.height, s.width, s.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        if rotation is not None:
            s.set_display_rotation(rotation)
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode())


def marked_frames(n=17, h=32, w=64):
    """Grey frames with a red block in the top-left corner: where it lands shows how a frame was turned."""
    f = np.full((n, h, w, 3), 128, np.uint8)
    f[:, :8, :8] = RED
    return f


def problems_of(cfg, num_frames=17, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        E2VDataset([cfg], num_frames=num_frames, verbose=False, **kw)
    return str(e.value)


def cfg_of(d, **kw):
    return DatasetConfig(str(d), target_resolution=(32, 48), **kw)


# ---------------------------------------------------------------- 1. validation reads what training reads


def test_truncated_video_with_front_index_is_caught_before_training(synth, tmp_path):
    """The container lists every frame, but the data after frame ~k is gone: decoding frame 0 passes, the frames
    training asks for do not."""
    d = copy_of(synth, tmp_path)
    noise = np.random.default_rng(0).integers(0, 256, (40, 32, 48, 3), dtype=np.uint8)  # frames of similar size
    write_video(d / "001.mp4", noise, faststart=True)
    raw = (d / "001.mp4").read_bytes()
    (d / "001.mp4").write_bytes(raw[:len(raw) // 2])
    msg = problems_of(cfg_of(d))
    assert f"001: {d / '001.mp4'}: only frames 0.." in msg and "of the 40 it lists decode" in msg
    assert "training reads up to frame" in msg and msg.count("\n  ") == 1  # one line, only this sample
    ds = E2VDataset([cfg_of(d)], num_frames=17, skip_bad_samples=True, verbose=False)
    assert [s.id for s in ds.samples] == ["000", "002", "003"]
    # with "head" sampling training reads frames 0..16 only, which decode: nothing to report
    assert len(E2VDataset([cfg_of(d)], num_frames=17, frame_sampling="head", verbose=False)) == 4


def test_truncated_jpeg_named_png_is_caught(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    Image.open(d / "002_object.png").convert("RGB").resize((200, 200)).save(d / "tmp.jpg", quality=95)
    raw = (d / "tmp.jpg").read_bytes()
    (d / "tmp.jpg").unlink()
    (d / "002_object.png").write_bytes(raw[:len(raw) * 2 // 3])
    with Image.open(d / "002_object.png") as im:
        im.verify()  # the header alone looks fine: what validation used to check
    msg = problems_of(cfg_of(d))
    assert f"002: {d / '002_object.png'}: element 'object' is not a readable image" in msg and "truncated" in msg


@pytest.mark.parametrize("frames,message", [
    (np.zeros((17, 3, 16, 16), np.uint8), r"frames are \(F, 3, H, W\) .*frames.transpose\(0, 2, 3, 1\)"),
    (np.zeros((17, 16, 16, 3), np.float32), r"frames are float32; store uint8"),
    (np.zeros((17, 16, 16), np.uint8), r"expected \(F, H, W, 3\)"),
])
def test_npz_clips_of_the_wrong_layout_or_dtype_are_refused(tmp_path, frames, message):
    np.savez(tmp_path / "c.npz", frames=frames)
    (tmp_path / "train.jsonl").write_text(json.dumps({"path": "c.npz", "prompt": "noise"}))
    cfg = DatasetConfig(str(tmp_path), target_resolution=(16, 16), manifest="train.jsonl", elements=())
    msg = problems_of(cfg, num_frames=9)
    assert f"c: {tmp_path / 'c.npz'} (train.jsonl line 1): unreadable video" in msg
    assert re.search(message, msg)


def test_audio_only_file_is_named_as_such(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    with av.open(str(d / "003.mp4"), "w") as c:
        s = c.add_stream("aac", rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        c.mux(s.encode(frame))
        c.mux(s.encode())
    assert f"003: {d / '003.mp4'}: unreadable video (ValueError: no video stream (an audio-only file?))" in \
        problems_of(cfg_of(d))


# ---------------------------------------------------------------- 2. a failure mid-run does not end it


def test_a_file_damaged_after_validation_gives_a_marker_not_an_exception(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    ds = E2VDataset([cfg_of(d)], num_frames=9, verbose=False)
    (d / "001_object.png").write_bytes(b"gone")
    (d / "002.mp4").write_bytes(b"")
    loader = torch.utils.data.DataLoader(ds, batch_sampler=[[(0, 0), (1, 0)], [(2, 0)], [(3, 0)]],
                                         collate_fn=collate)
    b1, b2, b3 = list(loader)
    assert b1["indices"] == [0, 1] and b1["failed"] == [
        (1, f"001: {d / '001_object.png'}: failed to load (ValueError: not a readable image "
            f"(UnidentifiedImageError: cannot identify image file '{d / '001_object.png'}'))")]
    assert b2["failed"][0][0] == 2 and f"002: {d / '002.mp4'}: failed to load" in b2["failed"][0][1]
    assert "failed" not in b3 and b3["video"].shape == (1, 3, 9, 32, 48)


def test_load_failures_skip_and_drop_deterministically():
    ok = dict(indices=[0, 1])
    bad = dict(indices=[2, 3], failed=[(3, "003: x.mp4: failed to load (boom)")])
    f = LoadFailures(skip_bad_samples=True)
    assert not f.refuses(ok)
    assert f.refuses(bad)
    assert f.skip_step(7) == ["step 7: sample failed to load: 003: x.mp4: failed to load (boom)",
                              "step 7 not trained; 1 sample(s) dropped so far"]
    assert f.refuses(dict(indices=[3, 0]))  # dropped for the rest of the run, even if it loaded now
    f.skip_step(9)
    resumed = LoadFailures(skip_bad_samples=True)
    resumed.load_state_dict(json.loads(json.dumps(f.state_dict())))  # survives a checkpoint
    assert resumed.refuses(dict(indices=[3])) and not resumed.refuses(ok)
    assert resumed.summary() == "1 sample(s) dropped after failing to load; 2 step(s) not trained"
    strict = LoadFailures(skip_bad_samples=False)  # stops instead: a fixed file must be read again on resume
    assert strict.refuses(bad)
    strict.skip_step(7)
    assert strict.dropped == {} and "--skip-bad-samples" in strict.stop_message(7)


def _two_ranks(rank, world, port, out, data_dir):
    import torch.distributed as dist

    import data

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    checked = []
    check = data.check_sample
    data.check_sample = lambda s, **kw: checked.append(s.id) or check(s, **kw)
    ds = E2VDataset([cfg_of(data_dir)], num_frames=9, skip_bad_samples=True, verbose=False)  # validation is shared
    f = LoadFailures(skip_bad_samples=True)
    # rank 1's micro-batch of step 0 fails; rank 0's is fine. Step 1: rank 0 holds the dropped sample.
    steps = [[dict(indices=[0]), dict(indices=[1], failed=[(1, "001: a.mp4: failed to load (x)")])],
             [dict(indices=[1]), dict(indices=[2])], [dict(indices=[3]), dict(indices=[0])]]
    refused = []
    for step, batches in enumerate(steps):
        refused.append(f.refuses(batches[rank]))
        if refused[-1]:
            f.skip_step(step)
    torch.save(dict(refused=refused, state=f.state_dict(), checked=checked,
                    samples=[(s.id, s.num_frames, s.size) for s in ds.samples]), out / f"{rank}.pt")
    dist.destroy_process_group()


def test_ranks_share_validation_and_skip_the_same_steps(synth, tmp_path):
    import socket

    d = copy_of(synth, tmp_path)
    (d / "002.mp4").write_bytes(b"garbage")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(_two_ranks, args=(2, port, tmp_path, d), nprocs=2, start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert r0["checked"] == ["000", "002"] and r1["checked"] == ["001", "003"]  # each rank decodes half
    assert r0["samples"] == r1["samples"] == [("000", 17, (32, 48)), ("001", 17, (32, 48)), ("003", 17, (32, 48))]
    assert r0["refused"] == r1["refused"] == [True, True, False]
    assert r0["state"] == r1["state"] == dict(dropped={1: "001: a.mp4: failed to load (x)"}, skipped_steps=2)


# ---------------------------------------------------------------- 3. content read the way the file means it


def test_exif_orientation_is_applied(tmp_path):
    a = np.zeros((10, 20, 3), np.uint8)
    a[:5, :5] = RED
    im = Image.fromarray(a)
    exif = im.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display", as a phone held upright writes it
    im.save(tmp_path / "o6.png", exif=exif)
    r = np.asarray(read_image(tmp_path / "o6.png"))
    assert r.shape == (20, 10, 3) and r[0, -1].tolist() == RED and r[0, 0].tolist() == [0, 0, 0]


def red_corner(frame: np.ndarray) -> str:
    corners = {"top-left": frame[:4, :4], "top-right": frame[:4, -4:], "bottom-left": frame[-4:, :4],
               "bottom-right": frame[-4:, -4:]}
    (name,) = [k for k, v in corners.items() if np.abs(v.astype(int) - RED).max() < 40]
    return name


@pytest.mark.parametrize("rotation,corner", [(90, "bottom-left"), (-90, "top-right"), (180, "bottom-right")])
def test_video_rotation_metadata_is_applied(tmp_path, rotation, corner):
    """The display matrix turns the stored frame counter-clockwise by `rotation` degrees (PyAV/FFmpeg's meaning)."""
    write_video(tmp_path / "v.mp4", marked_frames(9, 32, 64), rotation=rotation)
    f = read_frames(tmp_path / "v.mp4", [0, 8])
    assert f.shape == ((2, 32, 64, 3) if rotation == 180 else (2, 64, 32, 3))
    assert red_corner(f[0]) == red_corner(f[1]) == corner


def test_portrait_phone_video_lands_in_a_portrait_bucket(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    write_video(d / "000.mp4", marked_frames(17, 48, 80), rotation=-90)  # stored landscape, shown portrait
    ds = E2VDataset([DatasetConfig(str(d), target_resolution=(48, 80), auto_frame_buckets=True,
                                   frame_buckets=(9, 17))], num_frames=17, verbose=False)
    s = next(s for s in ds.samples if s.id == "000")
    assert s.size == (80, 48)
    frames, h, w, _ = ds.bucket_of(s)
    assert h > w and ds[ds.samples.index(s)]["video"].shape == (3, 17, h, w)


def test_transparency_is_composited_on_white(tmp_path):
    rgba = np.zeros((8, 8, 4), np.uint8)  # transparent black...
    rgba[2:6, 2:6] = [255, 0, 0, 255]  # ...around an opaque red square
    Image.fromarray(rgba).save(tmp_path / "cut.png")
    r = np.asarray(read_image(tmp_path / "cut.png"))
    assert r[0, 0].tolist() == WHITE and r[3, 3].tolist() == RED
    Image.fromarray(rgba).convert("LA").save(tmp_path / "la.png")
    assert np.asarray(read_image(tmp_path / "la.png"))[0, 0].tolist() == WHITE
    p = Image.fromarray(rgba[..., :3]).convert("P")  # palette with a transparent index
    p.info["transparency"] = p.getpixel((0, 0))
    p.save(tmp_path / "p.png", transparency=p.getpixel((0, 0)))
    assert np.asarray(read_image(tmp_path / "p.png"))[0, 0].tolist() == WHITE


def test_16bit_palette_and_cmyk_images_keep_their_brightness(tmp_path):
    Image.fromarray(np.full((4, 4), 32896, np.uint16)).save(tmp_path / "g16.png")  # 16-bit mid grey
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    assert np.asarray(read_image(tmp_path / "g16.png"))[0, 0].tolist() == [128, 128, 128]
    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=100)  # red in CMYK
    assert np.abs(np.asarray(read_image(tmp_path / "c.jpg")).astype(int)[0, 0] - RED).max() < 3
    Image.new("RGB", (4, 4), (10, 200, 30)).convert("P", palette=Image.ADAPTIVE).save(tmp_path / "p.gif")
    assert np.asarray(read_image(tmp_path / "p.gif"))[0, 0].tolist() == [10, 200, 30]


def test_upper_case_names_match_and_hidden_files_are_not_samples(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    for name in ("000.mp4", "000.txt", "000_person.png"):
        (d / name).rename(d / name.upper())
    (d / "._001.mp4").write_bytes(b"\x00\x05\x16\x07AppleDouble")  # macOS resource fork beside 001.mp4
    (d / "._001_person.png").write_bytes(b"\x00\x05\x16\x07")
    shutil.copy(d / "002.mp4", d / ".hidden.mp4")
    ds = E2VDataset([cfg_of(d)], num_frames=9, verbose=False)  # no problem raised
    assert sorted(s.id for s in ds.samples) == ["000", "001", "002", "003"]
    assert ds.samples[0].elements["subject"].name == "000_PERSON.PNG"


def test_captions_decoded_with_boms_and_bad_ones_reported(synth, tmp_path, capsys):
    d = copy_of(synth, tmp_path)
    (d / "000.txt").write_bytes(codecs.BOM_UTF8 + b"The video shows a dog.")
    (d / "001.txt").write_bytes("The video shows a caf\u00e9.".encode("utf-16"))  # BOM + UTF-16 LE
    ds = E2VDataset([cfg_of(d)], num_frames=9, verbose=False)
    assert [s.prompt for s in ds.samples[:2]] == ["A dog.", "A caf\u00e9."]
    (d / "002.txt").write_bytes(b"A caf\xe9 in Paris.")  # cp1252
    (d / "003.txt").write_text("The video shows")
    msg = problems_of(cfg_of(d), num_frames=9)
    assert f"002: {d / '002.txt'}: caption is not UTF-8 text (byte 0xe9 at offset 5); save it as UTF-8" in msg
    assert f"003: {d / '003.txt'}: caption 'The video shows' is empty once the captioner's boilerplate is " \
           "removed" in msg
    (d / "002.txt").write_text("word " * 600)
    (d / "003.txt").write_text("A dog.")
    ds = E2VDataset([cfg_of(d)], num_frames=9)  # a warning only: the sample trains
    assert len(ds) == 4
    assert f"warning: 002: {d / '002.txt'}: caption has at least 601 T5 tokens; the text encoder reads " \
           "the first 512" in capsys.readouterr().out


def test_one_id_with_two_videos_is_ambiguous_not_two_samples(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    shutil.copy(d / "001.mp4", d / "001.MOV")
    msg = problems_of(cfg_of(d), num_frames=9)
    assert f"001: {d / '001.MOV'}, {d / '001.mp4'}: several videos for one id; keep one" in msg
    ds = E2VDataset([cfg_of(d)], num_frames=9, skip_bad_samples=True, verbose=False)
    assert [s.id for s in ds.samples] == ["000", "002", "003"]


# ---------------------------------------------------------------- manifests and configs


def test_manifest_lines_rows_and_duplicates_are_named(synth, tmp_path):
    rows = [json.dumps({"video": str(synth / "000.mp4"), "caption": "a"}), "",
            '{"video": "x.mp4", "caption": }', json.dumps({"video": str(synth / "001.mp4"), "caption": "b"}),
            json.dumps({"id": "000", "video": str(synth / "002.mp4"), "caption": "c"}), json.dumps([1])]
    (tmp_path / "m.jsonl").write_text("\n".join(rows))
    cfg = DatasetConfig(str(tmp_path), target_resolution=(32, 48), manifest="m.jsonl", elements=())
    msg = problems_of(cfg, num_frames=9)
    m = tmp_path / "m.jsonl"
    assert f"-: {m} (line 3): not valid JSON (Expecting value at column 31)" in msg
    assert f"-: {m} (line 6): expected a JSON object, got list" in msg
    assert f"000: {synth / '002.mp4'} (m.jsonl line 5): duplicate id (first on line 1)" in msg
    assert msg.startswith("3 problem(s)")
    ds = E2VDataset([cfg], num_frames=9, skip_bad_samples=True, verbose=False)
    assert [s.id for s in ds.samples] == ["000", "001"]


def test_excel_csv_with_bom_semicolons_and_windows_paths_loads(synth, tmp_path):
    copy_of(synth, tmp_path)
    text = "Video;Caption;Subject\r\nd\\000.mp4;A square;d\\000_person.png\r\nd\\001.mp4;;\r\n"
    (tmp_path / "excel.csv").write_bytes(codecs.BOM_UTF8 + text.encode())
    cfg = DatasetConfig(str(tmp_path), target_resolution=(32, 48), manifest="excel.csv", elements=A2_ELEMENTS[:1])
    msg = problems_of(cfg, num_frames=9)
    assert msg.startswith("1 problem(s)")
    assert f"d/001: {tmp_path / 'excel.csv'} (excel.csv line 3): empty caption" in msg
    ds = E2VDataset([cfg], num_frames=9, skip_bad_samples=True, verbose=False)
    assert ds[0]["prompt"] == "A square" and ds[0]["element_names"] == ("subject",)
    (tmp_path / "cols.csv").write_text("clip,caption\n000.mp4,a\n")
    with pytest.raises(DatasetError, match=r"cols.csv: no 'video' \(or 'path'\) column; its columns: "
                                           r"\['caption', 'clip'\]"):
        E2VDataset([DatasetConfig(str(tmp_path), manifest="cols.csv", elements=())], 9, verbose=False)


def test_config_errors_name_the_file_and_entry(tmp_path):
    f = tmp_path / "train.json"
    f.write_text(json.dumps({"datasets": [{"data_root": str(tmp_path)}, {"data_root": "nowhere"}]}))
    with pytest.raises(DatasetError, match=rf"train.json: datasets\[1\]: data_root {tmp_path / 'nowhere'} is not a "):
        E2VDataset(load_dataset_config(f), 9, verbose=False)
    f.write_bytes(codecs.BOM_UTF8 + json.dumps({"datasets": [
        {"data_root": "a"}, {"data_root": "b", "processors": {"vae": {"combine": "after"}}}]}).encode())
    with pytest.raises(ConfigError, match=r"train.json: datasets\[1\].processors.vae: differs from datasets\[0\]"):
        load_dataset_config(f)  # and the BOM Notepad writes is no error


# ---------------------------------------------------------------- 4. reporting and the CLI


def test_buckets_that_never_fill_a_global_batch_are_reported(synth, tmp_path, capsys):
    d = copy_of(synth, tmp_path)
    (d / "003_object.png").unlink()  # optional element missing: a bucket of its own, of one sample
    E2VDataset([cfg_of(d)], num_frames=9, global_batch=2)
    out = capsys.readouterr().out
    assert "bucket 9 frames 32x48 [subject, object, background]: 3 samples\n" in out
    assert ("bucket 9 frames 32x48 [subject, background]: 1 samples, fewer than one global batch (2) per epoch: "
            "never trained") in out
    assert "trained: 3 of 4 samples (1 in buckets that never fill a global batch" in out


def validate(capsys, *args) -> tuple[int, str, str]:
    """`data.py validate ARGS` in this process: (exit status, stdout, stderr)."""
    from data import _cli

    try:
        _cli(["validate", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate_cli_one_line_per_problem_exit_2_no_traceback(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    with open(os.fsencode(d) + b"/caf\xe9.mp4", "wb") as fh:  # a Latin-1 file name: not UTF-8
        fh.write(b"garbage")
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), "validate", "--data-root", str(d), "--num-frames", "33",
                        "--resolution", "32", "48"], capture_output=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, PYTHONIOENCODING="utf-8"))  # strict: a surrogate would crash print()
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err  # the summary of the rest on stdout (docs/dataset.md)
    assert r.stdout.decode().startswith("dataset: 0 samples from 1 dataset(s) besides the 5 with a problem (below)")
    lines = err.splitlines()
    assert lines[0] == "error: 6 problem(s) in the dataset:" and len(lines) == 8
    assert lines[5] == f"  caf\\xe9: {d}/caf\\xe9.txt: caption file missing"
    assert lines[6].startswith(f"  caf\\xe9: {d}/caf\\xe9.mp4: unreadable video")
    # --num-frames is the whole sequence, as in train_a2.py: 33 with A2's three references leaves 21 clip frames
    ds = DatasetConfig(str(d))
    assert clip_frames(33, ds.elements, ds.vae) == 21
    assert lines[1:5] == [f"  00{i}: {d / f'00{i}.mp4'}: 17 frames, shorter than the smallest bucket (21): "
                          "--num-frames 33 less the 12 frames the references take" for i in range(4)]


def test_validate_skips_what_it_lists_and_names_bad_flags(synth, tmp_path, capsys):
    d = copy_of(synth, tmp_path)
    (d / "002.mp4").write_bytes(b"garbage")
    code, out, _ = validate(capsys, "--data-root", str(d), "--num-frames", "29", "--skip-bad-samples")  # 17-frame clips
    assert code == 0 and "dataset: 3 samples from 1 dataset(s); skipped 1 bad sample(s)" in out
    assert f"  skipped: 002: {d / '002.mp4'}: unreadable video" in out
    code, _, err = validate(capsys, "--data-root", str(tmp_path / "none"))
    assert code == 2 and err == f"error: --data-root: data_root {tmp_path / 'none'} is not a directory\n"


def test_validate_reads_manifests_and_json_configs_like_train(synth, tmp_path, capsys):
    (tmp_path / "m.jsonl").write_text(json.dumps({"video": str(synth / "000.mp4"), "caption": "a"}))
    code, out, _ = validate(capsys, "--manifest", str(tmp_path / "m.jsonl"), "--dataset-type", "t2v",
                            "--num-frames", "17", "--model", "tiny-t2v")
    assert code == 0 and "dataset: 1 samples" in out
    (tmp_path / "c.json").write_text(json.dumps({"datasets": [{"data_root": str(synth), "target_resolution": [32, 48],
                                                              "auto_frame_buckets": True}]}))
    code, out, _ = validate(capsys, "--dataset-config", str(tmp_path / "c.json"), "--num-frames", "33",
                            "--micro-batch", "2", "--world-size", "4", "--model", "tiny-t2v")
    assert code == 0 and "bucket 17 frames 32x48 [no elements]: 4 samples, fewer than one global " \
                         "batch (8) per epoch: never trained" in out
    code, _, err = validate(capsys, "--manifest", str(tmp_path / "m.jsonl"), "--dataset-type", "t2v")
    assert code == 2 and "T2V-only training (no elements, no frame conditioning) needs a T2V model" in err
    assert "or give the data its element images (--elements, or \"elements\" in each dataset" in err  # the fix


def test_validate_reads_the_clip_length_of_the_models_layout(synth, capsys):
    """--num-frames 17 with A2's three references: A2's prefix layout reads 5-frame clips; Phantom-Wan's weights take
    their own layout (references appended, the whole clip is video), so the same flags with its model read 17."""
    code, out, _ = validate(capsys, "--data-root", str(synth), "--num-frames", "17", "--resolution", "32", "48")
    assert code == 0 and "bucket 5 frames 32x48" in out
    code, out, _ = validate(capsys, "--data-root", str(synth), "--num-frames", "17", "--resolution", "32", "48",
                            "--model", "tiny-phantom")
    assert code == 0 and "bucket 17 frames 32x48" in out, out


def test_validate_buckets_by_the_models_size_multiple(synth, tmp_path, capsys):
    """TI2V-5B's aspect buckets are multiples of 32 (its VAE x patch), as training makes them: 96x160 for a 2:3 clip
    at about 96x160's area (multiples of 16 would make it 96x144)."""
    (tmp_path / "c.json").write_text(json.dumps({"datasets": [{"data_root": str(synth), "target_resolution": [96, 160],
                                                              "auto_frame_buckets": True}]}))
    code, out, _ = validate(capsys, "--dataset-config", str(tmp_path / "c.json"), "--num-frames", "17",
                            "--model", "tiny-ti2v")
    assert code == 0 and "bucket 17 frames 96x160" in out, out


# ---------------------------------------------------------------- real media


def test_real_rotated_hiker_and_cut_out(media, tmp_path):
    """The hiker clip re-encoded as a phone stores portrait video (landscape pixels + rotation): read back upright,
    it is the original turned; a cut-out person (a drawn one, on transparency over random colours) is white where it
    is transparent and the person where it is opaque."""
    with av.open(str(media / "hiker.mp4")) as c:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])[:9]
    turned = np.ascontiguousarray(np.rot90(frames, k=-1, axes=(1, 2)))  # what the phone saw: portrait
    write_video(tmp_path / "phone.mp4", np.ascontiguousarray(np.rot90(turned, k=1, axes=(1, 2))), rotation=-90)
    got = read_frames(tmp_path / "phone.mp4", list(range(9)))
    assert got.shape == turned.shape == (9, 720, 480, 3)
    assert np.abs(got.astype(int) - turned).mean() < 4  # H.264 re-encoding error only
    assert np.abs(got.astype(int) - np.rot90(turned, k=2, axes=(1, 2))).mean() > 20  # not upside down
    cut = drawn_person((720, 1280), background="transparent")
    cut.save(tmp_path / "cut.png")
    person, alpha = np.asarray(cut)[..., :3], np.asarray(cut)[..., 3]
    r = np.asarray(read_image(tmp_path / "cut.png"))
    assert 0 < (alpha == 255).mean() < 0.5 and ((alpha == 0) | (alpha == 255)).all()
    assert (r[alpha == 0] == 255).all() and (person[alpha == 0] != 255).any(axis=-1).mean() > 0.9
    assert (r[alpha == 255] == person[alpha == 255]).all()


# ---------------------------------------------------------------- train_a2.py: refused runs, failures mid-run


def test_train_refuses_bad_data_in_one_block_and_leaves_no_run_dir(synth, tmp_path):
    from tests.conftest import args

    d = copy_of(synth, tmp_path)
    (d / "002.mp4").write_bytes(b"garbage")
    r = subprocess.run([sys.executable, str(ROOT / "train_a2.py"), *args(d, tmp_path / "runs", "r")],
                       capture_output=True, cwd=ROOT, timeout=600)
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert f"error: 1 problem(s) in the dataset:\n  002: {d / '002.mp4'}: unreadable video" in err
    assert not (tmp_path / "runs").exists()


def test_a_sample_failing_mid_run_stops_with_a_checkpoint_or_is_dropped_the_same_way(synth, tmp_path, monkeypatch,
                                                                                    capsys):
    """Validation passes; then 001.mp4 fails whenever training reads it. Without --skip-bad-samples the run writes
    the checkpoint before that step and stops with one line; resumed with --skip-bad-samples it ends exactly as a run
    that skipped from the start (the same steps untrained, the same weights)."""
    import data
    from tests.conftest import args, params, train

    d = copy_of(synth, tmp_path)
    read = data.read_clip

    def flaky(path, indices):
        if path.name == "001.mp4":
            raise OSError("Input/output error")
        return read(path, indices)

    monkeypatch.setattr(data, "read_clip", flaky)
    steps = ["--max-steps", "4", "--ckpt-every", "2"]
    skipped = train(*args(d, tmp_path, "skip", *steps, "--skip-bad-samples"))
    out = capsys.readouterr().out
    assert f"sample failed to load: 001: {d / '001.mp4'}: failed to load (OSError: Input/output error)" in out
    n = out.count("not trained;")
    assert n >= 1 and f"1 sample(s) dropped after failing to load; {n} step(s) not trained" in out
    assert len(skipped["losses"]) == 4 - n  # untrained steps log no loss
    with pytest.raises(DatasetError, match=r"stopped at step (\d+) on a sample that failed to load") as e:
        train(*args(d, tmp_path, "stop", *steps))
    first = int(re.search(r"step (\d+)", str(e.value)).group(1))  # 1-based: the step that was not trained
    assert sorted(p.name for p in (tmp_path / "stop").glob("ckpt-*"))[-1] == f"ckpt-{first - 1:07d}"
    train(*args(d, tmp_path, "stop", *steps, "--skip-bad-samples", "--resume", "auto"))
    assert max_diff_is_zero(params(tmp_path / "skip" / "ckpt-0000004"), params(tmp_path / "stop" / "ckpt-0000004"))


def max_diff_is_zero(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys() and len(a) > 0
    return all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- what a folder dataset leaves out or half-holds


def test_orphan_captions_and_element_images_are_warned(synth, tmp_path, capsys):
    d = copy_of(synth, tmp_path)
    (d / "003.mp4").unlink()  # its caption and element images stay behind
    (d / "002_persn.png").write_bytes((d / "002_person.png").read_bytes())  # a mistyped suffix
    ds = E2VDataset([cfg_of(d)], num_frames=9)  # warnings only: the other samples train
    out = capsys.readouterr().out
    assert len(ds) == 3
    for name in ("003.txt", "003_person.png", "003_object.png", "003_background.png"):
        what = "caption" if name.endswith(".txt") else "element image"
        assert f"  warning: -: {d / name}: no video '003' for this {what}" in out
    assert f"  warning: 002: {d / '002_persn.png'}: matches no element suffix of sample '002'" in out


def test_degenerate_reference_and_dangling_symlink_video_are_reported(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    Image.new("RGB", (1, 1), "white").save(d / "001_object.png")
    (d / "002.mp4").unlink()
    (d / "002.mp4").symlink_to(tmp_path / "moved" / "002.mp4")
    msg = problems_of(cfg_of(d), num_frames=9)
    assert f"001: {d / '001_object.png'}: element 'object' is 1x1 pixels: too small to be a reference" in msg
    assert f"002: {d / '002.mp4'}: video is a dangling symlink (to {tmp_path / 'moved' / '002.mp4'})" in msg


def test_validate_lists_every_problem_of_a_sample(synth, tmp_path, capsys):
    """A clip too short AND a UTF-16 caption without a byte-order mark (NUL bytes, valid UTF-8 byte by byte): both."""
    d = copy_of(synth, tmp_path)
    (d / "001.txt").write_bytes("A hiker on a mountain.".encode("utf-16-le"))
    code, _, err = validate(capsys, "--data-root", str(d), "--num-frames", "33", "--resolution", "32", "48")
    assert code == 2
    mine = [x for x in err.splitlines() if x.startswith("  001: ")]
    assert mine == [f"  001: {d / '001.txt'}: caption is UTF-16 text without a byte-order mark (NUL bytes); save it "
                    "as UTF-8", f"  001: {d / '001.mp4'}: 17 frames, shorter than the smallest bucket (21): "
                    "--num-frames 33 less the 12 frames the references take"]
