"""A synthetic OpenS2V-5M part in the published schema, built from a real clip and picture (tests and bench.py):
what a test needs to rebuild the elements by hand (bench.py indexes it too)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image


def rle_encode(mask: np.ndarray) -> dict:
    """A bool (H, W) mask as OpenS2V publishes it: COCO compressed RLE, counts as a str."""
    from pycocotools import mask as mask_util

    r = mask_util.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": [int(v) for v in r["size"]], "counts": r["counts"].decode()}


def synthetic_opens2v(root, frames: np.ndarray, person: np.ndarray, num_clips: int = 1, part: str = "total_part1",
                      fps: int = 8) -> dict:
    """An OpenS2V-5M layout under root (Videos/<part>/clip.mp4, Background/<part>/*.png, Jsons/mask_and_bbox_High-
    Quality/<part>.json) in the published schema: `person` (h, w, 3) is composited into `frames` (F, H, W, 3) under a
    known ellipse mask; the clip is cropped by a watermark margin and cut to frames 2..F-2. Returns what a test needs
    to rebuild the elements by hand: video, crop, face_cut, ann_frame_idx, {mask key: bool mask in cropped
    coordinates}, and the records."""
    import imageio.v3 as iio

    root = Path(root)
    n, H, W = frames.shape[:3]
    crop = [8, W - 8, 4, H - 4]  # [s_x, e_x, s_y, e_y]
    h, w = crop[3] - crop[2], crop[1] - crop[0]
    yy, xx = np.mgrid[0:h, 0:w]
    masks = {  # in cropped-frame coordinates
        "1": ((yy - h * 0.55) / (h * 0.4)) ** 2 + ((xx - w * 0.35) / (w * 0.22)) ** 2 < 1,  # the person: subject
        "2": (abs(yy - h * 0.2) < 2) & (abs(xx - w * 0.8) < 2),  # a tiny "person": crop_ratio < 0.1
        "3": (yy > h * 0.6) & (xx > w * 0.6) & (xx < w * 0.9),  # "man" with low scores
        "4": (yy > h * 0.1) & (yy < h * 0.5) & (xx > w * 0.62) & (xx < w * 0.95),  # "backpack": object
        "5": yy > h * 0.9,  # "grass": a background class, no element
    }
    video = root / "Videos" / part / "clip.mp4"
    video.parent.mkdir(parents=True, exist_ok=True)
    out = frames.copy()
    person = np.asarray(Image.fromarray(person).resize((w, h)))
    sub = out[:, crop[2]:crop[3], crop[0]:crop[1]]
    sub[:, masks["1"]] = person[masks["1"]]
    iio.imwrite(video, out, fps=fps, codec="libx264", plugin="pyav")
    face_cut, ann = [2, n - 2], 2
    classes = {"1": "woman", "2": "person", "3": "man", "4": "backpack", "5": "grass"}
    scores = {"1": (5.0, 0.3), "2": (6.0, 0.7), "3": (3.0, 0.3), "4": (4.0, 0.7), "5": (5.0, 0.5)}  # (aes, gme)
    bg_dir = root / "Background" / part
    bg_dir.mkdir(parents=True, exist_ok=True)
    records = {}
    for i in range(num_clips):
        key = f"clip{i:06d}_part1_step1-0-{n}_step2-0-{n}_step4_step5_step6"
        records[key] = {
            "metadata": {"cut": [0, n], "crop": crop, "fps": float(fps), "num_frames": n, "path": video.name,
                         "resolution": {"height": H, "width": W}, "aesthetic": 5.0, "face_cut": face_cut,
                         "face_cap_qwen": f"A woman with a backpack walks on a mountain top, clip {i}."},
            "word_tags": {"background": ["grass"], "subject": ["woman", "man"], "object": ["backpack"],
                          "pre_define": ["person", "human head"]},
            "annotation": {
                "ann_frame_data": {"ann_frame_idx": ann, "box_format": "xyxy", "img_width": w, "img_height": h,
                                   "foreground_ase_score": 5.0, "background_ase_score": 4.6,
                                   "annotations": [{"class_name": classes[k], "bbox": [0, 0, 1, 1],
                                                    "aes_score": scores[k][0], "gme_score": scores[k][1]}
                                                   for k in masks]},
                "mask_map": {k: {"class_name": c} for k, c in classes.items()},
                "mask_annotation": {str(ann): {k: {**rle_encode(m), "score": [0.99]} for k, m in masks.items()}}}}
        # the two published names of the background png: the demo dataloader's and BindWeave's
        name = f"{key}.png" if i % 2 == 0 else f"{key.split('_step6')[0]}_step7.png"
        Image.fromarray(np.ascontiguousarray(frames[ann, crop[2]:crop[3], crop[0]:crop[1]])).save(bg_dir / name)
    jsons = root / "Jsons" / "mask_and_bbox_High-Quality"
    jsons.mkdir(parents=True, exist_ok=True)
    write_part(jsons / f"{part}.json", records.items())
    return dict(video=video, crop=crop, face_cut=face_cut, ann=ann, masks=masks, records=records,
                json=jsons / f"{part}.json")


def write_part(path: Path, records) -> None:
    """A part JSON ({key: record}) written record by record (a multi-GB one never sits in memory)."""
    with open(path, "w") as f:
        f.write("{")
        for i, (key, rec) in enumerate(records):
            f.write(("," if i else "") + json.dumps(key) + ": " + json.dumps(rec, indent=1))
        f.write("}")
