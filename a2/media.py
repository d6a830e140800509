"""A sample and its media: the Sample record and its problems, captions, reading video frames and a manifest's
rows. What data.py (the dataset) and a2/public_data.py (the public datasets' readers) both build on; it imports
neither."""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from a2.cli import InputError, printable, read_text
from a2.dataset_config import DatasetConfig
from a2.transformer import TEXT_TOKENS

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
    # public datasets (a2/public_data.py): the clip is frames start.. of the video, cropped to (x0, x1, y0, y1), and
    # each element image is built from refs[name] (a mask, box or image entry of the index)
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
