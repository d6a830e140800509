"""The public subject-to-video datasets as published: OpenS2V-5M, Phantom-Data, HuMoSet; and Kaleido's training
layout (a manifest of its clips and their references, read without --dataset-type).

A one-time streaming index turns a downloaded dataset into OUT/index.jsonl (one clip per line: video, caption,
frame range, crop, and for each a2 element where its image comes from) plus OUT/report.txt (what was kept, what each
filter dropped, every bad record and missing file, one line each). Training and `data.py validate` read the index
with `--dataset-type opens2v|phantom|humoset --manifest OUT/index.jsonl`; the element images are built on the fly
from the published annotations, exactly as `export-elements` writes them.

    python data.py index opens2v ROOT OUT [--cross-pairs ROOT/Jsons/cross_video_pairs/cluster_videos.json]
    python data.py index phantom ROOT OUT --videos DIR      # ROOT holds koala36M_multi_ref_merged_filtered.parquet
    python data.py index humoset ROOT OUT                   # ROOT holds video/, reference_image/, video_caption.parquet
    python data.py index kaleido ROOT OUT                   # ROOT holds videos/, labels/, references/
    python data.py export-elements --manifest OUT/index.jsonl --out DIR [--sam DIR]

The element images are those of a2/data/public_read.py (load_sample). synthetic_opens2v writes a synthetic OpenS2V-5M
part in the published schema from a real clip and picture: bench.py --opens2v times the index on it, the tests rebuild
its elements by hand.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
from PIL import Image

from a2.cli import InputError, MissingInput, run_cli
from a2.config.dataset_config import PUBLIC_TYPES, DatasetConfig
from a2.config.sections import ExportElements, IndexHumoSet, IndexKaleido, IndexOpenS2V, IndexPhantom
from a2.data.media import VIDEO_EXTS, Problem, read_frames
from a2.data.public_read import (
    PHANTOM_CANVAS,
    list_index,
    load_sample,
    missing,
    more_than_kinds_take,
    rle_of,
)
from a2.elements import A2_ELEMENTS
from a2.images import IMAGE_EXTS

PHANTOM_PARQUET = "koala36M_multi_ref_merged_filtered.parquet"
# Phantom-Data names no element: a phrase of these words (or a box of these classes) is the person, A2's subject
PERSON_WORDS = {"person", "people", "man", "men", "woman", "women", "boy", "boys", "girl", "girls", "child",
                "children", "kid", "kids", "baby", "human", "lady", "guy", "player", "individual", "face", "head"}


class IndexError_(InputError):
    """A dataset that cannot be indexed at all (no part files, a parquet of another schema): one line, exit 2."""


class BadRecord(ValueError):
    """One record that cannot be used: reported as one line (clip key, file, problem) and skipped."""


# ---------------------------------------------------------------- the index: parts, resume, report


class Lines:
    """Problem lines of a part, written to a file as they come (a part may hold millions)."""

    def __init__(self, f, counts: Counter):
        self.f, self.counts = f, counts

    def add(self, count: str, key: str, file, what: str):
        """Count `count` and write its problem line (clip key, file, problem)."""
        self.counts[count] += 1
        self.f.write(str(Problem(key, file, what)).replace("\n", " ") + "\n")


def write_index(out: Path, dataset: str, parts: list[tuple[str, object]], rule: str) -> Counter:
    """Run each part's records(counts, lines) -> iterator of index lines into out/parts/<name>.jsonl (a part done
    before is kept: a killed index resumes at its first unfinished part), then join them into out/index.jsonl and
    write out/report.txt: the rule, the counts, every problem line. Constant memory."""
    print(f"rule: {rule}")
    d = out / "parts"
    d.mkdir(parents=True, exist_ok=True)
    for name, records in parts:
        if (d / f"{name}.counts.json").exists():
            print(f"{name}: indexed before, kept (delete {d / name}.* to redo it)")
            continue
        counts = Counter()
        with open(d / f"{name}.jsonl.tmp", "w") as f, open(d / f"{name}.problems.txt", "w") as p:
            for line in records(counts, Lines(p, counts)):
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(d / f"{name}.jsonl.tmp", d / f"{name}.jsonl")
        (d / f"{name}.counts.tmp").write_text(json.dumps(counts))
        os.replace(d / f"{name}.counts.tmp", d / f"{name}.counts.json")  # last: it marks the part done
    total = Counter()
    for name, _ in parts:
        total.update(json.loads((d / f"{name}.counts.json").read_text()))
    with open(out / "index.jsonl.tmp", "w") as f, open(out / "report.tmp", "w") as r:
        head = [f"{dataset} index: {out / 'index.jsonl'}", f"rule: {rule}", *(f"{k}: {v}" for k, v in
                                                                             sorted(total.items()))]
        r.write("\n".join(head) + "\nproblems (one line each: clip key: file: problem):\n")
        n = 0
        for name, _ in parts:
            with open(d / f"{name}.jsonl") as p:
                for line in p:
                    f.write(line)
            with open(d / f"{name}.problems.txt") as p:
                for line in p:
                    r.write(line)
                    n += 1
    os.replace(out / "index.jsonl.tmp", out / "index.jsonl")
    os.replace(out / "report.tmp", out / "report.txt")
    print("\n".join(head) + f"\n{n} problem line(s): {out / 'report.txt'}")
    return total


def records_of(rows, build, src: Path):
    """A part's records(counts, lines) for write_index: each (clip key, record) of rows(counts, lines) is counted
    read and made an index line by build(key, record, counts, lines) (None: dropped, counted by build); a BadRecord
    is counted and reported as one line (clip key, file, problem)."""
    def records(counts: Counter, lines: Lines):
        for key, row in rows(counts, lines):
            counts["clips read"] += 1
            try:
                line = build(key, row, counts, lines)
            except BadRecord as e:
                lines.add("clips dropped: bad record", key, src, str(e))
                continue
            if line:
                counts["clips kept"] += 1
                yield line
    return records


def progress(f, desc: str):
    """A tqdm bar over the bytes of an open file (MB/s), updated from its position."""
    from tqdm import tqdm

    bar = tqdm(total=os.fstat(f.fileno()).st_size, unit="B", unit_scale=True, desc=desc, mininterval=1.0)

    def update():
        bar.update(f.tell() - bar.n)
    return bar, update


def field(d, dotted: str):
    """d["a"]["b"] for "a.b", or BadRecord naming the missing field."""
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            raise BadRecord(f"missing field {dotted}")
        d = d[k]
    return d


def ints(v, n: int, what: str) -> list[int]:
    if not (isinstance(v, list | tuple) and len(v) == n and all(isinstance(x, int | float) for x in v)):
        raise BadRecord(f"{what} {v!r} is not {n} numbers")
    return [int(x) for x in v]


def find_file(stem: Path, exts: tuple[str, ...] = VIDEO_EXTS) -> Path | None:
    """The file named stem, or stem with one of exts (either case) added."""
    for ext in ("", *exts, *(e.upper() for e in exts)):
        p = stem.with_name(stem.name + ext)
        if p.is_file():
            return p
    return None


# ---------------------------------------------------------------- OpenS2V-5M


def read_clusters(path: Path) -> dict[str, str]:
    """{"total_partN/<key>": cluster id} from cluster_videos.json ({cluster: [part/key, ...]}), streamed."""
    import ijson

    out = {}
    with open(path, "rb") as f:
        for cluster, members in ijson.kvitems(f, "", use_float=True):
            for m in members if isinstance(members, list) else []:
                out[str(m)] = cluster
    return out


def background_png(root: Path, part: str, key: str) -> tuple[Path | None, str, list[Path]]:
    """The LaMa-inpainted annotation frame: <key>.png (OpenS2V-Nexus's demo dataloader) or <key before
    _step6>_step7.png (BindWeave, and the upstream step5 script's own output name)."""
    d = root / "Background" / part
    names = [(d / f"{key}.png", "<key>.png (demo dataloader)"),
             (d / f"{key.split('_step6')[0]}_step7.png", "<key>_step7.png (BindWeave)")]
    for p, how in names:
        if p.is_file():
            return p, how, [p for p, _ in names]
    return None, "", [p for p, _ in names]


def opens2v_clip(key: str, rec: dict, part: str, root: Path, a: IndexOpenS2V, counts: Counter,
                 lines: Lines, src: Path, clusters: dict) -> dict | None:
    """One clip of a part JSON -> its index line (or None: counted, and reported when it is a problem)."""
    md = field(rec, "metadata")
    video = root / "Videos" / part / str(field(rec, "metadata.path"))
    start, end = ints(field(rec, "metadata.face_cut"), 2, "metadata.face_cut")
    crop = ints(field(rec, "metadata.crop"), 4, "metadata.crop")
    sx, ex, sy, ey = crop
    if not (0 <= start < end):
        raise BadRecord(f"metadata.face_cut {[start, end]} is empty")
    if not (0 <= sx < ex and 0 <= sy < ey):
        raise BadRecord(f"metadata.crop {crop} is empty")
    caption = field(rec, "metadata.face_cap_qwen")
    caption = caption[0] if isinstance(caption, list) and caption else caption
    if not isinstance(caption, str):
        raise BadRecord("metadata.face_cap_qwen is not a caption")
    ann = int(field(rec, "annotation.ann_frame_data.ann_frame_idx"))
    boxes = field(rec, "annotation.ann_frame_data.annotations")
    names = field(rec, "annotation.mask_map")
    masks = field(rec, "annotation.mask_annotation").get(str(ann))
    if masks is None:
        raise BadRecord(f"annotation.mask_annotation has no masks for the annotation frame {ann}")
    tags = field(rec, "word_tags")
    subject_words = set(tags.get("subject") or []) | set(tags.get("pre_define") or [])
    object_words = set(tags.get("object") or [])
    pools: dict[str, list] = {"subject": [], "object": []}
    h, w = ey - sy, ex - sx
    from pycocotools import mask as mask_util

    for k, rle in masks.items():
        if not str(k).isdigit() or not 1 <= int(k) <= len(boxes) or str(k) not in names:
            raise BadRecord(f"mask {k} has no annotations[{k}-1] / mask_map entry")
        cls = names[str(k)].get("class_name")
        if not isinstance(rle, dict) or "counts" not in rle or "size" not in rle:
            raise BadRecord(f"mask {k} ({cls}) is not a COCO RLE (size, counts)")
        if [int(v) for v in rle["size"]] != [h, w]:
            raise BadRecord(f"mask {k} ({cls}): RLE size {rle['size']} is not the cropped frame's [{h}, {w}] "
                            f"(crop {crop})")
        try:
            x, y, bw, bh = mask_util.toBbox(rle_of(rle))
        except Exception as e:
            raise BadRecord(f"mask {k} ({cls}): RLE does not decode ({e})") from None
        if bw * bh == 0:
            lines.add("masks empty inside the crop (skipped)", key, src,
                      f"mask {k} ({cls}) is empty inside the crop {crop}: skipped")
            continue
        if x + bw > w or y + bh > h:
            raise BadRecord(f"mask {k} ({cls}): RLE runs past the cropped frame [{h}, {w}]")
        element = "subject" if cls in subject_words else "object" if cls in object_words else None
        if element is None:
            counts["masks of background or untagged classes (not elements)"] += 1
            continue
        b = boxes[int(k) - 1]
        pools[element].append(dict(k=k, cls=cls, ratio=float(bw * bh) / (h * w), aes=float(b.get("aes_score", 0)),
                                   gme=float(b.get("gme_score", 0)), rle=rle))
    kept: list[dict] = []  # every subject/object mask that passes the filters
    for element, pool in pools.items():
        passed = []
        for m in pool:
            if m["ratio"] < a.min_crop_ratio:
                counts[f"{element} masks dropped: crop_ratio < {a.min_crop_ratio}"] += 1
            elif m["aes"] < a.min_aes and m["gme"] < a.min_gme:
                counts[f"{element} masks dropped: aes < {a.min_aes} and gme < {a.min_gme}"] += 1
            else:
                passed.append(dict(m, role=element))
        if not passed and pool and element == "subject":
            counts["subject: largest crop taken as fallback (none passed)"] += 1
            passed = [dict(max(pool, key=lambda m: m["ratio"]), role=element)]
        kept += passed
    if not any(m["role"] == "subject" for m in kept):
        counts["clips dropped: no subject mask"] += 1
        return None
    if not video.is_file():
        lines.add("clips dropped: video missing", key, video, f"video {missing(video)}")
        return None
    kept.sort(key=lambda m: -m["ratio"])  # largest first (stable: ties keep the record's mask order)
    counts[f"clips with {len(kept) if len(kept) < 8 else '8+'} kept mask(s)"] += 1
    references = [dict(mask=dict(size=[h, w], counts=m["rle"]["counts"]), video=str(video), frame=ann, crop=crop,
                       class_name=m["cls"], role=m["role"]) for m in kept]
    elements = {}
    if a.background:
        png, how, tried = background_png(root, part, key)
        bg_aes = float(rec["annotation"]["ann_frame_data"].get("background_ase_score", 0))
        if png is None:  # BindWeave's loader keeps such a clip, without a background
            lines.add("clips without a background png (kept without a background)", key, tried[0],
                      f"background png not found (nor {tried[1].name}): the clip is kept without a background")
        elif bg_aes >= a.min_background_aes:
            counts[f"background found as {how}"] += 1
            elements["background"] = dict(image=str(png))
        else:
            counts[f"background found as {how}"] += 1
            counts[f"backgrounds not used: background_ase_score < {a.min_background_aes}"] += 1
    for what in more_than_kinds_take(len(kept), "background" in elements):
        counts[what] += 1
    line = dict(key=key, dataset="opens2v", video=str(video), caption=caption, fps=md.get("fps"), start=start,
                num_frames=end - start, crop=crop, references=references, elements=elements)
    cluster = clusters.get(f"{part}/{key}") or clusters.get(key)
    if cluster:
        line["cluster"] = cluster
    return line


def opens2v_part(json_path: Path, part: str, root: Path, a: IndexOpenS2V, clusters: dict, limit: int = 0):
    def rows(counts: Counter, lines: Lines):
        import ijson

        with open(json_path, "rb") as f:
            bar, update = progress(f, part)
            try:
                for n, row in enumerate(islice(ijson.kvitems(f, "", use_float=True), limit or None)):
                    if n % 256 == 0:
                        update()
                    yield row
            except ijson.JSONError as e:  # a truncated download: what was read is kept, and said
                lines.add("parts cut short: invalid JSON", "-", json_path, f"invalid JSON after "
                          f"{counts['clips read']} clips ({e}): the rest of this part is not indexed")
            update()
            bar.close()
    return records_of(rows, lambda key, rec, counts, lines: opens2v_clip(key, rec, part, root, a, counts, lines,
                                                                          json_path, clusters), json_path)


def index_opens2v(a: IndexOpenS2V):
    root, out = Path(a.root), Path(a.out)
    jsons = sorted((root / "Jsons" / "mask_and_bbox_High-Quality").glob("*.json")) or \
        sorted(p for p in (root / "Jsons").glob("*.json"))
    if not jsons:
        raise IndexError_(f"{root}: no part JSON under Jsons/mask_and_bbox_High-Quality/ (nor Jsons/)")
    clusters = read_clusters(Path(a.cross_pairs)) if a.cross_pairs else {}
    return write_index(out, "opens2v", [(p.stem, opens2v_part(p, p.stem, root, a, clusters)) for p in jsons],
                       a.rule())


# ---------------------------------------------------------------- Phantom-Data


def is_person(*words) -> bool:
    return any(w in PERSON_WORDS for t in words if isinstance(t, str) for w in re.findall(r"[a-z]+", t.lower()))


def phantom_row(vid: str, row: dict, videos: Path, counts: Counter, lines: Lines, src: Path) -> dict | None:
    if vid == "-":
        raise BadRecord("missing field vid")
    caption = row.get("video_caption")
    if not isinstance(caption, str) or not caption.strip():
        raise BadRecord("missing field video_caption")
    pairs = row.get("cross_pair")
    try:
        pairs = json.loads(pairs) if isinstance(pairs, str | bytes) else pairs
    except json.JSONDecodeError as e:
        raise BadRecord(f"cross_pair is not valid JSON ({e.msg})") from None
    if not isinstance(pairs, dict):
        raise BadRecord(f"cross_pair is {type(pairs).__name__}, expected an object of phrases")
    video = find_file(videos / vid)
    if video is None:
        lines.add("clips dropped: video not downloaded", vid, videos / f"{vid}.mp4",
                  "video not found (not downloaded?)")
        return None
    refs = []
    for phrase, entry in pairs.items():
        results = entry.get("refer_result") if isinstance(entry, dict) else None
        if not isinstance(results, list):
            raise BadRecord(f"cross_pair[{phrase!r}] has no refer_result list")
        for r in results:
            try:
                box = [float(v) for v in r["bbox_loc"]]
                pos = float(r["frame_idx"])
                rvid = str(r["vid"])
            except (KeyError, TypeError, ValueError):
                lines.add("refer_result entries dropped: bad entry", vid, src, f"cross_pair[{phrase!r}]: "
                          f"refer_result entry {str(r)[:80]} lacks vid / frame_idx / bbox_loc")
                continue
            if len(box) != 4 or not (box[0] < box[2] and box[1] < box[3]) or not 0 <= pos <= 1:
                lines.add("refer_result entries dropped: bad box or frame_idx", vid, src, f"cross_pair[{phrase!r}]: "
                          f"bbox_loc {box} / frame_idx {pos} is not a box / a position in [0, 1]")
                continue
            rvideo = find_file(videos / rvid)
            if rvideo is None:
                counts["refer_result entries skipped: reference clip not downloaded"] += 1
                continue
            if min(box) < 0 or max(box) > PHANTOM_CANVAS:
                counts["boxes overflowing the 768 canvas (clipped at load)"] += 1
            refs.append((phrase, dict(box=box, canvas=PHANTOM_CANVAS, video=str(rvideo), frame_pos=pos,
                                      class_name=str(r.get("bbox_cls") or phrase))))
            break
    if not refs:
        counts["clips dropped: no downloaded reference"] += 1
        return None
    people = [r for p, r in refs if is_person(p, r["class_name"])]
    subject = people[0] if people else refs[0][1]
    ordered = [subject, *(r for _, r in refs if r is not subject)]  # A2's subject, then its object, then the rest
    counts[f"clips with {len(ordered) if len(ordered) < 8 else '8+'} reference(s)"] += 1
    return dict(key=vid, dataset="phantom", video=str(video), caption=caption, elements={},
                references=[dict(r, role="object" if i else "subject") for i, r in enumerate(ordered)])


def index_phantom(a: IndexPhantom):
    import pyarrow.parquet as pq

    root, out = Path(a.root), Path(a.out)
    path = Path(a.parquet) if a.parquet else root / PHANTOM_PARQUET
    if not path.is_file():
        raise IndexError_(f"{path}: not found (Phantom-Data's training parquet; --parquet to name another)")
    pf = pq.ParquetFile(path)
    need = ("vid", "video_caption", "cross_pair")
    cols = pf.schema_arrow.names
    if not set(need) <= set(cols):
        raise IndexError_(f"{path}: columns {cols}; Phantom-Data's training parquet has {list(need)}")
    videos = Path(a.videos) if a.videos else root / "videos"

    def part(i):
        def rows(counts, lines):
            for batch in pf.iter_batches(row_groups=[i], columns=list(need)):
                yield from ((str(row.get("vid") or "-"), row) for row in batch.to_pylist())
        return records_of(rows, lambda vid, row, counts, lines: phantom_row(vid, row, videos, counts, lines, path),
                          path)
    return write_index(out, "phantom", [(f"{path.stem}.rg{i:05d}", part(i)) for i in range(pf.num_row_groups)],
                       a.rule())


# ---------------------------------------------------------------- HuMoSet


HUMO_VIDEO_COLS = ("video", "video_name", "video_path", "video_id", "vid", "file_name", "filename", "name", "path",
                   "id")
HUMO_CAPTION_COLS = ("caption", "video_caption", "text", "prompt", "description")
HUMO_REF_COLS = ("reference_image", "ref_image", "reference", "image")


def humoset_schema(names: list[str], path: Path) -> tuple[str, str, str | None]:
    """(video, caption, reference or None) columns of video_caption.parquet, whose schema is not documented: the
    first known name of each; a file without them fails naming its columns."""
    lower = {n.lower(): n for n in names}
    pick = [next((lower[c] for c in cols if c in lower), None) for cols in (HUMO_VIDEO_COLS, HUMO_CAPTION_COLS,
                                                                            HUMO_REF_COLS)]
    if pick[0] is None or pick[1] is None:
        raise IndexError_(f"{path}: columns {names}: expected a video column (one of {list(HUMO_VIDEO_COLS)}) and a "
                          f"caption column (one of {list(HUMO_CAPTION_COLS)}); HuMoSet's schema differs from the one "
                          "a2 reads")
    return pick[0], pick[1], pick[2]


def index_humoset(a: IndexHumoSet):
    import pyarrow.parquet as pq

    root, out = Path(a.root), Path(a.out)
    path = root / "video_caption.parquet"
    if not path.is_file():
        raise IndexError_(f"{path}: not found")
    pf = pq.ParquetFile(path)
    vcol, ccol, rcol = humoset_schema(pf.schema_arrow.names, path)
    print(f"{path.name}: video column {vcol!r}, caption column {ccol!r}, reference column {rcol!r}")

    def rows(counts, lines):
        for batch in pf.iter_batches(columns=[c for c in (vcol, ccol, rcol) if c]):
            yield from ((str(row.get(vcol) or "-"), row) for row in batch.to_pylist())

    def clip(name: str, row: dict, counts: Counter, lines: Lines) -> dict | None:
        caption = row.get(ccol)
        if name == "-" or not isinstance(caption, str) or not caption.strip():
            raise BadRecord(f"missing {vcol if name == '-' else ccol}")
        video = find_file(root / "video" / name)
        stem = Path(name).stem
        ref = (root / "reference_image" / str(row[rcol]) if rcol and row.get(rcol)
               else find_file(root / "reference_image" / stem, IMAGE_EXTS))
        if video is None:
            lines.add("clips dropped: video missing", stem, root / "video" / name, "video not found")
        elif ref is None or not ref.is_file():
            lines.add("clips dropped: reference image missing", stem, ref or root / "reference_image" / f"{stem}.png",
                      "reference image not found")
        else:
            return dict(key=stem, dataset="humoset", video=str(video), caption=caption,
                        elements=dict(subject=dict(image=str(ref))))
        return None
    return write_index(out, "humoset", [(path.stem, records_of(rows, clip, path))], a.rule())


# ---------------------------------------------------------------- Kaleido's training layout


def index_kaleido(a: IndexKaleido):
    """Kaleido's training data as its SFTDataset lists it (zai-org/Kaleido data_video.py:365-406): videos/<id>.mp4 in
    sorted order, labels/<id>.txt's first line the caption, references/<id>/ref1.png, ref2.png, ref3.png those
    present, in that order. Each clip is a manifest row (`id`, `video`, `caption`, the references as ref0.. by
    position: the kaleido kind's elements), absolute paths. Where a2 differs, the clip is dropped and said: no label
    or an empty one (SFTDataset trains the empty caption; a2 refuses one), no reference at all (SFTDataset's
    torch.stack of none fails). A reference missing before a present one, and a label or reference dir of no video,
    are said too."""
    root, out = Path(a.root).absolute(), Path(a.out)
    videos = root / "videos"
    if not videos.is_dir():
        raise IndexError_(f"{videos}: not a directory (Kaleido's layout: videos/<id>.mp4, labels/<id>.txt, "
                          "references/<id>/ref1..3.png)")
    ids = {p.stem for p in videos.glob("*.mp4")}

    def rows(counts: Counter, lines: Lines):
        yield from ((p.stem, p) for p in sorted(videos.glob("*.mp4")))
        orphans = [(f.stem, f) for f in (root / "labels").glob("*.txt")] + \
            [(f.name, f) for f in (root / "references").glob("*") if f.is_dir()]
        for key, f in sorted(orphans):
            if key not in ids:
                lines.add(f"{f.parent.name} of no video (not indexed)", key, f, f"no videos/{key}.mp4: not indexed")

    def clip(key: str, video: Path, counts: Counter, lines: Lines) -> dict | None:
        label = root / "labels" / f"{key}.txt"
        try:
            caption = (label.read_text().splitlines() or [""])[0].strip()
        except FileNotFoundError:
            lines.add("clips dropped: label missing", key, label, "label not found (a2 trains no empty caption): "
                      "write the clip's caption there")
            return None
        except (OSError, UnicodeDecodeError) as e:
            lines.add("clips dropped: label unreadable", key, label, f"label unreadable ({e})")
            return None
        if not caption:
            lines.add("clips dropped: empty label", key, label, "the label's first line is empty (a2 trains no empty "
                      "caption)")
            return None
        refs = [root / "references" / key / f"ref{i}.png" for i in range(1, 4)]
        present = [p for p in refs if p.is_file()]
        if not present:
            lines.add("clips dropped: no reference", key, refs[0], "no ref1.png, ref2.png or ref3.png in "
                      f"references/{key}/" + ("" if refs[0].parent.is_dir() else " (no such dir)"))
            return None
        for p in refs[:refs.index(present[-1])]:
            if p not in present:
                lines.add("references missing before a present one (the later ones move up)", key, p,
                          f"not found: those present are taken in order ({', '.join(q.name for q in present)})")
        counts[f"clips with {len(present)} reference(s)"] += 1
        return dict(id=key, video=str(video), caption=caption, **{f"ref{i}": str(p) for i, p in enumerate(present)})
    return write_index(out, "kaleido", [("kaleido", records_of(rows, clip, root))], a.rule())


# ---------------------------------------------------------------- export-elements


def export_elements(a: ExportElements) -> dict:
    from tqdm import tqdm

    path, out = Path(a.manifest), Path(a.out)
    if not path.is_file():
        raise MissingInput(f"--manifest {path}: no such index (`data.py index` writes OUT/index.jsonl)")
    with open(path) as f:
        try:
            first = json.loads(next(f, "{}") or "{}")
        except ValueError:  # not UTF-8, not JSON
            first = {}
    if not isinstance(first, dict) or first.get("dataset") not in PUBLIC_TYPES:
        raise InputError(f"{path}: not an index of `data.py index` (first line has no dataset of {PUBLIC_TYPES})")
    cfg = DatasetConfig(str(path.parent), dataset_type=first["dataset"], manifest=str(path), elements=A2_ELEMENTS,
                        cross_video=a.cross_video)
    problems: list[Problem] = []
    samples = list_index(path, cfg, 0, problems)[:a.limit or None]
    produced: dict[str, dict[str, str]] = {}
    for s in tqdm(samples, desc="export"):
        d = out / re.sub(r"[^\w.-]", "_", s.id)
        d.mkdir(parents=True, exist_ok=True)
        try:
            _, images = load_sample(s, [], list(s.refs), a.sam)
        except Exception as ex:  # a damaged file: reported like a load failure, the others still exported
            problems.append(Problem(s.id, s.video, f"failed to load ({type(ex).__name__}: {ex})", s.where))
            continue
        produced[s.id] = {}
        for name, image in images.items():
            image.save(d / f"{name}.png")
            produced[s.id][name] = str(d / f"{name}.png")
    (out / "produced.json").write_text(json.dumps(produced, indent=1))
    for p in problems:
        print(p, file=sys.stderr)
    print(f"exported {sum(map(len, produced.values()))} element images of {len(produced)} clips to {out}")
    return produced


def run(a) -> object:
    """data.py's `index ...` and `export-elements` commands."""
    fn = {IndexOpenS2V: index_opens2v, IndexPhantom: index_phantom, IndexHumoSet: index_humoset,
          IndexKaleido: index_kaleido, ExportElements: export_elements}[type(a)]
    return run_cli(fn, a)


# ---------------------------------------------------------------- a synthetic OpenS2V-5M part (bench.py --opens2v)


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


def synthetic_part(root: Path, clips: int, clip: Path) -> Path:
    """A synthetic OpenS2V-5M part of `clips` records under root (bench.py --opens2v), unless one is there: `clip`
    (tests/media/hiker.mp4) played back and forth to 81 frames at 1280x720 (OpenS2V's size), its first frame mirrored
    as the person (any picture), one record repeated, the first 8 clips with their background png (the loader's).
    Returns the part JSON."""
    part = root / "Jsons" / "mask_and_bbox_High-Quality" / "total_part1.json"
    if part.is_file():
        return part
    frames = read_frames(clip, [i if (i // 48) % 2 == 0 else 48 - i % 48 for i in range(81)])
    fx = synthetic_opens2v(root, np.stack([np.asarray(Image.fromarray(f).resize((1280, 720))) for f in frames]),
                           np.ascontiguousarray(frames[0, :, ::-1]))
    rec = next(iter(fx["records"].values()))
    bg = next((root / "Background" / "total_part1").glob("*.png"))
    keys = [f"clip{i:06d}_part1_step6" for i in range(clips)]
    write_part(part, ((k, rec) for k in keys))
    for k in keys[:8]:
        shutil.copy(bg, bg.with_name(f"{k}.png"))
    return part
