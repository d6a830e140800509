"""Public S2V datasets as published (a2/data/public_read.py, public_index.py with its synthetic_opens2v): fixtures in
each dataset's exact schema, built here from real media (the hiker clip of tests/media, a drawn person composited under
known masks), RLE-encoded with pycocotools. The element images training builds must equal the ones built by hand
from the decoded frame (the published rule: the mask's tight box, its pixels on white), the clip must be the
face_cut range of the cropped frames, every filter and bad record is counted or named in one line, and a multi-MB
part JSON is indexed in bounded memory."""

import json
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import tyro
from PIL import Image

import a2.data.public_index as pi
import a2.data.public_read as pr
import train_a2
from a2.config.dataset_config import DatasetConfig
from a2.data import public_index as pf
from a2.data.media import read_frames
from a2.elements import A2_ELEMENTS
from a2.images import read_image, reference_pixels, resize_frames
from a2.kinds.kinds import KIND_DEFS, index_elements, largest_element_set
from config import DataConfig, from_flags
from data import E2VDataset, Validate, validate
from tests.conftest import MEDIA, drawn_person

SIZE = (64, 96)  # training resolution of these tests (multiple of 16)


def hiker_frames(n=20):
    """The hiker clip's first n frames, halved (120x184): real content, fast to encode and decode."""
    f = read_frames(MEDIA / "hiker_tiny.mp4", list(range(n)))
    return np.stack([np.asarray(Image.fromarray(x).resize((184, 120))) for x in f])


def person():
    return np.asarray(drawn_person((720, 1280)))  # composited into the clip: any picture with detail


def by_hand(frame: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The published element rule, written out: tight box of the mask, masked pixels on white."""
    ys, xs = np.where(mask)
    box = (slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1))
    out = np.full_like(frame[box], 255)
    out[mask[box]] = frame[box][mask[box]]
    return out


@pytest.fixture(scope="module")
def opens2v(tmp_path_factory):
    root = tmp_path_factory.mktemp("opens2v")
    fx = pf.synthetic_opens2v(root, hiker_frames(), person(), num_clips=2)
    out = root / "index"
    counts = pi.index_opens2v(pi.IndexOpenS2V(str(root), str(out)))
    return dict(fx, root=root, out=out, counts=counts)


def public_cfg(index, dataset_type="opens2v", **kw):
    return DatasetConfig(str(Path(index).parent), dataset_type=dataset_type, manifest=str(index),
                         target_resolution=SIZE, elements=A2_ELEMENTS, **kw)


def test_opens2v_elements_equal_the_hand_built_mask_crop_on_white(opens2v):
    fx = opens2v
    lines = [json.loads(x) for x in (fx["out"] / "index.jsonl").read_text().splitlines()]
    assert [x["key"] for x in lines] == list(fx["records"])
    sx, ex, sy, ey = fx["crop"]
    frame = read_frames(fx["video"], [fx["ann"]])[0][sy:ey, sx:ex]  # the annotation frame as decoded, cropped
    s = pr.list_index(fx["out"] / "index.jsonl", public_cfg(fx["out"] / "index.jsonl"), 0, [])[0]
    _, images = pr.load_sample(s, [], ["subject", "object", "background"])
    assert np.array_equal(np.asarray(images["subject"]), by_hand(frame, fx["masks"]["1"]))  # "woman"
    assert np.array_equal(np.asarray(images["object"]), by_hand(frame, fx["masks"]["4"]))  # "backpack"
    assert np.array_equal(np.asarray(images["background"]), np.asarray(Image.open(
        fx["root"] / "Background" / "total_part1" / f"{s.id}.png").convert("RGB")))
    # export-elements writes exactly these images
    produced = pi.export_elements(pi.ExportElements(str(fx["out"] / "index.jsonl"), str(fx["root"] / "export")))
    assert sorted(produced[s.id]) == ["background", "object", "subject"]
    assert np.array_equal(np.asarray(Image.open(produced[s.id]["subject"])), by_hand(frame, fx["masks"]["1"]))


def test_opens2v_filters_and_background_names_are_counted(opens2v):
    c = opens2v["counts"]
    assert c["clips read"] == c["clips kept"] == 2
    assert c["subject masks dropped: crop_ratio < 0.1"] == 2  # the 3x3 "person", once per clip
    assert c["subject masks dropped: aes < 4.5 and gme < 0.6"] == 2  # the "man"
    assert c["masks of background or untagged classes (not elements)"] == 2  # "grass"
    assert c["background found as <key>.png (demo dataloader)"] == 1
    assert c["background found as <key>_step7.png (BindWeave)"] == 1
    report = (opens2v["out"] / "report.txt").read_text()
    assert "rule: subject/object masks by word_tags" in report and "crop_ratio >= 0.1" in report


def test_opens2v_thresholds_are_flags_and_the_fallback_is_the_largest_crop(opens2v, tmp_path):
    a = pi.IndexOpenS2V(str(opens2v["root"]), str(tmp_path), min_aes=9.0, min_gme=0.9)  # nothing passes
    c = pi.index_opens2v(a)
    assert c["subject: largest crop taken as fallback (none passed)"] == 2 and c["clips kept"] == 2
    line = json.loads((tmp_path / "index.jsonl").read_text().splitlines()[0])
    roles = pr.clip_roles(line)
    assert roles["subject"]["class_name"] == "woman"  # the largest subject crop
    assert "object" not in roles  # no fallback for objects
    assert [r["class_name"] for r in line["references"]] == ["woman"]  # the fallback alone


def test_opens2v_clip_is_face_cut_of_the_cropped_frames_at_its_own_fps(opens2v):
    fx = opens2v
    cfg = public_cfg(fx["out"] / "index.jsonl")
    ds = E2VDataset([cfg], num_frames=9, frame_sampling="head", verbose=False)  # 9 frames: no reference latents
    s = ds.samples[0]
    start, end = fx["face_cut"]
    assert (s.start, s.num_frames) == (start, end - start)
    sx, ex, sy, ey = fx["crop"]
    assert s.size == (ey - sy, ex - sx)
    item = ds[(0, 0)]
    raw = read_frames(fx["video"], list(range(start, start + 9)))[:, sy:ey, sx:ex]
    assert torch.equal(item["video"], resize_frames(raw, cfg.reshape_mode, ds.buckets[0][1:3]))
    frame = read_frames(fx["video"], [fx["ann"]])[0][sy:ey, sx:ex]
    image = Image.fromarray(by_hand(frame, fx["masks"]["1"]))
    (vae,), _, _ = reference_pixels(None, [image], A2_ELEMENTS[:1], ds.buckets[0][1:3], (512, 512))
    assert item["element_names"] == ("subject", "object", "background") and torch.equal(item["ref_vae"][0], vae)


def test_train_config_and_validate_read_the_index(opens2v, capsys):
    index = str(opens2v["out"] / "index.jsonl")
    cfgs = train_a2.run_datasets(from_flags(dataset_type="opens2v", manifest=index, resolution=SIZE))
    assert cfgs[0].dataset_type == "opens2v" and cfgs[0].elements == A2_ELEMENTS
    ds = validate(Validate(data=DataConfig(dataset_type="opens2v", manifest=index, resolution=SIZE, num_frames=25)))
    out = capsys.readouterr().out
    assert len(ds) == 2 and "opens2v index built with: subject/object masks by word_tags" in out
    assert "elements: subject 2/2, object 2/2, background 2/2" in out


def test_bad_records_are_one_line_each_and_the_index_is_still_written(opens2v, tmp_path):
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(opens2v["root"], root, ignore=shutil.ignore_patterns("index", "export"))
    good = dict(opens2v["records"])
    key0 = next(iter(good))
    rec = json.loads(json.dumps(good[key0]))

    def variant(name, edit):
        r = json.loads(json.dumps(rec))
        edit(r)
        return f"{name}_part1_step6", r

    masks = lambda r: r["annotation"]["mask_annotation"]["2"]  # noqa: E731
    h, w = masks(rec)["1"]["size"]
    outside = np.zeros((h, w), bool)  # the annotation lies outside the crop: nothing of it inside
    bad = [variant("nocut", lambda r: r["metadata"].pop("face_cut")),
           variant("wrongsize", lambda r: masks(r)["1"].update(pf.rle_encode(np.ones((h + 4, w), bool)))),
           variant("outside", lambda r: (masks(r).update({"1": pf.rle_encode(outside)}),
                                         [masks(r).pop(k) for k in ("2", "3")])),
           variant("novideo", lambda r: r["metadata"].update(path="gone.mp4")),
           variant("nobackground", lambda r: None)]
    pf.write_part(root / "Jsons" / "mask_and_bbox_High-Quality" / "total_part1.json", [(key0, rec), *bad])
    c = pi.index_opens2v(pi.IndexOpenS2V(str(root), str(tmp_path / "out")))
    lines = (tmp_path / "out" / "report.txt").read_text().split("problems (one line each: clip key: file: "
                                                                "problem):\n")[1].splitlines()
    part = root / "Jsons" / "mask_and_bbox_High-Quality" / "total_part1.json"
    expect = {"nocut_part1_step6": f"{part}: missing field metadata.face_cut",
              "wrongsize_part1_step6": f"{part}: mask 1 (woman): RLE size [{h + 4}, {w}] is not the cropped frame's",
              "outside_part1_step6": f"{part}: mask 1 (woman) is empty inside the crop",
              "novideo_part1_step6": f"{root / 'Videos' / 'total_part1' / 'gone.mp4'}: video file not found",
              "nobackground_part1_step6": "background png not found"}
    for key, what in expect.items():
        mine = [x for x in lines if x.startswith(key + ": ")]
        assert len(mine) == 1 and what in mine[0], (key, mine)
    assert len(lines) == len(expect)
    assert c["clips kept"] == 2 and c["clips dropped: bad record"] == 2 and c["clips dropped: video missing"] == 1
    # "outside": its one subject mask is empty inside the crop (the others were taken out), so no subject is left
    assert c["clips dropped: no subject mask"] == 1
    # as BindWeave's loader, a clip whose background png is missing is kept without one (and named above)
    assert c["clips without a background png (kept without a background)"] == 1
    kept = [json.loads(x) for x in (tmp_path / "out" / "index.jsonl").read_text().splitlines()]
    assert [x["key"] for x in kept] == [key0, "nobackground_part1_step6"]
    assert "background" in kept[0]["elements"] and "background" not in kept[1]["elements"]


def test_resume_keeps_finished_parts(opens2v, tmp_path, capsys):
    out = tmp_path / "out"
    pi.index_opens2v(pi.IndexOpenS2V(str(opens2v["root"]), str(out)))
    (out / "parts" / "total_part1.jsonl").write_text("")  # had it been redone, this would be overwritten
    pi.index_opens2v(pi.IndexOpenS2V(str(opens2v["root"]), str(out)))
    assert "total_part1: indexed before, kept" in capsys.readouterr().out
    assert (out / "index.jsonl").read_text() == ""


def test_load_failure_mid_run_is_a_marker_not_a_crash(opens2v, tmp_path):
    index = tmp_path / "index.jsonl"
    line = json.loads((opens2v["out"] / "index.jsonl").read_text().splitlines()[0])
    line["references"][0]["mask"] = pf.rle_encode(np.ones((5, 5), bool))  # the subject's: does not fit the frame
    index.write_text(json.dumps(line) + "\n")
    ds = E2VDataset([public_cfg(index)], num_frames=9, verbose=False)
    item = ds[(0, 0)]
    assert item["failed"].startswith(f"{line['key']}: {opens2v['video']}") and "the mask is 5x5" in item["failed"]


def test_multi_mb_part_json_streams_in_bounded_memory(tmp_path):
    """~6 MB of JSON: a json.load of it would hold more than its size in Python objects; the streaming index holds
    one record at a time (tracemalloc counts every Python allocation, ijson's C parser's objects included)."""
    frames = np.random.default_rng(0).integers(0, 256, (12, 40, 64, 3), np.uint8)
    fx = pf.synthetic_opens2v(tmp_path, frames, frames[0], num_clips=1)
    rec = next(iter(fx["records"].values()))
    rec["metadata"]["cap"] = ["A long caption, as the published records carry. " * 50]  # ~2.5 kB, as real ones
    pf.write_part(fx["json"], ((f"c{i:06d}_part1_step6", rec) for i in range(1200)))
    size = fx["json"].stat().st_size
    assert size > 5e6
    tracemalloc.start()
    c = pi.index_opens2v(pi.IndexOpenS2V(str(tmp_path), str(tmp_path / "out"), background=False))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert c["clips kept"] == 1200
    assert peak < size / 4, (peak, size)


# ---------------------------------------------------------------- Phantom-Data


def phantom_fixture(root: Path, boxes):
    """koala36M_multi_ref_merged_filtered.parquet (vid, video_caption, cross_pair as a JSON string) + clips."""
    import imageio.v3 as iio

    (root / "videos").mkdir(parents=True)
    frames = hiker_frames()
    iio.imwrite(root / "videos" / "tgt.mp4", frames, fps=8, codec="libx264", plugin="pyav")
    iio.imwrite(root / "videos" / "ref.mp4", frames[::-1].copy(), fps=8, codec="libx264", plugin="pyav")
    pairs = {"a hiker": {"obj_from_tgt_video": [], "refer_result": [
        {"vid": "missing", "frame_idx": 0.1, "bbox_loc": [0, 0, 10, 10], "bbox_cls": "person"},
        {"vid": "ref", "frame_idx": 0.5, "bbox_loc": boxes[0], "bbox_cls": "person", "scores": 0.9}]},
        "the mountain top": {"obj_from_tgt_video": [], "refer_result": [
            {"vid": "ref", "frame_idx": 0.25, "bbox_loc": boxes[1], "bbox_cls": "mountain"}]}}
    pq.write_table(pa.table({"vid": ["tgt", "gone"], "video_caption": ["A hiker on a mountain top."] * 2,
                             "cross_pair": [json.dumps(pairs)] * 2}), root / pi.PHANTOM_PARQUET)
    return frames


def test_phantom_box_crops_scale_from_the_768_canvas_and_clip(tmp_path):
    boxes = [[100.0, 50.0, 400.0, 300.0], [500.0, -20.0, 900.0, 200.0]]  # the second overflows the canvas
    frames = phantom_fixture(tmp_path, boxes)
    c = pi.index_phantom(pi.IndexPhantom(str(tmp_path), str(tmp_path / "out")))
    assert c["clips kept"] == 1 and c["clips dropped: video not downloaded"] == 1
    assert c["boxes overflowing the 768 canvas (clipped at load)"] == 1
    assert "gone: " in (tmp_path / "out" / "report.txt").read_text()
    line = json.loads((tmp_path / "out" / "index.jsonl").read_text())
    assert [(r["role"], r["class_name"]) for r in pr.clip_references(line, 4, background=True)] == [
        ("subject", "person"), ("object", "mountain")]  # every phrase a reference, the person first
    s = pr.list_index(tmp_path / "out" / "index.jsonl", public_cfg(tmp_path / "out" / "index.jsonl", "phantom"),
                       0, [])[0]
    _, images = pr.load_sample(s, [], ["subject", "object"])
    ref = read_frames(tmp_path / "videos" / "ref.mp4", list(range(20)))
    h, w = ref.shape[1:3]
    k = max(h, w) / 768  # boxes are in pixels of the frame resized to long side 768
    x0, y0, x1, y1 = (int(np.floor(100 * k)), int(np.floor(50 * k)), int(np.ceil(400 * k)), int(np.ceil(300 * k)))
    assert np.array_equal(np.asarray(images["subject"]), ref[int(20 * 0.5)][y0:y1, x0:x1])  # "a hiker": person
    x0, x1 = int(np.floor(500 * k)), w  # clipped to the frame
    assert np.array_equal(np.asarray(images["object"]), ref[int(20 * 0.25)][0:int(np.ceil(200 * k)), x0:x1])
    assert frames.shape[0] == 20


def tiny_sam(path: Path):
    """A random SAM at 64x64 input, saved as a normal transformers dir (no download)."""
    from transformers import SamConfig, SamImageProcessor, SamModel, SamProcessor

    cfg = SamConfig(vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                                       patch_size=16, output_channels=16, mlp_dim=64, global_attn_indexes=[0],
                                       num_pos_feats=8, window_size=2),
                    prompt_encoder_config=dict(hidden_size=16, image_size=64, patch_size=16, mask_input_channels=4),
                    mask_decoder_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_dim=32,
                                             iou_head_hidden_dim=16))
    torch.manual_seed(0)
    SamModel(cfg).save_pretrained(path)
    SamProcessor(SamImageProcessor(size={"longest_edge": 64}, pad_size={"height": 64, "width": 64},
                                   mask_size={"longest_edge": 16}, mask_pad_size={"height": 16, "width": 16})
                 ).save_pretrained(path)
    return path


def test_phantom_sam_segmentation_pastes_the_mask_on_white(media, tmp_path):
    sam = str(tiny_sam(tmp_path / "sam"))
    frame = read_frames(media / "hiker_tiny.mp4", [0])[0]
    box = (40, 30, 200, 180)
    img = np.asarray(pr.box_image(frame, box, sam))
    model, processor = pr.load_sam(sam)
    inputs = processor(images=Image.fromarray(frame), input_boxes=[[list(map(float, box))]], return_tensors="pt")
    with torch.no_grad():
        masks = model(**inputs, multimask_output=False).pred_masks
    mask = processor.image_processor.post_process_masks(masks, inputs["original_sizes"],
                                                        inputs["reshaped_input_sizes"])[0][0, 0].numpy()
    crop, keep = frame[30:180, 40:200], mask[30:180, 40:200]
    assert img.shape == crop.shape and 0 < keep.sum() < keep.size  # a real partial mask, not all or nothing
    assert np.array_equal(img[keep], crop[keep]) and (img[~keep] == 255).all()


# ---------------------------------------------------------------- HuMoSet


def test_humoset_reference_photo_is_the_subject_and_the_schema_is_checked(media, tmp_path):
    import shutil

    (tmp_path / "video").mkdir()
    (tmp_path / "reference_image").mkdir()
    shutil.copy(media / "hiker_tiny.mp4", tmp_path / "video" / "h001.mp4")
    drawn_person((720, 1280)).resize((90, 160)).save(tmp_path / "reference_image" / "h001.jpg")
    pq.write_table(pa.table({"video_name": ["h001.mp4", "h002.mp4"], "caption": ["A hiker.", "Gone."]}),
                   tmp_path / "video_caption.parquet")
    c = pi.index_humoset(pi.IndexHumoSet(str(tmp_path), str(tmp_path / "out")))
    assert c["clips kept"] == 1 and c["clips dropped: video missing"] == 1
    ds = E2VDataset([public_cfg(tmp_path / "out" / "index.jsonl", "humoset")], num_frames=9, verbose=False)
    image = read_image(tmp_path / "reference_image" / "h001.jpg")
    (vae,), _, _ = reference_pixels(None, [image], A2_ELEMENTS[:1], SIZE, (512, 512))
    item = ds[(0, 0)]
    assert item["element_names"] == ("subject",) and torch.equal(item["ref_vae"][0], vae)
    pq.write_table(pa.table({"clip": ["h001.mp4"], "words": ["x"]}), tmp_path / "video_caption.parquet")
    with pytest.raises(pi.IndexError_, match=r"columns \['clip', 'words'\]: expected a video column"):
        pi.index_humoset(pi.IndexHumoSet(str(tmp_path), str(tmp_path / "out2")))


def test_cross_video_pairs_take_subject_and_object_from_the_paired_clip(opens2v, tmp_path):
    """An index built with --cross-pairs marks each listed clip with its cluster; training with --cross-video then
    loads a clip's subject and object from the other clip of its cluster (its own background stays), pixel for pixel
    what that clip's own elements are, and without --cross-video each clip keeps its own."""
    keys = list(opens2v["records"])
    pairs = tmp_path / "cluster_videos.json"
    pairs.write_text(json.dumps({"cluster7": [f"total_part1/{k}" for k in keys]}))
    out = tmp_path / "index"
    pi.index_opens2v(pi.IndexOpenS2V(str(opens2v["root"]), str(out), cross_pairs=str(pairs)))
    lines = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    assert [x.get("cluster") for x in lines] == ["cluster7", "cluster7"]
    # the synthetic clips share their annotation: make the second clip's elements another frame, so they differ
    for ref in lines[1]["references"]:
        ref["frame"] += 5
    index = tmp_path / "edited.jsonl"
    index.write_text("".join(json.dumps(x) + "\n" for x in lines))

    def images(cross: bool, elements=A2_ELEMENTS):
        cfg = replace(public_cfg(index, cross_video=cross), elements=elements)
        names = [e.name for e in elements]
        return [{k: np.asarray(v) for k, v in pr.load_sample(s, [], [n for n in names if n in s.refs])[1].items()}
                for s in pr.list_index(index, cfg, 0, [])]

    own, cross = images(False), images(True)
    assert not np.array_equal(own[0]["subject"], own[1]["subject"])  # the two clips' own subjects differ
    for i, j in ((0, 1), (1, 0)):  # each takes the other's subject and object, keeps its own background
        for ref in ("subject", "object"):
            assert np.array_equal(cross[i][ref], own[j][ref])
        assert np.array_equal(cross[i]["background"], own[i]["background"])
    # a kind without roles (V3's default elements on an index: ref0..ref3, background): each reference slot
    v3 = index_elements("v3")
    own, cross = images(False, v3), images(True, v3)
    assert sorted(own[0]) == sorted(own[1]) == ["background", "ref0", "ref1"]
    for i, j in ((0, 1), (1, 0)):
        for ref in ("ref0", "ref1"):
            assert np.array_equal(cross[i][ref], own[j][ref]) and not np.array_equal(cross[i][ref], own[i][ref])
        assert np.array_equal(cross[i]["background"], own[i]["background"])


# ---------------------------------------------------------------- references per clip, as the models were trained


def varied_opens2v(root: Path) -> dict:
    """Four OpenS2V-5M clips of 1, 2, 4 and 1 kept masks (the last without its background png): the synthetic part
    with the backpack removed from clips 0 and 3, and a hat (small) and a dog (the largest crop of all) added to
    clip 2."""
    fx = pf.synthetic_opens2v(root, hiker_frames(), person(), num_clips=4)
    records, ann = fx["records"], str(fx["ann"])
    keys = list(records)
    h, w = next(iter(fx["masks"].values())).shape
    yy, xx = np.mgrid[0:h, 0:w]
    for k in (keys[0], keys[3]):
        del records[k]["annotation"]["mask_annotation"][ann]["4"]
    # the dog's crop no wider than twice its height: MAGREF's canvas block at the test's 64x96 holds it
    extra = {"6": ("hat", (yy < h * 0.35) & (xx < w * 0.3)), "7": ("dog", (yy > h * 0.4) & (xx > w * 0.3))}
    a = records[keys[2]]["annotation"]
    for k, (cls, m) in extra.items():
        a["ann_frame_data"]["annotations"].append(dict(class_name=cls, bbox=[0, 0, 1, 1], aes_score=5.0, gme_score=0.7))
        a["mask_map"][k] = {"class_name": cls}
        a["mask_annotation"][ann][k] = {**pf.rle_encode(m), "score": [0.99]}
    records[keys[2]]["word_tags"]["object"] += ["hat", "dog"]
    pf.write_part(fx["json"], records.items())
    bg = root / "Background" / "total_part1"
    for p in bg.glob(f"{keys[3].split('_step6')[0]}*"):
        p.unlink()
    return dict(fx, keys=keys)


def test_references_are_every_kept_mask_largest_first_up_to_the_kind_maximum(tmp_path):
    """BindWeave's rule on OpenS2V-5M (get_sora_feature.py: every mask with crop_ratio >= 0.1 and aes >= 4.5 or
    gme >= 0.6 is a reference; a clip whose background png is missing is kept without one), here among the
    subject/object-tagged masks and largest first: the kinds without roles take the first `most`, A2's prefix its
    roles, absent ones absent."""
    fx = varied_opens2v(tmp_path)
    out = tmp_path / "index"
    c = pi.index_opens2v(pi.IndexOpenS2V(str(tmp_path), str(out)))
    assert c["clips read"] == c["clips kept"] == 4
    assert c["clips without a background png (kept without a background)"] == 1
    # the one clip of 4 masks (and a background png) has more than V3 (3 beside the png), RefAlign (3) and Kaleido
    # (3: ref1..ref3, zai-org/Kaleido data_video.py) take
    more = {k: v for k, v in c.items() if k.startswith("clips with more kept masks than")}
    assert more == {f"clips with more kept masks than the {k} kind takes with default flags (the 3 largest used)": 1
                    for k in ("v3", "refalign", "kaleido")}
    assert (c["clips with 1 kept mask(s)"], c["clips with 2 kept mask(s)"], c["clips with 4 kept mask(s)"]) == (2, 1, 1)
    report = (out / "report.txt").read_text()
    assert f"{fx['keys'][3]}: " in report and "background png not found" in report
    lines = {x["key"]: x for x in map(json.loads, (out / "index.jsonl").read_text().splitlines())}
    k0, k1, k2, k3 = (lines[k] for k in fx["keys"])

    def classes(refs):
        return [r.get("class_name", "background png") for r in refs]

    # largest crop first: the dog's is 0.42 of the frame, the woman's ellipse ~0.28, the backpack ~0.13, the hat ~0.1
    assert classes(k2["references"]) == ["dog", "woman", "backpack", "hat"]
    # kinds without roles: phantom / v3 take 4, magref 8, incontext its configured maximum (here 2)
    assert classes(pr.clip_references(k2, 4, background=False)) == ["dog", "woman", "backpack", "hat"]
    assert classes(pr.clip_references(k2, 4, background=True)) == ["dog", "woman", "backpack", "background png"]
    assert classes(pr.clip_references(k2, 8, background=True)) == ["dog", "woman", "backpack", "hat",
                                                                     "background png"]
    assert classes(pr.clip_references(k2, 2, background=False)) == ["dog", "woman"]
    assert classes(pr.clip_references(k0, 4, background=True)) == ["woman", "background png"]
    assert classes(pr.clip_references(k0, 1, background=True)) == ["woman"]  # the background never takes the slot
    assert classes(pr.clip_references(k3, 4, background=True)) == ["woman"]  # none to add
    # A2's prefix: its roles, the largest of each, absent ones absent
    roles = {k: {n: r.get("class_name", "png") for n, r in pr.clip_roles(x).items()} for k, x in lines.items()}
    assert [roles[k] for k in fx["keys"]] == [
        dict(subject="woman", background="png"), dict(subject="woman", object="backpack", background="png"),
        dict(subject="woman", object="dog", background="png"), dict(subject="woman")]
    # a run's elements: A2's roles, or positional references (ref0, ref1, ...) filled largest first
    released = [f"ref{i}" for i in range(4)]
    assert {n: r["class_name"] for n, r in pr.clip_elements(k2, released).items()} == dict(
        ref0="dog", ref1="woman", ref2="backpack", ref3="hat")
    assert sorted(pr.clip_elements(k0, [*released[:3], "background"])) == ["background", "ref0"]
    samples = pr.list_index(out / "index.jsonl", public_cfg(out / "index.jsonl"), 0, [])
    assert [sorted(s.refs) for s in samples] == [["background", "subject"], ["background", "object", "subject"],
                                                 ["background", "object", "subject"], ["subject"]]


# the README's kinds on an OpenS2V-5M index, default flags: model, frames (what the clips' 16 frames fill), other flags
OPENS2V_KINDS = {
    "prefix": ("tiny", 21, ()),  # A2: its subject / object / background roles
    "v3": ("tiny-v3", 9, ()),
    "magref": ("tiny-magref", 9, ()),
    "incontext": ("tiny-t2v", 9, ("--reference-layout", "incontext")),
    "phantom": ("tiny-phantom", 9, ()),
    "vace": ("tiny-vace", 9, ()),
    "kaleido": ("tiny-kaleido", 9, ()),
}


def validate_index(index, model, frames, flags):
    """`data.py validate` of an OpenS2V index, with these flags."""
    return validate(tyro.cli(Validate, args=["--dataset-type", "opens2v", "--manifest", str(index), "--resolution",
                                             *map(str, SIZE), "--num-frames", str(frames), "--model", model, *flags]))
# each clip's element set (bucket names) per kind. The clips have 1, 2, 4 and 1 kept masks, the last no background
# png. The kinds without roles take every kept mask, largest first, up to their maximum; v3 / magref / incontext the
# background png in the last slot (v3's 4: three masks and the background), Phantom none
_R = tuple(f"ref{i}" for i in range(4))
OPENS2V_SETS = {
    "prefix": [("subject", "background"), ("subject", "object", "background"), ("subject", "object", "background"),
               ("subject",)],
    "phantom": [_R[:1], _R[:2], _R, _R[:1]],
    "v3": [(*_R[:1], "background"), (*_R[:2], "background"), (*_R[:3], "background"), _R[:1]],
    "magref": [(*_R[:1], "background"), (*_R[:2], "background"), (*_R, "background"), _R[:1]],
}
OPENS2V_SETS["incontext"] = OPENS2V_SETS["magref"]
OPENS2V_SETS["vace"] = OPENS2V_SETS["phantom"]  # up to 4 references, no background (as VideoX-Fun's subjects)
OPENS2V_SETS["kaleido"] = [_R[:1], _R[:2], _R[:3], _R[:1]]  # up to 3 references (SFTDataset's ref1..3), no background


@pytest.mark.parametrize("kind", [k for k, d in KIND_DEFS.items() if d.references[1] and not d.roles])
def test_a_clip_of_the_kinds_maximum_of_masks_fills_every_slot_with_or_without_a_background_png(kind):
    """A clip of as many kept masks as the kind takes (and one of more): without a background png every slot is a
    mask (V3: 4 of 4); with one, where the kind uses it, one mask fewer and the png last; never more than the kind
    takes, and the run plans that largest set. Slots set by hand (`--elements ref0 ref1 background`) keep theirs:
    a mask each, the png in the background slot."""
    d = KIND_DEFS[kind]
    most = d.references[1]
    names = [e.name for e in index_elements(kind)]
    assert [e.name for e in largest_element_set(kind, index_elements(kind))] == [f"ref{i}" for i in range(most)]

    def classes(refs):
        return {n: r.get("class_name", "png") for n, r in refs.items()}

    for masks in (most, most + 1):
        refs = [dict(role="subject" if i == 0 else "object", class_name=f"c{i}") for i in range(masks)]  # largest 1st
        bare, png = dict(references=refs, elements={}), dict(references=refs, elements=dict(background=dict(image="b")))
        assert classes(pr.clip_elements(bare, names, most)) == {f"ref{i}": f"c{i}" for i in range(most)}, masks
        if d.background:
            assert classes(pr.clip_elements(png, names, most)) == {
                **{f"ref{i}": f"c{i}" for i in range(most - 1)}, "background": "png"}, masks
        else:
            assert pr.clip_elements(png, names, most) == pr.clip_elements(bare, names, most)
        by_hand = ["ref0", "ref1", "background"]
        assert classes(pr.clip_elements(png, by_hand, most)) == dict(ref0="c0", ref1="c1", background="png")
        assert classes(pr.clip_elements(bare, by_hand, most)) == dict(ref0="c0", ref1="c1")


def test_a_clip_without_its_background_png_trains_every_mask_v3_takes(tmp_path, capsys):
    """Through the index as validate and training read it: the clip of 4 masks with its background png, and the
    same clip without the png. V3 takes 3 masks and the png, and all 4 masks (not 3 with the last slot empty);
    MAGREF and in-context (up to 8) all 4 masks either way, the png added where there is one; Phantom uses no png."""
    from tests.conftest import train

    root, out = tmp_path / "OpenS2V-5M", tmp_path / "os2v-index"
    fx = varied_opens2v(root)
    pi.run(pi.IndexOpenS2V(str(root), str(out)))
    index = out / "index.jsonl"
    four = next(x for x in map(json.loads, index.read_text().splitlines()) if x["key"] == fx["keys"][2])
    assert len(four["references"]) == 4 and "background" in four["elements"]
    bare = dict(four, key="no-png", elements={k: v for k, v in four["elements"].items() if k != "background"})
    index.write_text(json.dumps(four) + "\n" + json.dumps(bare) + "\n")
    want = {"v3": [(*_R[:3], "background"), _R], "magref": [(*_R, "background"), _R],
            "incontext": [(*_R, "background"), _R], "phantom": [_R, _R]}
    for kind, sets in want.items():
        ds = validate_index(index, *OPENS2V_KINDS[kind])
        assert [b[3] for b in ds.buckets] == sets and not ds.left_out, kind
    capsys.readouterr()
    r = train("--model", "tiny-v3", "--dataset-type", "opens2v", "--manifest", str(index), "--resolution",
              *map(str, SIZE), "--output-dir", str(tmp_path / "runs"), "--run-name", "v3", "--max-steps", "2",
              "--num-frames", "9", "--log-every", "1", "--device", "cpu")
    assert len(r["losses"]) == 2 and all(np.isfinite(r["losses"]))  # one epoch: both clips
    log = capsys.readouterr().out
    assert "[ref0, ref1, ref2, ref3]: 1 samples" in log and "[ref0, ref1, ref2, background]: 1 samples" in log, log


def test_readme_opens2v_commands_train_every_kind_for_an_epoch(tmp_path, capsys, dino_dir):
    """docs/public-datasets.md's commands (index -> validate -> train, default flags) on an OpenS2V-5M tree whose
    clips have 1, 2 and 4 kept masks, one without its background png: every kind trains one full epoch of every
    clip (none left out), clips of 1, 2 and 3+ references each, the kinds without roles every kept mask up to their
    maximum; the index report names the clip without a background. A line no kind can take (no mask, no background:
    an index edited by hand) is named and left out before step 1 by validate and training alike."""
    from tests.conftest import train

    root, out = tmp_path / "OpenS2V-5M", tmp_path / "os2v-index"
    fx = varied_opens2v(root)
    pi.run(pi.IndexOpenS2V(str(root), str(out)))
    index = out / "index.jsonl"
    assert f"{fx['keys'][3]}: " in (out / "report.txt").read_text()
    empty = dict(json.loads(index.read_text().splitlines()[0]), key="no-mask", references=[], elements={})
    index.write_text(index.read_text() + json.dumps(empty) + "\n")
    for kind, (model, frames, flags) in OPENS2V_KINDS.items():
        ds = validate_index(index, model, frames, flags)
        assert len(ds) == 4 and [p.id for p in ds.left_out] == ["no-mask"], kind
        assert "left out: no-mask: " in capsys.readouterr().out, kind
        assert [b[3] for b in ds.buckets] == OPENS2V_SETS[kind], kind
        assert {min(len(b[3]), 3) for b in ds.buckets} == {1, 2, 3}, kind  # 1, 2 and 3+ references
        r = train("--model", model, "--dataset-type", "opens2v", "--manifest", str(index), "--resolution",
                  *map(str, SIZE), "--output-dir", str(tmp_path / "runs"), "--run-name", kind, "--max-steps", "4",
                  "--num-frames", str(frames), "--log-every", "1", "--device", "cpu", *flags)
        assert len(r["losses"]) == 4 and all(np.isfinite(r["losses"])), kind  # one epoch: 4 clips, none skipped
        assert "left out: no-mask: " in capsys.readouterr().out, kind
    # RefAlign with its alignment loss, LoRA and full fine-tuning, on the same index: its three largest masks
    for extra in ((), ("--training-type", "full")):
        r = train("--model", "tiny-refalign", "--dataset-type", "opens2v", "--manifest", str(index), "--resolution",
                  *map(str, SIZE), "--output-dir", str(tmp_path / "runs"), "--run-name", f"refalign{len(extra)}",
                  "--max-steps", "4", "--num-frames", "9", "--log-every", "1", "--device", "cpu", "--align-loss",
                  "--align-model", str(dino_dir), "--align-blocks", "0", "1", *extra)
        assert len(r["losses"]) == 4 and all(np.isfinite(r["losses"])), extra
        assert "left out: no-mask: " in capsys.readouterr().out, extra
