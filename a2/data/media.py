"""A sample and its media: the Sample record and its problems, captions, reading video frames (a video file or a
T2V-workflow .npz), which frames of a clip train (frame_indices, musubi-tuner's windows) and a manifest's rows. What
data.py (the dataset) and a2/data/public_read.py (the public datasets' readers) both build on; it imports neither."""

from __future__ import annotations

import csv
import io
import json
import math
import random
import re
import zipfile
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from a2.cli import InputError, printable, read_text
from a2.config.dataset_config import DatasetConfig
from a2.model.transformer import TEXT_TOKENS

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv")
DEFAULT_FRAME_BUCKETS = (17, 33, 49, 65, 81)
LLM_PREFIXES = (
    "the video shows", "the video depicts", "the video features", "the video captures", "the video showcases",
    "this video shows", "this video depicts", "in this video,", "in this video", "in the video,", "in the video",
    "the clip shows", "the scene shows", "the footage shows", "a video of", "a clip of",
)


class DatasetError(InputError):
    """Invalid dataset: the message lists every problem, one line each (Problem)."""


@dataclass(frozen=True)
class Problem:
    """One problem of one sample, printed `<id>: <file> (<where>): <what>`; where: the manifest line, if any.
    A warning is reported and the sample kept; any other problem makes the sample bad."""

    id: str
    file: object
    what: str
    where: str = ""
    warning: bool = False

    def __str__(self):
        where = f" ({self.where})" if self.where else ""
        return printable(f"{self.id}: {self.file}{where}: {self.what}")


def clean_caption(text: str) -> str:
    """Strip the boilerplate LLM captioners start with ("The video shows ...", "In this video, ...")."""
    text = " ".join(text.split())
    lowered = text.lower()
    for p in LLM_PREFIXES:
        if lowered.startswith(p):
            text = text[len(p):].lstrip(" ,:")
            return text[:1].upper() + text[1:]
    return text


def t5_tokens_at_least(text: str) -> int:
    """A lower bound of the prompt's T5 (umT5 SentencePiece) tokens without loading a tokenizer: every word and every
    punctuation mark is at least one token (rare and long words are several), plus the end-of-text token."""
    return len(re.findall(r"\w+|[^\w\s]", text)) + 1


def caption_problems(sid: str, text: str, file, where: str, cfg: DatasetConfig) -> tuple[str, list[Problem]]:
    """The prompt a caption trains as, and what is wrong with it."""
    prompt = clean_caption(text) if cfg.remove_common_llm_caption_prefixes else text.strip()
    if not prompt:
        what = ("empty caption" if not text.strip() else
                f"caption {text.strip()[:40]!r} is empty once the captioner's boilerplate is removed")
        return prompt, [Problem(sid, file, what, where)]
    n = t5_tokens_at_least(prompt)
    if n > TEXT_TOKENS:
        return prompt, [Problem(sid, file, f"caption has at least {n} T5 tokens; the text encoder reads the first "
                                           f"{TEXT_TOKENS}", where, warning=True)]
    return prompt, []


def open_video(path: Path):
    """av.open for reading. PyAV before 19 fails on a non-UTF-8 metadata tag (seen in OpenS2V) unless told to
    ignore it; PyAV 19 (Python 3.12+) dropped that option."""
    import av

    if int(av.__version__.split(".")[0]) < 19:
        return av.open(str(path), metadata_errors="ignore")
    return av.open(str(path))


def _decode(path: Path, last: int | None = None):
    """(index, av.VideoFrame) of the first video stream, up to index `last` (all when None)."""
    with open_video(path) as c:
        if not c.streams.video:
            raise ValueError("no video stream (an audio-only file?)")
        stream = c.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(c.decode(stream)):
            yield i, frame
            if last is not None and i >= last:
                return


def displayed(frame) -> np.ndarray:
    """A decoded frame as it is meant to be shown, (H, W, 3) uint8: the rotation of the display matrix applied (a
    portrait phone video is stored landscape with a 90 degree rotation)."""
    return np.rot90(frame.to_ndarray(format="rgb24"), k=round(frame.rotation / 90) % 4)


def probe_video(path: Path) -> tuple[int, tuple[int, int]]:
    """(frames the container lists, 0 if it does not; (H, W) as displayed), from the first decoded frame."""
    with open_video(path) as c:
        listed = int(c.streams.video[0].frames) if c.streams.video else 0
    for _, frame in _decode(path, 0):
        turned = round(frame.rotation / 90) % 2
        return listed, ((frame.width, frame.height) if turned else (frame.height, frame.width))
    raise ValueError("no frame decodes")


def read_frames(path: Path, indices: list[int]) -> np.ndarray:
    """Decode the frames at `indices` (may repeat) -> (len, H, W, 3) uint8 as displayed. PyAV, decoding up to the
    last."""
    want, got = set(indices), {}
    for i, frame in _decode(path, max(indices)):
        if i in want:
            got[i] = displayed(frame)
    missing = sorted(want - set(got))
    if missing:
        raise ValueError(f"could not decode frames {missing[:5]} (the file has fewer frames than it lists)")
    return np.stack([got[i] for i in indices])


def decodable_frames(path: Path, last: int | None = None) -> int:
    """How many of frames 0..last decode (all frames when last is None)."""
    return sum(1 for _ in _decode(path, last))


def npz_frames_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of a T2V-workflow clip's `frames`, read from the .npy header inside the zip (no frame
    is read), checked as read_npz checks the array: ValueError naming the fix."""
    with zipfile.ZipFile(path) as z:
        names = [n.removesuffix(".npy") for n in z.namelist()]
        if "frames" not in names:
            raise ValueError(f"no 'frames' array (it has {names})")
        with z.open("frames.npy") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read:  # 3.0 (utf-8 field names): no public header reader; read the array
                x = read_npz(path)
                return x.shape, x.dtype
            shape, _, dtype = read[version](f)
    _check_frames(shape, dtype)
    return shape, dtype


def _check_frames(shape: tuple[int, ...], dtype) -> None:
    if len(shape) == 4 and shape[1] == 3 and shape[-1] != 3:
        raise ValueError(f"frames are (F, 3, H, W) {shape}; store them (F, H, W, 3): frames.transpose(0, 2, 3, 1)")
    if len(shape) != 4 or shape[-1] != 3:
        raise ValueError(f"frames have shape {shape}; expected (F, H, W, 3)")
    if dtype != np.uint8:  # float frames would be cast to black/garbage; their range (0..1? -1..1?) is a guess
        raise ValueError(f"frames are {dtype}; store uint8 0..255 (from floats in [0, 1]: "
                         "(frames * 255).round().astype(np.uint8))")


def read_npz(path: Path) -> np.ndarray:
    """The `frames` of a T2V-workflow clip, checked: (F, H, W, 3) uint8, else ValueError naming the fix."""
    with np.load(path) as z:  # no pickles: allow_pickle stays False
        if "frames" not in z.files:
            raise ValueError(f"no 'frames' array (it has {z.files})")
        x = z["frames"]
    _check_frames(x.shape, x.dtype)
    return x


def read_clip(path: Path, indices: list[int]) -> np.ndarray:
    """Frames `indices` of a video or .npz clip -> (len, H, W, 3) uint8."""
    return read_npz(path)[indices] if path.suffix.lower() == ".npz" else read_frames(path, indices)


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


def last_frame_read(total: int, num_frames: int, sampling: str) -> int:
    """The highest frame index training can ask a clip of `total` frames for."""
    return total - 1 if sampling == "random" else max(frame_indices(total, num_frames, sampling))


def resampled_frames(total: int, source_fps: float | None, target_fps: float) -> list[int]:
    """The source frames a `source_fps` clip keeps at `target_fps` (musubi-tuner's rule): source frame i falls on output
    frame floor(i * target / source), and the first source frame of each output frame is kept, the rest dropped. Exact
    rational arithmetic (musubi adds up the float ratio). No source fps, or a target at or above it: every frame (no
    frame is repeated to raise the rate)."""
    if not source_fps or target_fps >= source_fps:
        return list(range(total))
    ratio = Fraction(str(target_fps)) / Fraction(str(source_fps))
    out, last = [], -1
    for i in range(total):
        n = math.floor(i * ratio)
        if n != last:
            out.append(i)
            last = n
    return out


def frame_windows(total: int, frames: int, cfg: DatasetConfig) -> list[tuple[int, ...]]:
    """--frame-extraction head | chunk | slide | uniform: the source frame indices of each training window of `frames`
    frames in a clip of `total` frames, after resampled_frames, as musubi-tuner's video dataset cuts them: head the
    first window; chunk back-to-back windows (a last partial one dropped); slide a window every frame_stride frames;
    uniform frame_sample windows with starts evenly spaced from the first to the last possible one
    (np.linspace(0, n - frames, frame_sample) as int, so short clips repeat starts, as musubi does; frame_sample 1:
    head, as musubi switches it). None fits: []."""
    src = resampled_frames(total, cfg.source_fps, cfg.target_fps)
    n = len(src)
    if n < frames:
        return []
    mode = "head" if cfg.frame_extraction == "uniform" and cfg.frame_sample == 1 else cfg.frame_extraction
    starts = {"head": [0], "chunk": range(0, n - frames + 1, frames),
              "slide": range(0, n - frames + 1, cfg.frame_stride),
              "uniform": np.linspace(0, n - frames, cfg.frame_sample, dtype=int).tolist()}[mode]
    return [tuple(src[s:s + frames]) for s in starts]


def frame_buckets(cfg: DatasetConfig, num_frames: int) -> tuple[int, ...]:
    """Clip lengths a dataset trains with: num_frames, or with auto_frame_buckets each bucket up to it."""
    if not cfg.auto_frame_buckets:
        return (num_frames,)
    return tuple(f for f in (cfg.frame_buckets or DEFAULT_FRAME_BUCKETS) if f <= num_frames) or (num_frames,)


def clip_length(cfg: DatasetConfig, num_frames: int, total: int) -> int:
    """Frames a clip of `total` frames trains with: the largest of its dataset's buckets it fills (0: none)."""
    return max((f for f in frame_buckets(cfg, num_frames) if f <= total), default=0)


@dataclass
class Sample:
    id: str
    dataset: int  # index into the run's dataset configs
    video: Path
    prompt: str  # the caption as trained (decoded, boilerplate removed)
    elements: dict[str, Path] = field(default_factory=dict)  # element name -> image
    mask: Path | None = None  # a VACE run's masked clip: <id>_vace_mask.png, white where VACE generates (data.py)
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # element name -> its image's (width, height)
    num_frames: int = 0
    size: tuple[int, int] = (0, 0)  # (H, W) of the source video as displayed
    where: str = ""  # its manifest line, for messages
    problems: list[Problem] = field(default_factory=list)
    # public datasets (a2/data/public_read.py): the clip is frames start.. of the video, cropped to (x0, x1, y0, y1),
    # and each element image is built from refs[name] (a mask, box or image entry of the index)
    start: int = 0
    crop: tuple | None = None
    refs: dict = field(default_factory=dict)
    cluster: str | None = None  # OpenS2V's cross-video cluster
    # --frame-extraction other than spread: the source frames of each window (check_sample); one each once scan has
    # made every window a sample of its own
    windows: tuple[tuple[int, ...], ...] = ()

    @property
    def bad(self) -> bool:
        return any(not p.warning for p in self.problems)


def _manifest_rows(path: Path) -> list[tuple[int, dict | None, str]]:
    """(line, row with stripped lower-case keys or None, why not): CSV (any of , ; tab as Excel writes them) or
    JSONL."""
    try:
        text = read_text(path)
    except ValueError as e:
        raise DatasetError(f"{path}: manifest is {e}") from None
    if path.suffix.lower() in (".csv", ".tsv"):
        header = text.split("\n", 1)[0]
        reader = csv.DictReader(io.StringIO(text), delimiter=max(",;\t", key=header.count))
        return [(reader.line_num, {k.strip().lower(): v.strip() for k, v in r.items() if isinstance(k, str)
                                   and isinstance(v, str)}, "") for r in reader]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            rows.append((n, None, f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        rows.append((n, {str(k).strip().lower(): v for k, v in r.items()}, "") if isinstance(r, dict)
                    else (n, None, f"expected a JSON object, got {type(r).__name__}"))
    return rows


def manifest_samples(path: Path, problems: list[Problem], sample, invalid: str, columns: tuple = ()) -> list[Sample]:
    """The samples of a manifest (_manifest_rows), one a row: sample(row, n, where) makes row n's (None: the row names
    no clip, a problem `invalid` of its line). A repeated id is a problem of the later sample; columns: the manifest
    must have one of them (a DatasetError naming the columns it has)."""
    rows = _manifest_rows(path)
    if columns and rows and not any(r and set(columns) & set(r) for _, r, _ in rows):
        raise DatasetError(f"{path}: no {columns[0]!r} (or {columns[1]!r}) column; its columns: "
                           f"{sorted({k for _, r, _ in rows if r for k in r})}")
    out, first = [], {}
    for n, r, why in rows:
        s = sample(r, n, f"{path.name} line {n}") if r else None
        if s is None:
            problems.append(Problem("-", path, why or invalid, f"line {n}"))
            continue
        if s.id in first:
            s.problems.append(Problem(s.id, s.video, f"duplicate id (first on line {first[s.id]})", s.where))
        first.setdefault(s.id, n)
        out.append(s)
    return out
