"""E2V data: scan and validate a dataset, load clips and element images, bucket and shard batches.

A sample id links `<id>.mp4` (or .webm/.mov/.mkv), `<id>.txt` (the prompt) and element images `<id><suffix>`
(a2.elements.Element); names match case-insensitively, and hidden files (macOS `._*` included) are no part of a dataset.
Also read: a manifest (CSV or JSONL with `video` and `caption` columns, plus optional `id` and element-name columns)
and the T2V workflow's `train.jsonl` of `.npz` clips (uint8 frames (F, H, W, 3) under key `frames`, prompt under
`prompt`). Files are read as they mean: EXIF orientation, video rotation metadata, transparency on white.

Validation reads what training will read (every frame index a clip can be asked for, every image fully, the clip
arrays' layout). A file that fails later anyway does not end the run: see a2/data/loader.py LoadFailures.

    python data.py make-sample sample_data          # a tiny synthetic E2V dataset (no downloads)
    python data.py validate --data-root DIR [any train_a2.py flag: --manifest, --elements, --num-frames, ...]
    python data.py index opens2v|phantom|humoset ROOT OUT    # a public S2V dataset as published
    (a2/data/public_index.py) python data.py index kaleido ROOT OUT                    # Kaleido's videos/ labels/
    references/ as a manifest python data.py export-elements --manifest OUT/index.jsonl --out DIR
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a flag typo or a config error answer before the heavy imports below (torch...)
    from a2.cli import exit_on_signal, parse_cli, run_cli
    from config import DataCommand, Validate, run_datasets

    exit_on_signal("nothing is left half-written (make-sample: the files written so far are kept); run it again")
    CLI_COMMAND = parse_cli(DataCommand, description=__doc__)
    if isinstance(CLI_COMMAND, Validate):  # the flags' and the dataset config's mistakes too (validate reads them)
        run_cli(run_datasets, CLI_COMMAND)

import codecs
import os
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from tqdm import tqdm

from a2.cli import exit_on_signal, parse_cli, read_text, run_cli
from a2.config.dataset_config import PUBLIC_TYPES, DatasetConfig
from a2.data import public_index, public_read
from a2.data.loader import collate
from a2.data.media import (
    VIDEO_EXTS,
    DatasetError,
    Problem,
    Sample,
    caption_problems,
    clip_length,
    decodable_frames,
    frame_buckets,
    frame_indices,
    frame_windows,
    last_frame_read,
    manifest_samples,
    npz_frames_header,
    probe_video,
    read_clip,
    resampled_frames,
)
from a2.elements import A2_ELEMENTS, Element
from a2.images import IMAGE_EXTS, canvas_refusal, read_image, reference_pixels, resize_frames
from a2.kinds.conditioning import clip_frames, element_layout, element_refusal
from a2.kinds.kinds import KIND_DEFS
from a2.model.transformer import TEXT_TOKENS
from a2.plan import training_layout
from config import DataCommand, MakeSample, Validate, run_datasets

# a VACE run's clip mask, beside the clip: white where VACE generates, the same for every frame (docs/dataset.md)
MASK_SUFFIX = "_vace_mask.png"
MIN_REFERENCE_SIDE = 4  # pixels: a smaller element image (a 1x1 placeholder, a failed cut-out) is no reference
ASPECTS = (9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9)  # h / w of the aspect buckets


# ---------------------------------------------------------------- scanning and validation


def _visible_files(root: Path) -> dict[str, list[Path]]:
    """Lower-cased name -> files: names match case-insensitively (datasets come from macOS and Windows); hidden files,
    macOS's AppleDouble `._*` among them, are not data."""
    files: dict[str, list[Path]] = {}
    for p in sorted(root.iterdir()):
        # a dangling symlink is a file that is missing (reported), not one that is not there
        if not p.name.startswith(".") and (p.is_file() or p.is_symlink() and not p.exists()):
            files.setdefault(p.name.lower(), []).append(p)
    return files


def _list_dir(root: Path, cfg: DatasetConfig, di: int, loose: list[Problem], masks: bool = False) -> list[Sample]:
    """The samples of a folder dataset; masks: each one's clip mask too (MASK_SUFFIX: a VACE run's)."""
    files = _visible_files(root)
    videos: dict[str, list[Path]] = {}
    for name, paths in files.items():
        stem, ext = os.path.splitext(name)
        if ext in VIDEO_EXTS:
            videos.setdefault(stem, []).extend(paths)
    out, used = [], set()
    for stem, paths in sorted(videos.items()):
        s = Sample(paths[0].stem, di, paths[0], "")
        if len(paths) > 1:
            s.problems.append(Problem(s.id, ", ".join(map(str, paths)), "several videos for one id; keep one"))
        for e in cfg.elements:
            matches = [p for suffix in e.suffixes for p in files.get((stem + suffix).lower(), [])]
            if len(matches) > 1:
                s.problems.append(Problem(s.id, ", ".join(map(str, matches)), f"several files match element "
                                                                               f"'{e.name}'; keep one"))
            if matches:
                s.elements[e.name] = matches[0]
                used.update(matches)
        if masks and (stem + MASK_SUFFIX).lower() in files:
            s.mask = files[(stem + MASK_SUFFIX).lower()][0]
            used.add(s.mask)
        caption = files.get(stem + ".txt", [root / f"{s.id}.txt"])[0]
        used.add(caption)
        try:
            s.prompt, problems = caption_problems(s.id, read_text(caption), caption, "", cfg)
            s.problems += problems
            if caption.read_bytes()[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):  # read right, but said
                s.problems.append(Problem(s.id, caption, "caption is UTF-16 (read as such); the other tools of a "
                                                         "dataset pipeline may expect UTF-8", warning=True))
        except FileNotFoundError:
            s.problems.append(Problem(s.id, caption, "caption file missing"))
        except ValueError as e:
            s.problems.append(Problem(s.id, caption, f"caption is {e}"))
        out.append(s)
    loose += orphans(files, used, videos, cfg)
    return out


def orphans(files: dict[str, list[Path]], used: set, videos: dict, cfg: DatasetConfig) -> list[Problem]:
    """Captions and images that belong to no sample (a renamed or missing video, a mistyped suffix): warned, since
    they are data someone meant to train on."""
    suffixes = sorted({x.lower() for e in cfg.elements for x in e.suffixes}, key=len, reverse=True)
    out = []
    for name, paths in sorted(files.items()):
        ext = os.path.splitext(name)[1]
        if ext not in (".txt", *IMAGE_EXTS) or all(p in used for p in paths):
            continue
        stem = os.path.splitext(name)[0]
        owner = next((name[:-len(x)] for x in suffixes if name.endswith(x)), None) or \
            max((v for v in videos if stem.startswith(v)), key=len, default=stem)
        what = (f"no video '{paths[0].name[:len(owner)]}' for this " + ("caption" if ext == ".txt" else "element image")
                if owner not in videos else f"matches no element suffix of sample '{owner}' "
                                            f"({', '.join(suffixes)})")
        out += [Problem(owner if owner in videos else "-", p, what, warning=True) for p in paths if p not in used]
    return out


def _list_manifest(path: Path, cfg: DatasetConfig, di: int, problems: list[Problem]) -> list[Sample]:
    def sample(r: dict, n: int, where: str) -> Sample | None:
        ref = str(r.get("video") or r.get("path") or r.get("file") or "")
        if not ref:
            return None
        ref = Path(ref.replace("\\", "/"))  # Windows separators
        video = path.parent / ref  # an absolute path stays absolute
        # default id: the path as written without its extension (unique beside the manifest), else the file's stem
        s = Sample(str(r.get("id") or (ref.stem if ref.is_absolute() else ref.with_suffix("").as_posix())), di,
                   video, "", where=where)
        s.prompt, s.problems = caption_problems(s.id, str(r.get("caption") or r.get("prompt") or r.get("text") or ""),
                                                path, where, cfg)
        s.elements = {e.name: path.parent / str(r[e.name.lower()]).replace("\\", "/") for e in cfg.elements
                      if r.get(e.name.lower())}
        return s
    return manifest_samples(path, problems, sample, "no 'video' (or 'path') value", ("video", "path", "file"))


def check_sample(s: Sample, cfg: DatasetConfig, num_frames: int, sampling: str, short_why: str = "") -> Sample:
    """Read what training will read; set the clip's frames and size, and add what fails to s.problems (short_why:
    why the clips must be that long, in the user's terms)."""
    for e in cfg.elements:
        if e.required and e.name not in s.elements:
            s.problems.append(Problem(s.id, s.video.with_name(s.video.stem + e.suffixes[0]),
                                      f"required element '{e.name}' missing", s.where))
    for name, img in s.elements.items():
        try:
            w, h = s.sizes[name] = read_image(img).size
            if min(w, h) < MIN_REFERENCE_SIDE:
                s.problems.append(Problem(s.id, img, f"element '{name}' is {w}x{h} pixels: too small to be a "
                                                     f"reference (under {MIN_REFERENCE_SIDE} on a side)", s.where))
        except ValueError as ex:
            what = (f"a dangling symlink (to {os.readlink(img)})" if img.is_symlink() and not img.exists() else
                    "not found" if not img.exists() else str(ex))
            s.problems.append(Problem(s.id, img, f"element '{name}' is {what}", s.where))
    if s.mask is not None:
        try:
            read_image(s.mask)
        except ValueError as ex:
            s.problems.append(Problem(s.id, s.mask, f"the clip's mask is {ex}", s.where))
    try:
        if s.video.suffix.lower() == ".npz":  # the header: every check of the array but its values
            shape, _ = npz_frames_header(s.video)
            listed, size = shape[0], shape[1:3]
        else:
            listed, size = probe_video(s.video)
        total = listed or decodable_frames(s.video)  # a container that lists no count (webm, mkv): count them
        kept = len(resampled_frames(total, cfg.source_fps, cfg.target_fps))
        frames = clip_length(cfg, num_frames, kept)
        if cfg.frame_extraction != "spread" and frames:
            s.windows = tuple(frame_windows(total, frames, cfg))
        if not frames:
            at = f" ({kept} at {cfg.target_fps:g} fps)" if kept != total else ""
            s.problems.append(Problem(s.id, s.video, f"{total} frames{at}, shorter than the smallest bucket "
                                                     f"({min(frame_buckets(cfg, num_frames))}){short_why}", s.where))
        elif listed and s.video.suffix.lower() != ".npz":
            last = max(w[-1] for w in s.windows) if s.windows else last_frame_read(total, frames, sampling)
            got = decodable_frames(s.video, last)
            if got <= last:
                s.problems.append(Problem(s.id, s.video, f"only frames 0..{got - 1} of the {total} it lists decode "
                                                         f"(truncated or damaged); training reads up to frame {last}",
                                          s.where))
        s.num_frames, s.size = total, tuple(int(v) for v in size)
    except Exception as ex:  # PyAV, numpy and zip raise many types for damaged files
        what = (f"video is a dangling symlink (to {os.readlink(s.video)})" if s.video.is_symlink() and not
                s.video.exists() else "video file not found" if not s.video.exists() else
                f"unreadable video ({type(ex).__name__}: {ex})")
        s.problems.append(Problem(s.id, s.video, what, s.where))
    return s


def scan(cfgs: list[DatasetConfig], num_frames: int, sampling: str = "uniform",
         short_why: str = "", most: int = 0, masks: bool = False) -> tuple[list[Sample], list[Problem]]:
    """Every sample of every dataset, checked (Sample.problems), and the problems that belong to no sample. `most`:
    the kind's maximum of element images a sample (0: any), which a public index's clip fills up to. masks: a
    folder's clips take their masks (a VACE run's, MASK_SUFFIX)."""
    samples, problems = [], []
    for di, cfg in enumerate(cfgs):
        root = Path(cfg.data_root)
        manifest = Path(cfg.manifest) if cfg.manifest else None
        if manifest is not None and not manifest.is_absolute():
            manifest = root / manifest
        where = cfg.source or f"datasets[{di}]"
        if manifest is not None and not manifest.is_file():
            raise DatasetError(f"{where}: manifest {manifest} not found")
        if manifest is None and not root.is_dir():
            raise DatasetError(f"{where}: data_root {root} is not a directory")
        check = check_sample
        if cfg.dataset_type in PUBLIC_TYPES:
            if manifest is None:
                raise DatasetError(f"{where}: --dataset-type {cfg.dataset_type} reads an index: --manifest "
                                   "OUT/index.jsonl (written by `data.py index`)")
            found, check = public_read.list_index(manifest, cfg, di, problems, most), public_read.check_public_sample
        else:
            found = (_list_manifest(manifest, cfg, di, problems) if manifest
                     else _list_dir(root, cfg, di, problems, masks))
        if not found:
            problems.append(Problem("-", manifest or root, f"no samples (videos {VIDEO_EXTS} or manifest rows)"))
        checked = _check_all(found, partial(check, cfg=cfg, num_frames=num_frames, sampling=sampling,
                                            short_why=short_why))
        samples += [w for s in checked for w in window_samples(s)]
    return samples, problems


def window_samples(s: Sample) -> list[Sample]:
    """A clip cut into several windows (--frame-extraction): one sample per window, named <id>@<first source frame>."""
    if s.bad or len(s.windows) <= 1:
        return [s]
    return [replace(s, id=f"{s.id}@{w[0]}", windows=(w,)) for w in s.windows]


def held_out(dataset: E2VDataset, clips: int, seed: int) -> list[int]:
    """Indices of the samples never trained on (--eval-split, --eval-manifest, a dataset config's `eval` datasets):
    every sample of an eval dataset, and every window of `clips` clips of the training datasets, drawn with `seed`
    (all windows of a clip together: no frame of a held-out clip is trained on)."""
    samples = dataset.samples
    out = {i for i, s in enumerate(samples) if dataset.cfgs[s.dataset].eval}
    if clips:
        pool = sorted({(s.dataset, str(s.video)) for s in samples if not dataset.cfgs[s.dataset].eval})
        if clips >= len(pool):
            raise DatasetError(f"--eval-split {clips}: the training datasets have {len(pool)} clips; hold out fewer")
        chosen = set(random.Random(seed).sample(pool, clips))
        out |= {i for i, s in enumerate(samples) if (s.dataset, str(s.video)) in chosen}
    return sorted(out)


def _check_all(found: list[Sample], check) -> list[Sample]:
    """check() every sample on a thread pool (decoding releases the GIL). Under torch.distributed each rank checks
    its share and all ranks get every result: N ranks do not decode the whole dataset N times."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        mine = list(pool.map(check, found[rank::world]))
    if world == 1:
        return mine
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    checked = list(found)
    for r, theirs in enumerate(every):
        checked[r::world] = theirs
    return checked


# ---------------------------------------------------------------- the dataset


class E2VDataset(torch.utils.data.Dataset):
    """Samples for training. Items are picked by (index, seed) pairs from BucketBatchSampler so that
    random frame windows are a function of the data order seed, not of the worker.

    num_frames: the clip length (a2.kinds.conditioning.clip_frames); with auto_frame_buckets a shorter clip goes to the
    largest 4k+1 bucket it fills. global_batch: only for the summary (buckets that never fill one).
    size_multiple: what aspect buckets' height and width are multiples of (the model's VAE x patch: 16, TI2V-5B 32)."""

    def __init__(self, cfgs: list[DatasetConfig], num_frames: int, skip_bad_samples: bool = False,
                 frame_sampling: str = "uniform", verbose: bool = True, global_batch: int = 1,
                 size_multiple: int = 16, layout=None):
        self.cfgs, self.num_frames, self.frame_sampling = cfgs, num_frames, frame_sampling
        self.size_multiple = size_multiple
        # the run's a2.kinds.conditioning.Layout: how element images become references (None: framed)
        self.layout = layout
        # set to a precompute cache dir (train_a2.py --cache-dir): items then hold the encoders' outputs, not pixels
        self.cache_dir: Path | None = None
        # pixel frames the references take of --num-frames (VACE's come on top of it)
        refs = 0 if layout is None or layout.definition.extends else layout.num_frames - layout.clip_frames
        why = f": --num-frames {layout.num_frames} less the {refs} frames the references take" if refs > 0 else ""
        most = KIND_DEFS[layout.kind].references[1] if layout else 0  # the element images one sample takes
        samples, loose = scan(cfgs, num_frames, frame_sampling, why, most, bool(layout and layout.context_blocks))
        problems = loose + [p for s in samples for p in s.problems]
        errors, warnings = [p for p in problems if not p.warning], [p for p in problems if p.warning]
        refused = None
        if errors and not skip_bad_samples:  # the problems counted, then the warnings (samples kept) after them
            refused = DatasetError(f"{len(errors)} problem(s) in the dataset"
                                   + (f", and {len(warnings)} warning(s)" if warnings else "") + ":\n  "
                                   + "\n  ".join([*map(str, errors), *(f"warning: {p}" for p in warnings)])
                                   + "\n(--skip-bad-samples drops the samples with a problem instead)")
        self.samples = [s for s in samples if not s.bad]
        self.buckets = [self.bucket_of(s) for s in self.samples]
        # what the run's kind cannot take, named and left out before step 1: the element set (a2.kinds.kinds.Kind
        # .references), and images MAGREF's canvas cannot hold at the bucket's size
        refusals = [layout and (element_refusal(layout, len(s.elements)) or self.canvas_refusal(s, b))
                    for s, b in zip(self.samples, self.buckets)]
        self.left_out = [Problem(s.id, s.video, why, s.where) for s, why in zip(self.samples, refusals) if why]
        self.samples = [s for s, why in zip(self.samples, refusals) if not why]
        self.buckets = [b for b, why in zip(self.buckets, refusals) if not why]
        if verbose:  # what the rest of the data would train, also when a problem stops it (said after, in one block)
            print("\n".join(self.summary([] if refused else problems, sum(s.bad for s in samples), global_batch,
                                          refused is not None)))
        if refused is not None:
            raise refused
        if not self.samples:
            raise DatasetError("no valid samples left in " + ", ".join(c.data_root for c in cfgs))

    def summary(self, problems: list[Problem], skipped: int, global_batch: int, refused: bool = False) -> list[str]:
        """Samples per dataset and element, per bucket, and the buckets that never fill a global batch. refused: the
        bad samples stop the run (their problems are said by the error): the summary is of the others."""
        lines = [f"dataset: {len(self.samples)} samples from {len(self.cfgs)} dataset(s)"
                 + (f" besides the {skipped} with a problem (below)" if refused and skipped else
                    f"; skipped {skipped} bad sample(s)" if skipped else "")
                 + (f"; left out {len(self.left_out)} the kind cannot take" if self.left_out else "")]
        lines += [f"  {'warning' if p.warning else 'skipped'}: {p}" for p in problems]
        lines += [f"  left out: {p}" for p in self.left_out]
        for di, c in enumerate(self.cfgs):
            mine = [s for s in self.samples if s.dataset == di]
            cover = ", ".join(f"{e.name} {sum(e.name in s.elements for s in mine)}/{len(mine)}" for e in c.elements)
            lines.append(f"  {c.manifest if c.dataset_type in PUBLIC_TYPES else c.data_root}: {len(mine)} samples"
                         + (f"; elements: {cover}" if cover else ""))
            if c.dataset_type in PUBLIC_TYPES:
                rule = public_read.index_rule(Path(c.manifest))
                lines.append(f"  {c.dataset_type} index built with: {rule or 'no report.txt'}")
        per_epoch = Counter()  # samples drawn from each bucket per epoch (dataset weights)
        for s, b in zip(self.samples, self.buckets):
            per_epoch[b] += self.cfgs[s.dataset].weight
        untrained = 0
        for b in sorted(per_epoch, key=str):
            n = self.buckets.count(b)
            frames, h, w, names = b
            line = f"  bucket {frames} frames {h}x{w} [{', '.join(names) or 'no elements'}]: {n} samples"
            if int(per_epoch[b]) < global_batch:
                untrained += n
                line += f", fewer than one global batch ({global_batch}) per epoch: never trained"
            lines.append(line)
        if untrained:
            lines.append(f"  trained: {len(self.samples) - untrained} of {len(self.samples)} samples ({untrained} "
                         "in buckets that never fill a global batch: add data, or lower the global batch)")
        return lines

    def canvas_refusal(self, s: Sample, bucket: tuple) -> str | None:
        """canvas_refusal of the sample's element images (their sizes as the scan read them) at its bucket's size, in
        the order __getitem__ hands them to reference_pixels."""
        _, h, w, names = bucket
        if not all(n in s.sizes for n in names):  # a size not known: its load says what is wrong
            return None
        return canvas_refusal(self.layout, [s.sizes[n] for n in names], (h, w), [str(s.elements[n]) for n in names])

    def bucket_of(self, s: Sample) -> tuple:
        """(frames, H, W, element names): what every sample of a batch shares."""
        cfg = self.cfgs[s.dataset]
        frames = len(s.windows[0]) if s.windows else clip_length(cfg, self.num_frames, s.num_frames)
        h, w = cfg.target_resolution
        if cfg.auto_frame_buckets and s.size[0] and s.size[1]:  # aspect buckets at about the target's area
            area, ar = h * w, s.size[0] / s.size[1]
            best = min(ASPECTS, key=lambda a: abs(np.log(a / ar)))
            m = self.size_multiple
            h, w = (max(m, round((area * best) ** 0.5 / m) * m), max(m, round((area / best) ** 0.5 / m) * m))
        names = tuple(e.name for e in cfg.elements if e.name in s.elements)
        return (frames, h, w, names + (("clip mask",) if s.mask else ()))  # a masked clip's context is another

    def stamp(self, index: int) -> str:
        """What the sample's files are now (each one's size and modification time): LoadFailures reads a dropped
        sample again on resume once they change (the bad file was replaced)."""
        s = self.samples[index]
        out = []
        for f in (s.video, *s.elements.values(), *([s.mask] if s.mask else [])):
            try:
                st = os.stat(f)
                out.append(f"{st.st_size}:{st.st_mtime_ns}")
            except OSError:
                out.append("missing")
        return " ".join(out)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, item):
        """The sample's tensors, or, when a file fails to load, {index, failed: its problem line}: a bad file must
        not end a run; LoadFailures decides what the step does, the same on every rank."""
        idx, seed = item if isinstance(item, tuple) else (item, 0)
        s, (frames, h, w, names) = self.samples[idx], self.buckets[idx]
        cfg = self.cfgs[s.dataset]
        elements = [e for e in cfg.elements if e.name in names]
        repeats = tuple(e.repeat for e in elements)
        item = dict(index=idx, id=s.id, prompt=s.prompt, element_names=names, repeats=repeats,
                    bucket=self.buckets[idx], file=str(s.video))
        file = s.video
        try:  # everything up to the returned tensors: an exception in a loader worker must not end the run raw
            if self.cache_dir:
                file = self.cache_dir / "samples" / f"{idx}.pt"
                c = torch.load(file, weights_only=True)
                text = c["text"].new_zeros(TEXT_TOKENS, c["text"].shape[-1])
                text[:len(c["text"])] = c["text"]  # stored trimmed to its tokens; the rest of 512 is exact zeros
                return dict(item, file=str(file), prompt=c["prompt"], posteriors=c["posteriors"], text=text,
                            clip=c.get("clip"), region=c.get("region"), align=c.get("align"),
                            video_shape=(3, frames, h, w),
                            ref_shape=(element_layout(self.layout, repeats).reference_images if self.layout
                                       else len(elements), 3, *(self.layout and self.layout.reference_size or (h, w))))
            indices = list(s.windows[0]) if s.windows else frame_indices(s.num_frames, frames, self.frame_sampling,
                                                                             random.Random(seed))
            if s.refs:  # a public dataset's clip: its element images are built from the index's annotations
                raw, images = public_read.load_sample(s, indices, names, cfg.sam)
            else:
                raw, images = read_clip(s.video, indices), {}
            for e in elements:
                file = s.elements[e.name]
                images[e.name] = images[e.name] if e.name in images else read_image(file)
            files = [str(s.elements[e.name]) for e in elements]
            file = s.video  # the sample; an image MAGREF's canvas cannot hold is named in the message (files)
            vae, clip, region = reference_pixels(self.layout, [images[e.name] for e in elements], elements, (h, w),
                                                 tuple(cfg.clip.resolution), files)
            video = resize_frames(raw, cfg.reshape_mode, (h, w))  # (3, F, H, W)
            if s.mask is not None:  # VACE's: framed as the clip, 1 where it generates (a2.kinds.conditioning.encode)
                file = s.mask
                mask = np.repeat(np.asarray(read_image(s.mask))[None], len(raw), axis=0)
                region = (resize_frames(mask, cfg.reshape_mode, (h, w))[0] > 0).float()  # (F, H, W)
        except Exception as ex:  # whatever a damaged file raises
            return dict(index=idx, bucket=self.buckets[idx], failed=str(Problem(
                s.id, file, f"failed to load ({type(ex).__name__}: {ex})", s.where)))
        return dict(item, video=video, ref_vae=vae, ref_clip=clip, region=region)


# ---------------------------------------------------------------- precompute cache (train_a2.py --precompute)


def write_cache(cache: Path, dataset: E2VDataset, encode, rank: int = 0, world: int = 1):
    """Encode this rank's share of the samples into cache/samples/<index>.pt (skipping those already there, so a
    killed precompute resumes); `encode(batch) -> dict` runs the encoders on a one-sample batch."""
    if dataset.frame_sampling == "random":
        raise DatasetError("a precompute cache holds one clip per sample: use uniform or head frame sampling")
    (cache / "samples").mkdir(parents=True, exist_ok=True)
    mine = range(rank, len(dataset), world)
    todo = [i for i in mine if not (cache / "samples" / f"{i}.pt").exists()]
    if rank == 0 and len(todo) < len(mine):
        print(f"precompute: resuming, {len(mine) - len(todo)} of {len(mine)} samples already encoded in {cache}")
    if threading.current_thread() is threading.main_thread():  # signal handlers: the main thread's alone
        exit_on_signal(f"the samples encoded so far are kept in {cache}; the same command resumes the precompute")
    for i in tqdm(todo, desc="precompute", disable=rank != 0):
        batch = collate([dataset[(i, 0)]])
        if "failed" in batch:
            raise DatasetError(f"precompute: {batch['failed'][0][1]}")
        torch.save(encode(batch), cache / "samples" / f"{i}.tmp")
        os.replace(cache / "samples" / f"{i}.tmp", cache / "samples" / f"{i}.pt")


# ---------------------------------------------------------------- batching and sharding


class BucketBatchSampler:
    """Deterministic global batches (lists of (index, seed)), every batch from one bucket.

    An epoch: each dataset's samples drawn `weight` times over (weight 0.5 = half of them, 2 = twice),
    shuffled with (seed, epoch), grouped by bucket, cut into full global batches, batches shuffled.
    A run's position needs no state: train_a2.global_batches replays the epochs up to the step."""

    def __init__(self, dataset: E2VDataset, global_batch_size: int, seed: int = 0, exclude=()):
        self.dataset, self.batch, self.seed = dataset, global_batch_size, seed
        self.exclude = frozenset(exclude)  # held-out samples (held_out): never in a batch
        self.epoch = 0
        counts: dict = {}
        for i, b in enumerate(dataset.buckets):
            if i not in self.exclude:
                counts[b] = counts.get(b, 0) + 1
        if not counts:
            raise ValueError("every sample is held out for evaluation: nothing left to train on")
        if max(counts.values()) < global_batch_size:
            raise ValueError(f"global batch {global_batch_size} (micro x accum x world) is larger than every bucket "
                             f"(largest has {max(counts.values())} samples): lower --micro-batch/--grad-accum or "
                             "the number of processes, or add data")

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def epoch_batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        rng = random.Random(self.seed * 1000003 + epoch)
        ds = self.dataset
        picks: list[int] = []
        for di, cfg in enumerate(ds.cfgs):
            mine = [i for i, s in enumerate(ds.samples) if s.dataset == di and i not in self.exclude]
            n = round(cfg.weight * len(mine))
            full, part = divmod(n, len(mine)) if mine else (0, 0)
            picks += mine * full + rng.sample(mine, part)
        rng.shuffle(picks)
        by_bucket: dict = {}
        for i in picks:
            by_bucket.setdefault(ds.buckets[i], []).append(i)
        batches = []
        for key in sorted(by_bucket, key=str):
            idx = by_bucket[key]
            batches += [idx[j:j + self.batch] for j in range(0, len(idx) - self.batch + 1, self.batch)]
        rng.shuffle(batches)
        return [[(i, rng.randrange(2**31)) for i in b] for b in batches]

    def __iter__(self):
        return iter(self.epoch_batches(self.epoch))


def rank_slice(global_batch: list, rank: int, world_size: int, micro_batch: int, accum: int) -> list[list]:
    """This rank's `accum` micro-batches: micro-step j of rank r takes positions
    [(j·world + r)·micro, +micro) of the global batch, so any split sees the same global batch."""
    if len(global_batch) != micro_batch * accum * world_size:
        raise ValueError(f"global batch of {len(global_batch)} != micro {micro_batch} x accum {accum} x world "
                         f"{world_size}")
    return [global_batch[(j * world_size + rank) * micro_batch:][:micro_batch] for j in range(accum)]


# ---------------------------------------------------------------- a synthetic dataset (tests and the demo)


def make_synthetic_dataset(root, num_samples: int = 4, num_frames: int = 17, size: tuple[int, int] = (64, 64),
                           seed: int = 0, elements: tuple[Element, ...] = A2_ELEMENTS) -> Path:
    """A tiny valid E2V dataset: a saturated square (subject) and disc (object), each 7/16 of the frame's short side,
    drift towards each other over a light, smoothly shaded background; each element image shows exactly what is in
    the video. The shapes are large and slow (an eighth of the short side over the clip) so that they survive a VAE
    that keeps 8x8-pixel, 4-frame means (the tiny model's): what a model learns from them can be seen."""
    import imageio.v3 as iio

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w]
    side = min(h, w)
    s, margin, drift = max(4, 7 * side // 16), side // 16, max(1, side // 8)

    def shapes(d: int) -> dict:  # element position -> (h, w) mask: the square's, the disc's, d pixels along their paths
        square = (yy >= margin) & (yy < margin + s) & (xx >= margin + d) & (xx < margin + d + s)
        disc = (xx + 0.5 - (w - margin - s / 2 - d)) ** 2 + (yy + 0.5 - (h - margin - s / 2)) ** 2 < (s / 2) ** 2
        return {0: square, 1: disc}

    for n in range(num_samples):
        sid = f"{n:03d}"
        tint = rng.uniform(-25, 25, 3)
        shade = np.sin(np.pi * xx / w)[..., None] * np.cos(np.pi * yy[..., None] / h + np.arange(3)) * 20  # (h, w, 3)
        bg = (200 + tint + shade).clip(0, 255).astype(np.uint8)
        # two different saturated colours: one channel high, one low, one anywhere (far from the light background)
        order = rng.permutation(3)
        colours = {0: np.zeros(3, np.int64), 1: np.zeros(3, np.int64)}  # the square's, the disc's
        colours[0][order] = (220, 30, rng.integers(30, 221))
        colours[1][np.roll(order, 1)] = (220, 30, rng.integers(30, 221))
        frames = []
        for t in range(num_frames):
            f = bg.copy()
            for position, mask in shapes(round(drift * t / max(1, num_frames - 1))).items():
                f[mask] = colours[position]
            frames.append(f)
        iio.imwrite(root / f"{sid}.mp4", np.stack(frames), fps=8, codec="libx264", plugin="pyav")
        (root / f"{sid}.txt").write_text(f"The video shows a square moving right while a disc moves left, scene {n}.")
        start = shapes(0)
        for e in elements:
            if e.position in start:  # the shape on white where the clip starts it: a reference the model can place
                img = np.full((h, w, 3), 255, np.uint8)
                img[start[e.position]] = colours[e.position]
            else:
                img = bg
            Image.fromarray(img).save(root / f"{sid}{e.suffixes[0]}")
    return root


def validate(a: Validate) -> E2VDataset:
    """`data.py validate`: what training reads with these flags (a --resolution typed beside a dataset config is
    held against it, as training holds it)."""
    cfgs = run_datasets(a)
    cfgs, layout, multiple = training_layout(a.model, a.data, cfgs)
    frames = layout.clip_frames if layout else clip_frames(a.data.num_frames, cfgs[0].elements, cfgs[0].vae)
    return E2VDataset(cfgs, frames, a.data.skip_bad_samples,
                      global_batch=a.optim.micro_batch * a.optim.grad_accum * a.world_size,
                      size_multiple=multiple, layout=layout)


def _cli(argv: list[str]):
    run_command(parse_cli(DataCommand, args=argv, description=__doc__))


def run_command(a) -> None:
    """A parsed `data.py COMMAND`: make-sample, validate, index or export-elements."""
    if isinstance(a, MakeSample):
        print(make_synthetic_dataset(a.out, a.num_samples, a.num_frames, (a.height, a.width)))
    elif isinstance(a, Validate):
        run_cli(validate, a)
    else:
        public_index.run(a)


if __name__ == "__main__":
    run_command(CLI_COMMAND)
