"""E2V data: scan and validate a dataset, load clips and element images, bucket and shard batches.

A sample id links `<id>.mp4` (or .webm/.mov/.mkv), `<id>.txt` (the prompt) and element images
`<id><suffix>` (config.Element). Also read: a manifest (CSV or JSONL with `video` and `caption`
columns, plus optional element-name columns) and the T2V workflow's `train.jsonl` of `.npz` clips
(uint8 frames under key `frames`, prompt under `prompt`).

    python data.py make-sample sample_data          # a tiny synthetic E2V dataset (no downloads)
    python data.py validate --data-root DIR [--elements ...]
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from PIL import Image

from a2.pipeline import element_tensors
from a2.transformer import TEXT_TOKENS
from config import A2_ELEMENTS, DatasetConfig, Element, parse_elements

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv")
DEFAULT_FRAME_BUCKETS = (17, 33, 49, 65, 81)
ASPECTS = (9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9)  # h / w of the aspect buckets
LLM_PREFIXES = (
    "the video shows", "the video depicts", "the video features", "the video captures", "the video showcases",
    "this video shows", "this video depicts", "in this video,", "in this video", "in the video,", "in the video",
    "the clip shows", "the scene shows", "the footage shows", "a video of", "a clip of",
)


class DatasetError(ValueError):
    """Invalid dataset: the message lists every problem as `<id>: <file>: <problem>`."""


def clean_caption(text: str) -> str:
    """Strip the boilerplate LLM captioners start with ("The video shows ...", "In this video, ...")."""
    text = " ".join(text.split())
    lowered = text.lower()
    for p in LLM_PREFIXES:
        if lowered.startswith(p):
            text = text[len(p):].lstrip(" ,:")
            return text[:1].upper() + text[1:]
    return text


# ---------------------------------------------------------------- video decoding


def video_num_frames(path: Path) -> int:
    """Frame count from the container, decoding only when it does not say."""
    import av

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        if s.frames:
            return int(s.frames)
        return sum(1 for _ in c.decode(video=0))


def read_frames(path: Path, indices: list[int]) -> np.ndarray:
    """Decode the frames at `indices` (sorted, may repeat) -> (len, H, W, 3) uint8. PyAV, decoding up to the last."""
    import av

    want = sorted(set(indices))
    got: dict[int, np.ndarray] = {}
    with av.open(str(path)) as c:
        c.streams.video[0].thread_type = "AUTO"
        for i, frame in enumerate(c.decode(video=0)):
            if i in want:
                got[i] = frame.to_ndarray(format="rgb24")
            if i >= want[-1]:
                break
    missing = [i for i in want if i not in got]
    if missing:
        raise ValueError(f"{path}: could not decode frames {missing[:5]} (file has fewer frames than it claims)")
    return np.stack([got[i] for i in indices])


def frame_indices(total: int, num_frames: int, sampling: str, rng: random.Random | None = None) -> list[int]:
    """uniform: spread over the whole clip (stride = total/num_frames, ≥ 1); head: the first num_frames;
    random: a window of consecutive frames at a random start."""
    if total < num_frames:
        raise ValueError(f"clip has {total} frames, needs {num_frames}")
    if sampling == "head":
        return list(range(num_frames))
    if sampling == "random":
        start = (rng or random).randint(0, total - num_frames)
        return list(range(start, start + num_frames))
    if sampling == "uniform":
        return [int(i * total / num_frames) for i in range(num_frames)]
    raise ValueError(f"unknown frame sampling {sampling!r}")


def resize_frames(frames: np.ndarray, mode: str, size: tuple[int, int]) -> torch.Tensor:
    """(F, H, W, 3) uint8 -> (3, F, h, w) float in [-1, 1], framed like a2.pipeline.preprocess_image.

    Resizes in uint8, channels-last: PyTorch's vectorised uint8 bicubic kernel is ~50x faster than the float one
    (81 frames to 480x832: 0.1 s vs 4-5 s on one core) and differs from it only by the final rounding."""
    h, w = size
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)  # (F, 3, H, W) uint8, channels-last in memory
    ih, iw = x.shape[-2:]

    def resize(rh, rw):
        return F.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True, align_corners=False)

    if mode == "resize":
        x = resize(h, w)
    elif mode == "center_crop":
        s = max(h / ih, w / iw)
        rh, rw = max(h, round(ih * s)), max(w, round(iw * s))
        top, left = (rh - h) // 2, (rw - w) // 2
        x = resize(rh, rw)[..., top:top + h, left:left + w]
    else:  # pad_white / letterbox
        s = min(h / ih, w / iw)
        rh, rw = min(h, max(1, round(ih * s))), min(w, max(1, round(iw * s)))
        canvas = torch.full((x.shape[0], 3, h, w), 255 if mode == "pad_white" else 0, dtype=torch.uint8)
        top, left = (h - rh) // 2, (w - rw) // 2
        canvas[..., top:top + rh, left:left + rw] = resize(rh, rw)
        x = canvas
    x = x.permute(1, 0, 2, 3).contiguous()  # (3, F, h, w), rearranged while still 1 byte per value
    return x.to(torch.float32).mul_(2 / 255).sub_(1)


# ---------------------------------------------------------------- scanning and validation


@dataclass
class Sample:
    id: str
    dataset: int  # index into the run's dataset configs
    video: Path
    caption: str
    elements: dict[str, Path] = field(default_factory=dict)  # element name -> image
    num_frames: int = 0
    size: tuple[int, int] = (0, 0)  # (H, W) of the source video


def _scan_dir(root: Path, elements: tuple[Element, ...], problems: list[str]) -> list[tuple[str, Path, str, dict]]:
    out = []
    for video in sorted(p for p in root.iterdir() if p.suffix.lower() in VIDEO_EXTS):
        sid = video.stem
        cap = root / f"{sid}.txt"
        caption = cap.read_text(errors="replace").strip() if cap.exists() else ""
        if not cap.exists():
            problems.append(f"{sid}: {cap}: caption file missing")
        found = {}
        for e in elements:
            matches = [root / f"{sid}{s}" for s in e.suffixes if (root / f"{sid}{s}").exists()]
            if len(matches) > 1:
                problems.append(f"{sid}: {', '.join(map(str, matches))}: several files match element '{e.name}'")
            if matches:
                found[e.name] = matches[0]
        out.append((sid, video, caption, found))
    return out


def _scan_manifest(path: Path, elements: tuple[Element, ...]) -> list[tuple[str, Path, str, dict]]:
    rows = (list(csv.DictReader(path.open())) if path.suffix.lower() == ".csv"
            else [json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    out = []
    for i, r in enumerate(rows):
        video = r.get("video") or r.get("path") or r.get("file")
        if video is None:
            raise DatasetError(f"{path}: row {i}: no 'video' (or 'path') column")
        video = Path(video) if Path(video).is_absolute() else path.parent / video
        caption = r.get("caption") or r.get("prompt") or r.get("text") or ""
        found = {e.name: path.parent / r[e.name] for e in elements if r.get(e.name)}
        out.append((r.get("id") or video.stem, video, str(caption), found))
    return out


def scan(cfgs: list[DatasetConfig], min_frames: int) -> tuple[list[Sample], list[str]]:
    """Every sample of every dataset, and every problem found (`<id>: <file>: <problem>`)."""
    samples, problems = [], []
    for di, cfg in enumerate(cfgs):
        root = Path(cfg.data_root)
        manifest = Path(cfg.manifest) if cfg.manifest else None
        if manifest is None and not root.is_dir():
            raise DatasetError(f"{root}: data_root is not a directory")
        if manifest is not None and not manifest.is_absolute():
            manifest = root / manifest
        found = _scan_manifest(manifest, cfg.elements) if manifest else _scan_dir(root, cfg.elements, problems)
        if not found:
            problems.append(f"-: {manifest or root}: no samples (videos {VIDEO_EXTS} or manifest rows)")
        for sid, video, caption, elems in found:
            bad = False
            if not caption.strip():
                problems.append(f"{sid}: {video.with_suffix('.txt')}: empty caption")
                bad = True
            for e in cfg.elements:
                if e.required and e.name not in elems:
                    problems.append(f"{sid}: {root / (sid + e.suffixes[0])}: required element '{e.name}' missing")
                    bad = True
            for name, img in elems.items():
                try:
                    with Image.open(img) as im:
                        im.verify()
                except Exception as ex:
                    problems.append(f"{sid}: {img}: unreadable image for element '{name}' ({ex})")
                    bad = True
            n, size = 0, (0, 0)
            try:
                if video.suffix == ".npz":
                    with np.load(video) as z:
                        n, size = z["frames"].shape[0], tuple(z["frames"].shape[1:3])
                else:
                    n = video_num_frames(video)
                    size = read_frames(video, [0]).shape[1:3]
            except Exception as ex:
                problems.append(f"{sid}: {video}: unreadable video ({ex})")
                bad = True
            if n and n < min_frames:
                problems.append(f"{sid}: {video}: {n} frames, shorter than the smallest bucket ({min_frames})")
                bad = True
            samples.append(Sample(sid, di, video, caption, elems, -1 if bad else n, tuple(size)))  # -1: bad
    return samples, problems


# ---------------------------------------------------------------- the dataset


class E2VDataset(torch.utils.data.Dataset):
    """Samples for training. Items are picked by (index, seed) pairs from BucketBatchSampler so that
    random frame windows are a function of the data order seed, not of the worker.

    num_frames: the clip length (train_a2.py derives it from the layout); with auto_frame_buckets a
    shorter clip goes to the largest 4k+1 bucket it fills."""

    def __init__(self, cfgs: list[DatasetConfig], num_frames: int, skip_bad_samples: bool = False,
                 frame_sampling: str = "uniform", verbose: bool = True):
        self.cfgs, self.num_frames, self.frame_sampling = cfgs, num_frames, frame_sampling
        # set to a precompute cache dir (train_a2.py --cache-dir): items then hold the encoders' outputs, not pixels
        self.cache_dir: Path | None = None
        buckets = sorted({f for c in cfgs for f in self.frame_buckets(c)})
        samples, problems = scan(cfgs, min_frames=buckets[0])
        bad = [s for s in samples if s.num_frames < 0]
        if problems and not skip_bad_samples:
            raise DatasetError(f"{len(problems)} problem(s) in the dataset:\n  " + "\n  ".join(problems)
                               + "\n(--skip-bad-samples drops these samples instead)")
        self.samples = [s for s in samples if s.num_frames >= 0]
        if verbose:
            self.summary(skipped=len(bad), problems=problems)
        if not self.samples:
            raise DatasetError("no valid samples left in " + ", ".join(c.data_root for c in cfgs))
        self.buckets = [self.bucket_of(s) for s in self.samples]

    def frame_buckets(self, cfg: DatasetConfig) -> tuple[int, ...]:
        if not cfg.auto_frame_buckets:
            return (self.num_frames,)
        return tuple(f for f in (cfg.frame_buckets or DEFAULT_FRAME_BUCKETS) if f <= self.num_frames) or (
            self.num_frames,)

    def summary(self, skipped: int, problems: list[str]):
        n = len(self.samples)
        print(f"dataset: {n} samples from {len(self.cfgs)} dataset(s)" + (f"; skipped {skipped} bad sample(s)"
                                                                            if skipped else ""))
        for p in problems if skipped else ():
            print(f"  skipped: {p}")
        for di, c in enumerate(self.cfgs):
            mine = [s for s in self.samples if s.dataset == di]
            cover = ", ".join(f"{e.name} {sum(e.name in s.elements for s in mine)}/{len(mine)}" for e in c.elements)
            print(f"  {c.data_root}: {len(mine)} samples" + (f"; elements: {cover}" if cover else ""))

    def bucket_of(self, s: Sample) -> tuple:
        """(frames, H, W, element names): what every sample of a batch shares."""
        cfg = self.cfgs[s.dataset]
        frames = max(f for f in self.frame_buckets(cfg) if f <= s.num_frames) if cfg.auto_frame_buckets \
            else self.num_frames
        h, w = cfg.target_resolution
        if cfg.auto_frame_buckets and s.size[0] and s.size[1]:  # aspect buckets at about the target's area
            area, ar = h * w, s.size[0] / s.size[1]
            best = min(ASPECTS, key=lambda a: abs(np.log(a / ar)))
            h, w = (max(16, round((area * best) ** 0.5 / 16) * 16), max(16, round((area / best) ** 0.5 / 16) * 16))
        names = tuple(e.name for e in cfg.elements if e.name in s.elements)
        return (frames, h, w, names)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, item):
        idx, seed = item if isinstance(item, tuple) else (item, 0)
        s, (frames, h, w, names) = self.samples[idx], self.buckets[idx]
        cfg = self.cfgs[s.dataset]
        if self.cache_dir:
            c = torch.load(self.cache_dir / "samples" / f"{idx}.pt", weights_only=True)
            text = c["text"].new_zeros(TEXT_TOKENS, c["text"].shape[-1])
            text[:len(c["text"])] = c["text"]  # stored trimmed to its tokens; the rest of 512 is exact zeros
            elements = [e for e in cfg.elements if e.name in names]
            return dict(id=s.id, prompt=c["prompt"], posteriors=c["posteriors"], text=text, clip=c.get("clip"),
                        element_names=names, repeats=tuple(e.repeat for e in elements), bucket=(frames, h, w, names),
                        video_shape=(3, frames, h, w), ref_shape=(len(elements), 3, h, w))
        ids = frame_indices(s.num_frames, frames, self.frame_sampling, random.Random(seed))
        if s.video.suffix == ".npz":
            with np.load(s.video) as z:
                raw = z["frames"][ids]
        else:
            raw = read_frames(s.video, ids)
        video = resize_frames(raw, cfg.reshape_mode, (h, w))  # (3, F, H, W)
        elements = [e for e in cfg.elements if e.name in names]
        vae, clip = [], []
        for e in elements:
            with Image.open(s.elements[e.name]) as im:
                v, c = element_tensors(im.convert("RGB"), e, (h, w), tuple(cfg.clip.resolution))
            vae.append(v)
            clip.append(c)
        ch, cw = cfg.clip.resolution
        prompt = clean_caption(s.caption) if cfg.remove_common_llm_caption_prefixes else s.caption
        return dict(id=s.id, video=video, prompt=prompt, element_names=names,
                    repeats=tuple(e.repeat for e in elements),
                    ref_vae=torch.stack(vae) if vae else torch.zeros(0, 3, h, w),
                    ref_clip=torch.stack(clip) if clip else torch.zeros(0, 3, ch, cw),
                    bucket=(frames, h, w, names))


def collate(items: list[dict]) -> dict:
    b0 = items[0]["bucket"]
    if any(it["bucket"] != b0 for it in items):
        raise ValueError(f"a batch mixes buckets: {[it['bucket'] for it in items]}")
    if "posteriors" in items[0]:  # from the precompute cache
        n = len(items)
        return dict(ids=[it["id"] for it in items], prompts=[it["prompt"] for it in items],
                    posteriors=[torch.stack([it["posteriors"][k] for it in items])
                                for k in range(len(items[0]["posteriors"]))],  # per VAE encode: (B, 32, T, h, w)
                    text=torch.stack([it["text"] for it in items]),  # (B, 512, D)
                    clip=None if items[0]["clip"] is None else torch.stack([it["clip"] for it in items]),
                    video_shape=(n, *items[0]["video_shape"]), ref_shape=(n, *items[0]["ref_shape"]),
                    element_names=items[0]["element_names"], repeats=items[0]["repeats"])
    return dict(ids=[it["id"] for it in items], prompts=[it["prompt"] for it in items],
                video=torch.stack([it["video"] for it in items]),  # (B, 3, F, H, W)
                ref_vae=torch.stack([it["ref_vae"] for it in items]),  # (B, N, 3, H, W)
                ref_clip=torch.stack([it["ref_clip"] for it in items]),  # (B, N, 3, h, w)
                element_names=items[0]["element_names"], repeats=items[0]["repeats"])


# ---------------------------------------------------------------- precompute cache (train_a2.py --precompute)


def cache_key(model_dir: Path, image_src: Path | None, dataset: E2VDataset, clip_frames: int, dtype: str,
              e2v_type: str, prefix_frames: int) -> str:
    """Name of the precompute cache: a hash of everything the encodings depend on (encoder files, every data
    file, captions, the dataset/processor configs, clip length, layout, dtype). Any change -> a new dir."""
    def stat(p: Path):
        st = p.stat()
        return [str(p.resolve()), st.st_size, st.st_mtime_ns]

    dirs = [model_dir / d for d in ("vae", "text_encoder", "tokenizer")]
    dirs += [image_src / d for d in ("image_encoder", "image_processor")] if image_src else []
    key = dict(version=1, encoders=[stat(f) for d in dirs for f in sorted(d.rglob("*")) if f.is_file()],
               datasets=[asdict(c) for c in dataset.cfgs], clip_frames=clip_frames, dtype=dtype,
               frame_sampling=dataset.frame_sampling, e2v_type=e2v_type, prefix_frames=prefix_frames,
               samples=[[stat(s.video), s.caption, {k: stat(Path(v)) for k, v in s.elements.items()}]
                        for s in dataset.samples])
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_cache(cache: Path, dataset: E2VDataset, encode, rank: int = 0, world: int = 1):
    """Encode this rank's share of the samples into cache/samples/<index>.pt (skipping those already there, so a
    killed precompute resumes); `encode(batch) -> dict` runs the encoders on a one-sample batch."""
    from tqdm import tqdm

    if dataset.frame_sampling == "random":
        raise DatasetError("a precompute cache holds one clip per sample: use uniform or head frame sampling")
    (cache / "samples").mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(rank, len(dataset), world) if not (cache / "samples" / f"{i}.pt").exists()]
    for i in tqdm(todo, desc="precompute", disable=rank != 0):
        torch.save(encode(collate([dataset[(i, 0)]])), cache / "samples" / f"{i}.tmp")
        os.replace(cache / "samples" / f"{i}.tmp", cache / "samples" / f"{i}.pt")


# ---------------------------------------------------------------- batching and sharding


class BucketBatchSampler:
    """Deterministic global batches (lists of (index, seed)), every batch from one bucket.

    An epoch: each dataset's samples drawn `weight` times over (weight 0.5 = half of them, 2 = twice),
    shuffled with (seed, epoch), grouped by bucket, cut into full global batches, batches shuffled.
    The position (epoch, batches consumed) is saved and restored exactly with state_dict()."""

    def __init__(self, dataset: E2VDataset, global_batch_size: int, seed: int = 0):
        self.dataset, self.batch, self.seed = dataset, global_batch_size, seed
        self.epoch, self.consumed = 0, 0
        counts: dict = {}
        for b in dataset.buckets:
            counts[b] = counts.get(b, 0) + 1
        if max(counts.values()) < global_batch_size:
            raise ValueError(f"global batch {global_batch_size} (micro x accum x world) is larger than every bucket "
                             f"(largest has {max(counts.values())} samples): lower --micro-batch/--grad-accum or "
                             "the number of processes, or add data")

    def set_epoch(self, epoch: int):
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def epoch_batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        rng = random.Random(self.seed * 1000003 + epoch)
        ds = self.dataset
        picks: list[int] = []
        for di, cfg in enumerate(ds.cfgs):
            mine = [i for i, s in enumerate(ds.samples) if s.dataset == di]
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
        batches = self.epoch_batches(self.epoch)
        while self.consumed < len(batches):
            self.consumed += 1
            yield batches[self.consumed - 1]

    def __len__(self):
        return len(self.epoch_batches(self.epoch))

    def state_dict(self) -> dict:
        return dict(epoch=self.epoch, consumed=self.consumed, seed=self.seed)

    def load_state_dict(self, state: dict):
        self.epoch, self.consumed, self.seed = state["epoch"], state["consumed"], state["seed"]


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
    """A tiny valid E2V dataset: a coloured square (subject) and disc (object) move over a textured
    background; each element image shows exactly what is in the video."""
    import imageio.v3 as iio

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w]
    for n in range(num_samples):
        sid = f"{n:03d}"
        bg = (np.stack([np.sin(xx / (3 + n) + k) * np.cos(yy / (4 + k)) for k in range(3)], -1) * 60 + 110)
        bg = (bg + rng.uniform(-40, 40, 3)).clip(0, 255).astype(np.uint8)
        c1, c2 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        s = max(4, h // 5)
        frames = []
        for t in range(num_frames):
            f = bg.copy()
            x0 = int((w - s) * t / max(1, num_frames - 1))
            f[h // 4:h // 4 + s, x0:x0 + s] = c1
            cx, cy = w - 1 - x0 - s // 2, 3 * h // 4
            f[(xx - cx) ** 2 + (yy - cy) ** 2 < (s // 2) ** 2] = c2
            frames.append(f)
        iio.imwrite(root / f"{sid}.mp4", np.stack(frames), fps=8, codec="libx264", plugin="pyav")
        (root / f"{sid}.txt").write_text(f"The video shows a square moving right while a disc moves left, scene {n}.")
        shapes = {0: ("square", c1), 1: ("disc", c2)}
        for e in elements:
            if e.position in shapes:
                img = np.full((2 * s, 2 * s, 3), 255, np.uint8)
                if shapes[e.position][0] == "square":
                    img[s // 2:s // 2 + s, s // 2:s // 2 + s] = c1
                else:
                    yy2, xx2 = np.mgrid[0:2 * s, 0:2 * s]
                    img[(xx2 - s) ** 2 + (yy2 - s) ** 2 < (s // 2) ** 2] = c2
            else:
                img = bg
            Image.fromarray(img).save(root / f"{sid}{e.suffixes[0]}")
    return root


@dataclass
class MakeSample:
    """Write a tiny synthetic E2V dataset (videos, captions, element images)."""

    out: tyro.conf.Positional[str]
    num_samples: int = 4
    num_frames: int = 33
    height: int = 64
    width: int = 64


@dataclass
class Validate:
    """Scan and validate a dataset, print the summary and every problem."""

    data_root: str | None = None
    dataset_config: str | None = None
    elements: tuple[str, ...] = ()
    num_frames: int = 17
    skip_bad_samples: bool = False


def _cli(argv: list[str]):
    if argv and argv[0] == "make-sample":
        a = tyro.cli(MakeSample, args=argv[1:])
        print(make_synthetic_dataset(a.out, a.num_samples, a.num_frames, (a.height, a.width)))
    elif argv and argv[0] == "validate":
        from config import load_dataset_config

        a = tyro.cli(Validate, args=argv[1:])
        cfgs = (load_dataset_config(a.dataset_config) if a.dataset_config else
                [DatasetConfig(a.data_root, elements=parse_elements(a.elements) if a.elements else A2_ELEMENTS)])
        E2VDataset(cfgs, a.num_frames, a.skip_bad_samples)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    _cli(sys.argv[1:])
