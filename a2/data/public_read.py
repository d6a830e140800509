"""The public subject-to-video datasets' indexes as training reads them (OpenS2V-5M, Phantom-Data, HuMoSet): the
clips of an index (list_index), checked (check_public_sample), and their element images built on the fly from the
published annotations (load_sample), exactly as `export-elements` writes them. The index itself is written once,
offline, by a2/data/public_index.py.

Element images (what each published loader builds):
- OpenS2V-5M: the annotation frame (ann_frame_idx) of the clip, cropped to metadata.crop; the mask (COCO RLE in
  cropped-frame coordinates, pycocotools) cut to its tight box and its pixels pasted on white (OpenS2V-Nexus's demo
  dataloader and BindWeave's get_sora_feature.py). Masks are assigned by word_tags: subject / pre_define classes ->
  subject, object classes -> object; the LaMa-inpainted Background png -> background.
- Phantom-Data: the box (bbox_loc, pixels of the frame resized to long side 768) of the reference clip's frame
  int(num_frames * frame_idx), scaled to the frame and clipped to it; optionally segmented inside the box by a local
  SAM (transformers' SamModel) and pasted on white.
- HuMoSet: the reference photo (optionally segmented by SAM with the whole photo as the box).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from a2.cli import InputError
from a2.config.dataset_config import DatasetConfig
from a2.data.media import (
    Problem,
    Sample,
    caption_problems,
    clip_length,
    decodable_frames,
    frame_buckets,
    manifest_samples,
    probe_video,
    read_frames,
)
from a2.images import read_image
from a2.kinds.kinds import KIND_DEFS

PHANTOM_CANVAS = 768  # Phantom-Data's boxes are in pixels of the frame resized to this long side


# ---------------------------------------------------------------- element images


def rle_of(mask: dict) -> dict:
    """A published RLE ({size, counts: str}) as pycocotools takes it."""
    counts = mask["counts"]
    return {"size": [int(v) for v in mask["size"]], "counts": counts.encode() if isinstance(counts, str) else counts}


def mask_on_white(frame: np.ndarray, mask: dict) -> Image.Image:
    """The published element rule: decode the RLE on the (cropped) annotation frame, cut the mask's tight box, paste
    the masked pixels on white. frame (H, W, 3) uint8."""
    from pycocotools import mask as mask_util

    m = mask_util.decode(rle_of(mask))  # (H, W) uint8 0/1
    if m.shape != frame.shape[:2]:
        raise ValueError(f"the mask is {m.shape[0]}x{m.shape[1]}, the cropped frame {frame.shape[0]}x{frame.shape[1]}")
    rows, cols = np.nonzero(m.any(1))[0], np.nonzero(m.any(0))[0]
    if not len(rows):
        raise ValueError("the mask is empty")
    box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
    return on_white(frame[box], m[box].astype(bool))


def on_white(pixels: np.ndarray, keep: np.ndarray) -> Image.Image:
    """An element cut out on white: pixels (h, w, 3) uint8 where keep (h, w) is True, white elsewhere."""
    out = np.full_like(pixels, 255)
    out[keep] = pixels[keep]
    return Image.fromarray(out)


def canvas_box(box, size: tuple[int, int], canvas: int = PHANTOM_CANVAS) -> tuple[int, int, int, int]:
    """A box in pixels of the frame resized to long side `canvas` -> integer (x0, y0, x1, y1) in the frame (H, W),
    clipped to it (published boxes overflow the canvas)."""
    h, w = size
    s = max(h, w) / canvas
    x0, y0, x1, y1 = (float(v) * s for v in box)
    x0, x1 = int(np.clip(np.floor(x0), 0, w)), int(np.clip(np.ceil(x1), 0, w))
    y0, y1 = int(np.clip(np.floor(y0), 0, h)), int(np.clip(np.ceil(y1), 0, h))
    if x1 <= x0 or y1 <= y0:
        raise ValueError(f"box {list(box)} lies outside the {w}x{h} frame (scaled from the {canvas} canvas)")
    return x0, y0, x1, y1


@lru_cache(maxsize=2)
def load_sam(path: str):
    """(SamModel, SamProcessor) from a local dir, once per process (loader workers each load their own)."""
    from transformers import SamModel, SamProcessor

    if not Path(path, "config.json").is_file():
        raise InputError(f"--sam {path}: not a transformers SAM dir (no config.json)")
    # frozen, and run under no_grad (sam_on_white): never switch autograd off process-wide, which with
    # --num-workers 0 is the training process
    return SamModel.from_pretrained(path).eval().requires_grad_(False), SamProcessor.from_pretrained(path)


def sam_on_white(image: np.ndarray, box: tuple[int, int, int, int], sam_dir: str) -> Image.Image:
    """SAM's mask for `box` (x0, y0, x1, y1) on image (H, W, 3) uint8, the box cut and the masked pixels on white."""
    import torch

    model, processor = load_sam(sam_dir)
    inputs = processor(images=Image.fromarray(image), input_boxes=[[list(map(float, box))]], return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs, multimask_output=False)
    mask = processor.image_processor.post_process_masks(out.pred_masks, inputs["original_sizes"],
                                                        inputs["reshaped_input_sizes"])[0][0, 0].numpy()  # (H, W)
    x0, y0, x1, y1 = box
    return on_white(image[y0:y1, x0:x1], mask[y0:y1, x0:x1])


def box_image(frame: np.ndarray, box: tuple[int, int, int, int], sam_dir: str | None) -> Image.Image:
    x0, y0, x1, y1 = box
    return sam_on_white(frame, box, sam_dir) if sam_dir else Image.fromarray(np.ascontiguousarray(frame[y0:y1, x0:x1]))


def cropped(frames: np.ndarray, crop) -> np.ndarray:
    """frames[..., s_y:e_y, s_x:e_x, :] of a frame (H, W, 3) or clip (F, H, W, 3) for OpenS2V's crop [s_x, e_x, s_y,
    e_y] (the watermark-free region)."""
    if crop is None:
        return frames
    sx, ex, sy, ey = crop
    if ey > frames.shape[-3] or ex > frames.shape[-2]:
        raise ValueError(f"crop {list(crop)} exceeds the {frames.shape[-2]}x{frames.shape[-3]} frame")
    return frames[..., sy:ey, sx:ex, :]


def reference_frame(video: Path, pos: float) -> np.ndarray:
    """Phantom-Data's reference frame: int(num_frames * frame_idx) of the clip, as its README computes it."""
    listed, _ = probe_video(video)
    n = listed or decodable_frames(video)
    return read_frames(video, [min(int(n * float(pos)), n - 1)])[0]


def element_image(ref: dict, sam_dir: str | None = None, frames: dict | None = None) -> Image.Image:
    """One element image from its index entry; `frames` {(video, index): frame} holds frames already decoded."""
    if "image" in ref:
        image = read_image(ref["image"])
        if sam_dir and ref.get("segment", True):
            image = sam_on_white(np.asarray(image), (0, 0, image.width, image.height), sam_dir)
    elif "mask" in ref:
        frame = (frames or {}).get((ref["video"], ref["frame"]))
        if frame is None:
            frame = read_frames(Path(ref["video"]), [ref["frame"]])[0]
        image = mask_on_white(cropped(frame, ref.get("crop")), ref["mask"])
    elif "box" in ref:
        frame = reference_frame(Path(ref["video"]), ref["frame_pos"])
        image = box_image(frame, canvas_box(ref["box"], frame.shape[:2], ref.get("canvas", PHANTOM_CANVAS)), sam_dir)
    else:
        raise ValueError(f"unknown element entry {sorted(ref)}")
    if min(image.size) < 1:
        raise ValueError("the element image is empty")
    return image


def element_size(ref: dict, frame_size: tuple[int, int] | None) -> tuple[int, int] | None:
    """The (width, height) element_image makes of an index entry, without making it: a mask's tight box (from the RLE,
    no decoding), an image file's size, a box's extent in the frame of (H, W) `frame_size` (None: unknown). None
    where it cannot tell (the load then says why)."""
    from pycocotools import mask as mask_util

    try:
        if "mask" in ref:
            w, h = (int(v) for v in mask_util.toBbox(rle_of(ref["mask"]))[2:])
        elif "image" in ref:
            w, h = read_image(ref["image"]).size
        elif "box" in ref and frame_size is not None:
            x0, y0, x1, y1 = canvas_box(ref["box"], frame_size, ref.get("canvas", PHANTOM_CANVAS))
            w, h = x1 - x0, y1 - y0
        else:
            return None
    except (ValueError, KeyError):
        return None
    return (w, h) if w > 0 and h > 0 else None


def ref_file(ref: dict) -> Path:
    """The file an element entry reads (for messages and the cache key)."""
    return Path(ref.get("image") or ref["video"])


def load_sample(s: Sample, indices: list[int], names, sam_dir: str | None = None):
    """(frames (len, H, W, 3) uint8 of the clip: face_cut offset and crop applied, {element: PIL image}). The clip's
    frames and its annotation frames come from one decoding pass."""
    want = [s.start + i for i in indices]
    same = [r["frame"] for n in names if "mask" in (r := s.refs[n]) and r["video"] == str(s.video)]
    got = read_frames(s.video, want + same) if want + same else np.zeros((0, 1, 1, 3), np.uint8)
    frames = {(str(s.video), i): f for i, f in zip(same, got[len(want):])}
    clip = cropped(got[:len(want)], s.crop) if want else got[:0]  # (F, h, w, 3) view
    return clip, {n: element_image(s.refs[n], sam_dir, frames) for n in names}


# ---------------------------------------------------------------- reading the index (training, validate, export)


def list_index(path: Path, cfg: DatasetConfig, di: int, problems: list[Problem], most: int = 0) -> list[Sample]:
    """The samples of an index.jsonl written by `data.py index`; `most`: the run's kind's maximum of references a
    clip (clip_elements)."""
    def sample(r: dict, n: int, where: str) -> Sample | None:
        if not r.get("key") or not r.get("video"):
            return None
        if r.get("dataset") != cfg.dataset_type:
            raise InputError(f"{path} line {n}: an index of {r.get('dataset')!r} clips, read as --dataset-type "
                             f"{cfg.dataset_type}")
        s = Sample(str(r["key"]), di, Path(r["video"]), "", where=where, start=int(r.get("start") or 0),
                   crop=tuple(r["crop"]) if r.get("crop") else None, num_frames=int(r.get("num_frames") or 0))
        s.prompt, s.problems = caption_problems(s.id, str(r.get("caption") or ""), path, where, cfg)
        s.refs = clip_elements(r, [e.name for e in cfg.elements], most)
        s.elements = {k: ref_file(v) for k, v in s.refs.items()}
        s.cluster = r.get("cluster")
        return s
    out = manifest_samples(path, problems, sample, "not an index line (no 'key'/'video'): rebuild it with "
                                                   "`data.py index`")
    if cfg.cross_video:
        cross_video(out)
    return out


ROLES = ("subject", "object", "background")  # A2's elements: a reference of the index plays one of these


def clip_roles(line: dict) -> dict[str, dict]:
    """A2's prefix: the clip's subject (its largest kept subject mask), object (largest kept object mask) and
    background png, each where the clip has it; absent ones absent."""
    out = dict(line.get("elements") or {})
    for ref in line.get("references") or []:  # largest first
        out.setdefault(ref["role"], ref)
    return {k: out[k] for k in sorted(out, key=lambda k: ROLES.index(k) if k in ROLES else len(ROLES))}


def clip_references(line: dict, most: int, background: bool) -> list[dict]:
    """The references of a clip for a kind without roles (Phantom, SkyReels-V3, MAGREF, in-context), as the released
    models were trained on the public data: every kept subject/object mask, largest first, and where the kind uses
    one the clip's background png (when it has one) in the last slot, `most` references in all (the kind's
    maximum; a background never takes the only slot). Phantom-Data's references are in its phrase order, the person
    first; index lines without `references` (HuMoSet, indexes built before) give their elements in role order."""
    masks = line.get("references")
    if masks is None:
        masks = [dict(v, role=k) for k, v in (line.get("elements") or {}).items() if k != "background"]
    bg = (line.get("elements") or {}).get("background") if background and most > 1 else None
    return masks[:most - (bg is not None)] + ([dict(bg, role="background")] if bg else [])


def clip_elements(line: dict, names: list[str], most: int = 0) -> dict[str, dict]:
    """{element name: index entry} of a clip for the run's elements `names` (position order): A2's roles when every
    name is one (subject / object / background), else the references of clip_references in position order (the
    released models' ref0, ref1, ...; a `background` name takes the background png, in the last slot, when the clip
    has one), at most `most` in all (the kind's maximum; 0: one per name). index_elements names every slot and the
    background: a clip with the png fills one slot fewer with masks, one without fills them all."""
    if set(names) <= set(ROLES):
        return {k: v for k, v in clip_roles(line).items() if k in names}
    slots = [n for n in names if n != "background"]
    refs = clip_references(line, min(len(names), most or len(names)), "background" in names)
    masks = [r for r in refs if r["role"] != "background"]
    out = dict(zip(slots, masks))
    if refs and refs[-1]["role"] == "background":
        out["background"] = refs[-1]
    return out


def more_than_kinds_take(masks: int, background: bool) -> list[str]:
    """The report's lines a clip of `masks` kept masks (and a background png or not) counts in: one per kind without
    roles whose maximum it exceeds (with default flags that kind takes the largest, the rest are no reference of
    its). A clip with no subject mask is dropped by the index itself (counted)."""
    out = []
    for k, d in KIND_DEFS.items():
        most = d.references[1] - (d.background and background)  # the background png takes the last slot
        if d.references[1] and not d.roles and masks > most:
            out.append(f"clips with more kept masks than the {k} kind takes with default flags (the {most} largest "
                       "used)")
    return out


def cross_video(samples: list[Sample]) -> int:
    """OpenS2V's cross-video pairs: a clip of a cluster takes its subject and object (a kind without roles: each
    reference slot both clips fill) from the next clip of the same cluster (its key order, cyclic), so the reference
    is not a frame of the target video; its background stays its own. Returns clips changed."""
    clusters: dict[str, list[Sample]] = {}
    for s in samples:
        if s.cluster:
            clusters.setdefault(s.cluster, []).append(s)
    own = {id(s): dict(s.refs) for s in samples}
    changed = 0
    for members in clusters.values():
        members.sort(key=lambda s: s.id)
        for i, s in enumerate(members):
            if len(members) < 2:
                break
            other = own[id(members[(i + 1) % len(members)])]
            for name in other:  # A2's subject and object, or the references ref0, ref1, ... both clips have
                if name != "background" and name in s.refs:
                    s.refs[name] = other[name]
                    s.elements[name] = ref_file(other[name])
            changed += 1
    print(f"cross-video pairs: {changed} clip(s) of {len(clusters)} cluster(s) take subject/object from a paired "
          "clip")
    return changed


def check_public_sample(s: Sample, cfg: DatasetConfig, num_frames: int, sampling: str,
                        short_why: str = "") -> Sample:
    """What an index sample needs before training: its files exist, and its frame range fills a bucket (short_why:
    why the clips must be that long, as data.check_sample says it). Frames are
    counted from the index when it has them (OpenS2V's face_cut), else from the container; a file that fails to
    decode later is a load failure (a2/data/loader.py LoadFailures), not a crash."""
    for name, ref in s.refs.items():
        f = ref_file(ref)
        if not f.exists():
            s.problems.append(Problem(s.id, f, f"element '{name}': {missing(f)}", s.where))
    for e in cfg.elements:
        if e.required and e.name not in s.refs:
            s.problems.append(Problem(s.id, s.video, f"required element '{e.name}' missing", s.where))
    if not s.video.exists():
        s.problems.append(Problem(s.id, s.video, missing(s.video), s.where))
        return s
    try:
        listed, size = probe_video(s.video)
        size = cropped(np.broadcast_to(np.uint8(0), (*size, 3)), s.crop).shape[:2]  # checked as the load checks it
        own = max(0, listed - s.start) if listed else 0  # what the file holds from the clip's start
        claimed = s.num_frames if s.num_frames and own and own < s.num_frames else 0  # the index's range runs past
        # the file's end (another file under the same name, a cut video): the clip is what the file holds
        s.num_frames = (own if claimed else s.num_frames) or own or max(0, decodable_frames(s.video) - s.start)
        s.size = tuple(int(v) for v in size)
        frame = s.size if s.crop is None else None  # a box is in the whole frame of the clip's own video
        sizes = {name: element_size(ref, frame if ref.get("video") == str(s.video) else None)
                 for name, ref in s.refs.items()}
        s.sizes = {name: wh for name, wh in sizes.items() if wh is not None}
    except Exception as ex:  # PyAV raises many types for damaged files
        s.problems.append(Problem(s.id, s.video, f"unreadable video ({type(ex).__name__}: {ex})", s.where))
        return s
    if not clip_length(cfg, num_frames, s.num_frames):
        index = f"; its index lists {claimed}, past the video's end" if claimed else ""
        s.problems.append(Problem(s.id, s.video, f"{s.num_frames} frames (from frame {s.start}{index}), shorter than "
                                                 f"the smallest bucket ({min(frame_buckets(cfg, num_frames))})"
                                                 f"{short_why}", s.where))
    return s


def missing(p: Path) -> str:
    return f"dangling symlink (to {os.readlink(p)})" if p.is_symlink() else "file not found"


def index_rule(index: Path) -> str | None:
    """The rule line of the report next to an index (printed by training: what the index kept)."""
    report = index.parent / "report.txt"
    if report.is_file():
        for line in report.read_text().splitlines():
            if line.startswith("rule: "):
                return line[6:]
    return None
