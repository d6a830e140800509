"""The dataset config: the video sizes a run takes, the conditioning flags (ConditioningConfig, a dataset file's
processors.vae), the VAE, CLIP and visualization settings of a dataset, and the JSON dataset file (docs/dataset.md)
read into DatasetConfigs (load_dataset_config); the data section of a training run (DataConfig) and its datasets
(dataset_configs: of its flags or its file). config.py's TrainConfig and InferConfig take ConditioningConfig's flags.
It imports tyro, the standard library and a2/cli.py, a2/elements.py only."""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from types import UnionType
from typing import Annotated, Literal, Union, get_args, get_origin, get_type_hints

import tyro

from a2.cli import ConfigError, help_from_docstrings, read_text
from a2.elements import A2_ELEMENTS, PREPROCESS_MODES, Element, check_elements, parse_elements

# ---------------------------------------------------------------- video sizes


def height_width(height: int | None, width: int | None, resolution: tuple[int, int] | None,
                 default: tuple[int, int]) -> tuple[int, int]:
    """The video size from --height/--width or --resolution H W (train_a2.py's name for it; infer.py and bench.py
    take both forms): whichever is given, `default` for what is not; the two forms must agree, and what is given is
    a positive multiple of 16 (said before the heavy imports)."""
    if resolution is not None:
        if any(v is not None and v != r for v, r in zip((height, width), resolution)):
            raise ConfigError(f"--resolution {resolution[0]} {resolution[1]} and --height {height} --width {width} "
                              "disagree: give one of them")
    flags = (f"--resolution {resolution[0]} {resolution[1]}" if resolution is not None else
             " ".join(f"--{k} {v}" for k, v in (("height", height), ("width", width)) if v is not None))
    check_sides(flags, [v for v in (resolution or (height, width)) if v is not None])  # a Wan 2.2 VAE's 32: later
    if resolution is not None:
        return tuple(resolution)
    return (default[0] if height is None else height, default[1] if width is None else width)


def check_frames(num_frames: int, flag: str = "--num-frames") -> None:
    """The frame counts a Wan VAE takes: 4k+1 (its time stride is 4: one latent frame, then one per 4)."""
    if num_frames < 1 or (num_frames - 1) % 4:
        near = max(1, (num_frames - 1) // 4 * 4 + 1)
        raise ConfigError(f"{flag} {num_frames}: num_frames must be 4k+1 (e.g. 17, 49, 81), got {num_frames}; "
                          f"the nearest: {near} or {near + 4}")


def check_sides(what: str, sides, multiple: int = 16) -> None:
    """Video sides a Wan model's grid takes: positive multiples of `multiple` = VAE x patch (Wan 2.1: 8 x 2 = 16, Wan
    2.2 TI2V-5B: 16 x 2 = 32; every model's is a multiple of 16), else a ConfigError naming `what` (the flags, a dataset
    file's key): one line, exit 2 under run_cli."""
    if any(v <= 0 or v % multiple for v in sides):
        raise ConfigError(f"{what}: height and width must be positive multiples of {multiple}, got "
                          f"{'x'.join(map(str, sides))}")


def check_size(height: int, width: int, num_frames: int, multiple: int = 16) -> None:
    """The shapes a Wan model can take: H, W (check_sides), F = 4k+1."""
    check_sides(f"--resolution {height} {width}", (height, width), multiple)
    check_frames(num_frames)


# ---------------------------------------------------------------- the conditioning and the dataset


@dataclass(frozen=True)
class ConditioningConfig:
    """How element images and video frames condition the transformer. train_a2.py and infer.py take these flags, a
    dataset JSON file the same keys in processors.vae; a2.plan.plan_layout decides the run's kind from them once."""

    reference_layout: Literal["channel", "incontext", "magref", "standin"] = "channel"
    """Where the element images enter the transformer. channel: A2's mask and reference latents on the channel axis
    (36-channel A2 / Wan I2V models, or a T2V base expanded in full). incontext: each element VAE-encoded alone, its
    clean latents appended after the video latents on the time axis, as Phantom-Wan and SkyReels-V3 R2V do (a T2V
    model trains as it is; --num-frames then counts the video alone). magref: MAGREF's layout on a Wan I2V model,
    the elements pasted on one white canvas that is the I2V first frame and the CLIP image (--num-frames counts the
    canvas frame; sampling drops its first 4 frames, as MAGREF does). standin: Stand-In's reference tokens on a Wan
    T2V model, one face crop framed to 512x512 whatever the video's size (infer.py loads its file with --lora). A
    released model (Phantom-Wan, SkyReels-V3, MAGREF, RefAlign) and a Stand-In LoRA file choose their own."""
    reference_timestep: Literal["shared", "zero"] = "shared"
    """The timestep of in-context reference tokens: shared gives them the sample's (Phantom-Wan, SkyReels-V3), zero
    marks them clean (per-token timesteps, as Wan 2.2 TI2V)."""
    combine: Literal["before", "after"] = "before"
    """How the element images are VAE-encoded: before encodes them as one mini-video (A2), after encodes each alone
    and concatenates the latents."""
    frame_conditioning: Literal["full", "first", "first_and_last", "index", "prefix", "random"] = "full"
    """What conditions the video. full: the element images (A2's references, or the reference layout's). The others
    give frames of the video itself, as Wan I2V and FLF2V do: the first, the first and last, the one at
    --frame-index, the first --prefix-frames, or a random one. infer.py takes full, or first with --image (TI2V-5B)."""
    frame_index: int = 0
    """The 0-based pixel frame of the video that --frame-conditioning index gives as the condition."""
    prefix_frames: int = 1
    """How many leading pixel frames of the video --frame-conditioning prefix gives as the condition."""
    concatenate_mask: bool = True
    """Whether the 4-channel mask goes between the noisy and the condition latents (the 36-channel input). The
    channel kinds need it (off is refused, with the reason); the others have no mask to concatenate."""
    vace_scale: float = 1.0
    """The conditioning scale of a VACE model's context blocks: each hint is added to its block's output times this
    (Wan's context_scale, diffusers' conditioning_scale; 1 as both sample by default), in training and sampling."""
    vae_sample_mode: Annotated[Literal["sample", "argmax"] | None, tyro.conf.arg(aliases=("--sample-mode",))] = None
    """How the references and the condition are VAE-encoded: a posterior sample (from the sample's generator) or the
    posterior mode (argmax). Left out, each kind encodes as its lab samples: A2 and SkyReels-V3 sample; diffusers' Wan
    I2V, Phantom-Wan, MAGREF and Stand-In take the mean. Training encodes as sampling does."""


def kind_of(c: ConditioningConfig, elements, ti2v: bool = False) -> str:
    """The conditioning kind (a2/kinds/kinds.py: KIND_DEFS) that the flags or a dataset file's processors.vae `c`
    ask for, with element images or without: the one place they decide it (a released model's weights choose their
    own instead: a2.plan.plan_layout). A --reference-layout other than channel names its kind; frame conditioning
    gives a TI2V-5B clean leading frames and any other model Wan I2V's frames in place; else A2's channel prefix
    with elements, text-to-video without. (A TI2V-5B's first frame may come beside in-context references when
    sampling.)"""
    if elements and c.reference_layout != "channel":
        return c.reference_layout
    if c.frame_conditioning != "full":
        return "clean" if ti2v else "inplace"
    return "prefix" if elements else "t2v"


def element_kind(info, vae) -> str:
    """The kind whose element images a run or a sampling call on model `info` with conditioning flags `vae`
    (VaeProcessorConfig / ConditioningConfig) takes: a released model's own, else the one --reference-layout asks for
    (frame conditioning aside: it takes frames of the clip, and plan says so)."""
    return info.native_kind or kind_of(replace(vae, frame_conditioning="full"), True, info.ti2v)


def literal_choices(hint) -> tuple:
    """The values a Literal type allows (None too where it is optional); () for any other type."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    choices = tuple(v for a in get_args(hint) for v in literal_choices(a))
    return choices + (None,) if choices and type(None) in get_args(hint) else choices


CONDITIONING_CHOICES = {k: literal_choices(h) for k, h in get_type_hints(ConditioningConfig).items()}


def _checked(cls, d: dict, where: str) -> dict:
    """d, each key that is a field of `cls` checked against the field's type (a dataset file is JSON, not parsed by
    tyro): a Literal's choices; else bool, int, float (an int too; a bool is no number), str, None, a tuple or a
    config as a JSON list or object. A ConfigError names `where` and the key."""
    hints = get_type_hints(cls)
    for key, v in d.items():
        hint = hints.get(key)
        if hint is None:
            continue
        choices = literal_choices(hint)
        if choices and v not in choices:
            raise ConfigError(f"{where}.{key}: {v!r} is not one of {choices}")
        options = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
        types = tuple(t for o in options
                      for t in JSON_TYPES.get(get_origin(o) or o, (dict,) if is_dataclass(o) else (o,)))
        if not choices and (not isinstance(v, types) or isinstance(v, bool) and bool not in types):
            raise ConfigError(f"{where}.{key}: expected {' or '.join(t.__name__ for t in types)}, got {v!r}")
    return d


JSON_TYPES = {float: (int, float), tuple: (list,)}  # a field's type -> the JSON values it takes, where they differ


@dataclass(frozen=True)
class VaeProcessorConfig(ConditioningConfig):
    """The VAE path of a dataset: the conditioning (ConditioningConfig's keys) and how its images are framed."""

    resolution: tuple[int, int] = (480, 832)
    """The (height, width) in pixels that the video and the element images are brought to."""
    default_preprocess: Literal[PREPROCESS_MODES] = "resize"
    """The framing of elements that do not set their own (one of PREPROCESS_MODES)."""


@dataclass(frozen=True)
class ClipProcessorConfig:
    """The CLIP path of the conditioning."""

    resolution: tuple[int, int] = (512, 512)
    """The (height, width) in pixels that element images are brought to before CLIPImageProcessor (A2: 512x512)."""
    default_preprocess: Literal[PREPROCESS_MODES] = "pad_white"
    """The framing of elements that do not set their own (one of PREPROCESS_MODES)."""


@dataclass(frozen=True)
class VisualizationConfig:
    """Training-time dumps of latents and decoded frames (a dataset file's `visualization` block, docs/dataset.md)."""

    enabled: bool = False
    """Writes visualisations during training."""
    output_dir: str = "visualizations/{run_id}"
    """Where the visualisations go, relative to the run dir unless absolute; {run_id} is the run dir's name."""
    frequency: int = 100
    """Writes them every this many steps."""
    processors: tuple = ()
    """What to write: dicts {type: latent_save | vae_decode, data: [VISUALIZED names], frames: [indices]}."""


# the tensors of a training step a visualization processor can write (a2/train/step.py: forward_loss's viz)
VISUALIZED = ("input_latents", "noisy_latents", "conditioned_latents", "predicted_latents", "reference_images")
VISUALIZE_FORMATS = {"latent_save": "pt", "vae_decode": "png"}  # what each processor type writes


PUBLIC_TYPES = ("opens2v", "phantom", "humoset")  # a2/data/public_index.py's index formats
FRAME_EXTRACTION = ("spread", "head", "chunk", "slide", "uniform")  # a2.data.media.frame_windows's


@dataclass(frozen=True)
class DataSource:
    """Where a dataset's clips are and how their frames are read: the keys a dataset file's entries (DatasetConfig)
    and train_a2.py's data flags (DataConfig, the data section) share, declared once here."""

    data_root: str | None = None
    """The E2V dataset dir: <id>.mp4, <id>.txt, <id><element suffix> (see data.py); a manifest's relative paths are
    read from it too."""
    manifest: str | None = None
    """A CSV/JSONL file listing the clips (`video`/`path` and `caption`/`prompt` columns), e.g. the T2V workflow's
    train.jsonl of .npz clips (uint8 `frames`). Paths in it are relative to its dir, which is the default
    --data-root."""
    dataset_type: Literal[("e2v", "t2v") + PUBLIC_TYPES] = "e2v"
    """What the data is. e2v: clips and element images (A2). t2v: clips and prompts only, no elements: text-to-video
    training, where a T2V model (16 input channels) trains as it is, without expansion. opens2v / phantom / humoset:
    OpenS2V-5M, Phantom-Data or HuMoSet as published, through the index of `data.py index` given as --manifest; the
    element images are built from their masks, boxes or photos (a2/data/public_read.py; docs/public-datasets.md)."""
    sam: str | None = None
    """With --dataset-type phantom or humoset: a local transformers SAM dir (SamModel) that segments the box and photo
    references onto white; without it, Phantom-Data's references are box crops."""
    cross_video: bool = False
    """With --dataset-type opens2v: takes each clip's subject and object from a paired clip of its cross-video cluster
    (an index built with --cross-pairs) instead of from its own frame."""
    frame_extraction: Literal[FRAME_EXTRACTION] = "spread"
    """Which frames of a clip train. spread (default, a2's rule): one window per clip, its frames spread evenly over the
    whole clip (a clip longer than the window is sped up, none of it is left out). head | chunk | slide | uniform:
    windows of consecutive frames, each a sample of its own, as musubi-tuner cuts them: head the first; chunk back to
    back; slide one every --frame-stride frames; uniform --frame-sample windows evenly spaced. The windows are a
    function of the clip alone (deterministic), and each is validated and cached as a sample."""
    frame_stride: int = 1
    """With --frame-extraction slide: the frames between window starts (musubi-tuner's default 1: every start)."""
    frame_sample: int = 1
    """With --frame-extraction uniform: the windows per clip (musubi-tuner's default 1: the first window, as head)."""
    source_fps: float | None = None
    """The frame rate of the clips. Given, with --target-fps below it, frames are dropped (musubi-tuner's rule) to bring
    the clips to --target-fps before the windows are cut (head/chunk/slide/uniform). Default: the clips as they are."""
    target_fps: float = 16.0
    """The frame rate the clips are brought to with --source-fps: 16, the rate Wan 2.1/2.2 are trained at."""


@dataclass(frozen=True)
class DatasetConfig(DataSource):
    """One dataset of a run (a JSON dataset config holds several)."""

    weight: float = 1.0
    """How many times each sample is drawn per epoch (0.5: half of them, 2: twice)."""
    target_resolution: tuple[int, int] = (480, 832)
    """The (height, width) in pixels of the training clips."""
    auto_frame_buckets: bool = False
    """Puts a clip shorter than num_frames into the largest 4k+1 frame bucket it fills, and into an aspect bucket."""
    frame_buckets: tuple[int, ...] = ()
    """The frame counts (4k+1) of the buckets with auto_frame_buckets (default 17, 33, 49, 65, 81)."""
    reshape_mode: str = "center_crop"
    """How a video frame is brought to the target size (one of PREPROCESS_MODES)."""
    remove_common_llm_caption_prefixes: bool = True
    """Strips captioner boilerplate ("The video shows ...") from the captions."""
    elements: tuple[Element, ...] = A2_ELEMENTS
    """The reference elements of each sample, in position order."""
    vae: VaeProcessorConfig = field(default_factory=VaeProcessorConfig)
    """The settings of the VAE path."""
    clip: ClipProcessorConfig = field(default_factory=ClipProcessorConfig)
    """The settings of the CLIP path."""
    visualization: VisualizationConfig = field(default_factory=VisualizationConfig)
    """The visualisations written during training."""
    eval: bool = False
    """Marks a held-out dataset: its samples are never trained on, only scored by the eval loss (--eval-every)."""
    source: str = ""
    """Where the dataset was defined (config file and entry, or flags), for messages; it is no part of the data."""


def check_extraction(c: DatasetConfig, where: str) -> DatasetConfig:
    """The frame-extraction settings of a dataset, checked (one line naming the flag or key)."""
    if c.frame_stride < 1 or c.frame_sample < 1:
        raise ConfigError(f"{where}: frame_stride and frame_sample must be >= 1, got {c.frame_stride}, "
                          f"{c.frame_sample}")
    if (c.source_fps is not None and c.source_fps <= 0) or c.target_fps <= 0:
        raise ConfigError(f"{where}: source_fps and target_fps must be > 0, got {c.source_fps}, {c.target_fps}")
    if c.source_fps and c.frame_extraction == "spread":
        raise ConfigError(f"{where}: source_fps resamples the clip for windows of consecutive frames; frame_extraction "
                          "spread already spreads its frames over the whole clip: use head, chunk, slide or uniform")
    return c


def _check_keys(d: dict, allowed, where: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        close = {k: m[0] for k in unknown if (m := difflib.get_close_matches(k, allowed, n=1, cutoff=0.6))}
        raise ConfigError(f"{where}: unknown key(s) {unknown}"
                          + "".join(f"; did you mean {m!r} for {k!r}?" for k, m in close.items())
                          + f"; allowed: {sorted(allowed)}")


def _hw(v, where: str) -> tuple[int, int]:
    if not (isinstance(v, list | tuple) and len(v) == 2 and all(isinstance(x, int) for x in v)):
        raise ConfigError(f"{where}: expected [height, width], got {v!r}")
    check_sides(where, v)
    return (v[0], v[1])


def _element_from_json(d: dict, i: int, defaults: tuple[str, str], where: str) -> Element:
    """An element in either form (docs/dataset.md): flat (vae_repeat, position, vae_preprocess, clip_process) or nested
    (vae: {repeat, position, preprocess}, clip: {preprocess} or false); a key given in both forms must agree."""
    _check_keys(d, {"name", "suffixes", "required", "vae_repeat", "position", "clip_process", "vae_preprocess",
                    "vae", "clip"}, where)
    for k in ("name", "suffixes"):
        if k not in d:
            raise ConfigError(f"{where}: missing key '{k}'")
    suffixes = [d["suffixes"]] if isinstance(d["suffixes"], str) else d["suffixes"]
    if not isinstance(suffixes, list) or not suffixes or not all(isinstance(x, str) for x in suffixes):
        raise ConfigError(f"{where}.suffixes: expected a file suffix or a list of them, got {d['suffixes']!r}")
    vae, clip = d.get("vae", {}), d.get("clip", {})
    _check_keys(vae, {"repeat", "position", "preprocess"}, f"{where}.vae")
    if clip is not False:
        _check_keys(clip, {"preprocess"}, f"{where}.clip")
    kw = dict(name=d["name"], suffixes=tuple(suffixes), required=d.get("required", False), clip=clip is not False,
              repeat=_one_of(where, {"vae_repeat": d.get("vae_repeat"), "vae.repeat": vae.get("repeat")}, 1),
              position=_one_of(where, {"position": d.get("position"), "vae.position": vae.get("position")}, i),
              vae_preprocess=_one_of(where, {"vae_preprocess": d.get("vae_preprocess"),
                                             "vae.preprocess": vae.get("preprocess")}, defaults[0]),
              clip_preprocess=_one_of(where, {"clip_process": d.get("clip_process"),
                                              "clip.preprocess": (clip or {}).get("preprocess")}, defaults[1]))
    _checked(Element, {k: v for k, v in kw.items() if k != "suffixes"}, where)  # suffixes: checked above
    return Element(**kw)


def _one_of(where: str, forms: dict, default):
    """The value of a setting a dataset may give under two keys (a flat key and its processors form, an element's flat
    key and its nested one): the one given, or `default`; both given and different is a ConfigError naming both."""
    given = {k: v for k, v in forms.items() if v is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise ConfigError(f"{where}: " + " and ".join(f"{k} {v!r}" for k, v in given.items())
                          + " disagree: give one of them")
    return next(iter(given.values()), default)


def _visualization_from_json(vis: dict, where: str) -> VisualizationConfig:
    _check_keys(vis, {f.name for f in fields(VisualizationConfig)}, where)
    _checked(VisualizationConfig, vis, where)
    if vis.get("frequency", 1) < 1:
        raise ConfigError(f"{where}.frequency: every N steps, N >= 1, got {vis['frequency']}")
    for i, proc in enumerate(vis.get("processors", [])):
        at = f"{where}.processors[{i}]"
        _check_keys(proc, {"type", "data", "frames", "format"}, at)
        if proc.get("type") not in VISUALIZE_FORMATS:
            raise ConfigError(f"{at}.type: expected one of {tuple(VISUALIZE_FORMATS)}, got {proc.get('type')!r}")
        if proc.get("format", VISUALIZE_FORMATS[proc["type"]]) != VISUALIZE_FORMATS[proc["type"]]:
            raise ConfigError(f"{at}.format: {proc['type']} writes {VISUALIZE_FORMATS[proc['type']]}, got "
                              f"{proc['format']!r}")
        data, frames = proc.get("data", []), proc.get("frames", [])
        if not isinstance(data, list):
            raise ConfigError(f"{at}.data: expected list, got {data!r}")
        unknown = [x for x in data if x not in VISUALIZED]
        if unknown:
            raise ConfigError(f"{at}.data: {unknown} not among {VISUALIZED}")
        if not isinstance(frames, list) or not all(isinstance(f, int) and not isinstance(f, bool) for f in frames):
            raise ConfigError(f"{at}.frames: expected a list of frame indices, got {proc['frames']!r}")
    return VisualizationConfig(**{**vis, "processors": tuple(vis.get("processors", ()))})


# a dataset's JSON keys besides DatasetConfig's own (their forms: docs/dataset.md); vae, clip: processors' blocks
JSON_ALIASES = ("processors", "clip_resolution", "vae_combine")


def _dataset_from_json(d: dict, where: str, base: Path) -> DatasetConfig:
    """One entry of a dataset file's "datasets" (or "eval") list: every key is docs/dataset.md's."""
    _check_keys(d, {f.name for f in fields(DatasetConfig)} - {"vae", "clip", "eval", "source"} | set(JSON_ALIASES),
                where)
    if "data_root" not in d:
        raise ConfigError(f"{where}: missing key 'data_root'")
    if not isinstance(d["data_root"], str):  # (DataSource's None is the flags' "not given")
        raise ConfigError(f"{where}.data_root: expected str, got {d['data_root']!r}")
    _checked(DatasetConfig, d, where)
    procs = d.get("processors", {})
    _check_keys(procs, {"vae", "clip"}, f"{where}.processors")
    pv, pc = procs.get("vae", {}), procs.get("clip", {})
    _check_keys(pv, {f.name for f in fields(VaeProcessorConfig)}, f"{where}.processors.vae")
    _check_keys(pc, {f.name for f in fields(ClipProcessorConfig)}, f"{where}.processors.clip")
    res = _hw(_one_of(where, {"target_resolution": d.get("target_resolution"),
                              "processors.vae.resolution": pv.get("resolution")}, VaeProcessorConfig.resolution),
              f"{where}.target_resolution")
    combine = _one_of(where, {"vae_combine": d.get("vae_combine"), "processors.vae.combine": pv.get("combine")},
                      ConditioningConfig.combine)
    vae = VaeProcessorConfig(**{**_checked(VaeProcessorConfig, {**pv, "combine": combine}, f"{where}.processors.vae"),
                                "resolution": res})
    if vae.reference_layout != "channel" and vae.frame_conditioning != "full":  # the element layouts take no frames
        raise ConfigError(f"{where}.processors.vae: reference_layout {vae.reference_layout} places element "
                          f"references; frame_conditioning {vae.frame_conditioning!r} conditions on video frames "
                          "(use full)")
    clip_res = _one_of(where, {"clip_resolution": d.get("clip_resolution"),
                               "processors.clip.resolution": pc.get("resolution")}, ClipProcessorConfig.resolution)
    clip = ClipProcessorConfig(**{**_checked(ClipProcessorConfig, pc, f"{where}.processors.clip"),
                                  "resolution": _hw(clip_res, f"{where}.processors.clip.resolution")})
    # "bicubic"/"bilinear" name a filter, not a framing: a plain resize
    reshape = d.get("reshape_mode", DatasetConfig.reshape_mode)
    if reshape not in PREPROCESS_MODES + ("bicubic", "bilinear"):
        raise ConfigError(f"{where}.reshape_mode: {reshape!r} is not one of {PREPROCESS_MODES}")
    defaults = (vae.default_preprocess, clip.default_preprocess)
    raw = d.get("elements", [])
    elements = check_elements([_element_from_json(e, i, defaults, f"{where}.elements[{i}]") for i, e in enumerate(raw)],
                              f"{where}.elements")
    if vae.reference_layout != "channel" and not elements:  # every element layout but A2's default needs them
        raise ConfigError(f"{where}.processors.vae.reference_layout: {vae.reference_layout} places element "
                          f"references, but {where} lists no elements")
    buckets = tuple(d.get("frame_buckets", ()))
    if any((not isinstance(f, int)) or f < 1 or (f - 1) % 4 for f in buckets):
        raise ConfigError(f"{where}.frame_buckets: every bucket must be 4k+1, got {list(buckets)}")
    # auto_frame_buckets also buckets by aspect: a list of frame buckets does not switch that on behind the user
    if buckets and not d.get("auto_frame_buckets", False):
        raise ConfigError(f"{where}.frame_buckets: the buckets of auto_frame_buckets (frame and aspect buckets), "
                          "which is off: add \"auto_frame_buckets\": true, or drop frame_buckets")
    root = Path(d["data_root"])
    cfg = DatasetConfig(**{**{k: v for k, v in d.items() if k not in JSON_ALIASES},
                           "data_root": str(root if root.is_absolute() else base / root), "target_resolution": res,
                           "frame_buckets": buckets, "reshape_mode": "resize" if reshape in ("bicubic", "bilinear")
                           else reshape, "elements": elements, "vae": vae, "clip": clip, "source": where,
                           "visualization": _visualization_from_json(d.get("visualization", {}),
                                                                     f"{where}.visualization")})
    return check_extraction(cfg, where)


def load_dataset_config(path) -> list[DatasetConfig]:
    """A JSON dataset config (docs/dataset.md): {"datasets": [{...}, ...]}, and optionally "eval": [{...}, ...],
    held-out datasets in the same format (never trained on; scored by the eval loss)."""
    path = Path(path)
    try:
        raw = json.loads(read_text(path))
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: dataset config not found") from e
    except (json.JSONDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    _check_keys(raw, {"datasets", "eval"}, str(path))
    if not raw.get("datasets") or not isinstance(raw["datasets"], list):
        raise ConfigError(f"{path}: 'datasets' must be a non-empty list")
    if not isinstance(raw.get("eval", []), list):
        raise ConfigError(f"{path}: 'eval' must be a list of datasets")
    cfgs = [_dataset_from_json(d, f"{path}: datasets[{i}]", path.parent) for i, d in enumerate(raw["datasets"])]
    cfgs += [replace(_dataset_from_json(d, f"{path}: eval[{i}]", path.parent), eval=True)
             for i, d in enumerate(raw.get("eval", []))]
    for c in cfgs[1:]:  # one run builds every sample's condition the same way
        if c.vae != cfgs[0].vae:
            raise ConfigError(f"{c.source}.processors.vae: differs from datasets[0]'s; all datasets of one run must "
                              "share processors.vae (resolution, combine, frame conditioning)")
    return cfgs


@dataclass(frozen=True)
class DataConfig(DataSource):
    """The training data: where it is and what it is (DataSource's flags, a dataset file's keys of the same names), how
    its clips are sized, how it is loaded and cached."""

    dataset_config: str | None = None
    """A JSON dataset config (docs/dataset.md): one or more datasets, their weights, elements, processors and eval sets.
    It replaces --data-root, --manifest, --dataset-type, --elements, --sam, --cross-video and the frame-extraction flags
    (not read beside it); a conditioning flag that disagrees with its processors.vae is an error. --num-frames is read,
    and --resolution and --clip-size still size the validation videos and the memory plan: give the file's sizes."""
    elements: tuple[str, ...] = ()
    """The element specs, one per element: NAME=SUFFIX[,SUFFIX...][:key=value,...] (see a2/elements.py). Empty:
    SkyReels-A2's subject/object/background (none with --dataset-type t2v)."""
    resolution: tuple[int, int] | None = None
    """The training (height, width) in pixels, multiples of 16. Left out: the model's recipe (RECIPES)."""
    num_frames: int | None = None
    """The pixel frames (4k+1) of the whole sequence, reference frames included (A2's prefix; Wan VACE's references
    come on top: its --num-frames is the clip). Left out: the model's recipe (RECIPES)."""
    skip_bad_samples: bool = False
    """Drops invalid samples (and says how many) instead of failing with the full list of problems."""
    num_workers: int = 2
    """The DataLoader worker processes per rank (0: load in the training process). They ignore SIGTERM/SIGINT: the
    training process handles those."""
    cache_dir: str | None = None
    """The precompute cache root. With --precompute the dataset's VAE posteriors, T5 and CLIP embeddings are encoded
    into a subdir named by a hash of everything they depend on; without it, training reads them from there and never
    constructs the VAE, T5 or CLIP (unless validation videos need them)."""
    precompute: bool = False
    """Encodes the dataset into --cache-dir (sharded over ranks; a killed run resumes) and exits."""


def dataset_configs(data: DataConfig, c: ConditioningConfig, clip_size: int, eval_manifest: str | None = None,
                    resolution_given: bool = False) -> list[DatasetConfig]:
    """The datasets of a run (its data and conditioning sections, --clip-size, --eval-manifest): the JSON file if
    given, else one dataset from the flags. resolution_given: --resolution was typed (not the recipe's): a file whose
    datasets train at another size refuses it, as the other data flags."""
    check_size(*data.resolution, data.num_frames)
    if data.dataset_config:
        cfgs = load_dataset_config(data.dataset_config)
        keys = [f.name for f in fields(DataSource)] + ["elements"]  # the file's keys, which it sets
        beside = [k for k in keys if getattr(data, k) != getattr(DataConfig(), k)]
        if beside:  # for each of its datasets: a flag beside it would be ignored, and the run train other data
            raise ConfigError(f"{' '.join('--' + k.replace('_', '-') for k in beside)}: {data.dataset_config} "
                              "describes the data (each dataset's keys of the same names); set them there, or drop "
                              "the flags")
        other = next((d for d in cfgs if resolution_given and tuple(d.target_resolution) != tuple(data.resolution)),
                     None)
        if other is not None:  # the file's size trains: a typed size beside it would be silently another experiment
            raise ConfigError(f"--resolution {data.resolution[0]} {data.resolution[1]}: {other.source} trains at "
                              f"target_resolution {list(other.target_resolution)}; set the size in the file, or drop "
                              "the flag")
        for f in fields(ConditioningConfig):  # decided once: the file's processors.vae, not a flag beside it
            flag, file = getattr(c, f.name), getattr(cfgs[0].vae, f.name)
            if flag != getattr(ConditioningConfig(), f.name) and flag != file:
                raise ConfigError(f"--{f.name.replace('_', '-')} {flag}: {data.dataset_config} sets processors.vae."
                                  f"{f.name} to {file!r}; set it in the file, or drop the flag")
        return with_eval_manifest(eval_manifest, cfgs)
    if not data.data_root and not data.manifest:
        raise ConfigError("give --data-root DIR, --manifest FILE or --dataset-config FILE.json")
    if data.dataset_type == "t2v" and data.elements:
        raise ConfigError("--dataset-type t2v trains without elements; drop --elements")
    # no element images: text-to-video, or frames of the clip itself as the condition (Wan I2V)
    no_elements = data.dataset_type == "t2v" or c.frame_conditioning != "full"
    if data.dataset_type in PUBLIC_TYPES and (no_elements or not data.manifest):
        raise ConfigError(f"--dataset-type {data.dataset_type} trains elements from an index: --manifest "
                          "OUT/index.jsonl (data.py index) and --frame-conditioning full")
    if c.reference_layout != "channel" and no_elements:  # else the elements would be dropped, another kind trained
        raise ConfigError(f"--reference-layout {c.reference_layout} places element references: it needs element "
                          "images (--dataset-type e2v, --frame-conditioning full)")
    elements = parse_elements(data.elements) if data.elements else A2_ELEMENTS
    manifest = str(Path(data.manifest).resolve()) if data.manifest else None  # a CLI path: relative to the cwd
    shared = {f.name: getattr(data, f.name) for f in fields(DataSource)}  # the flags a dataset file's entry shares
    main = DatasetConfig(**{**shared, "data_root": data.data_root or str(Path(manifest).parent), "manifest": manifest,
        "dataset_type": "t2v" if no_elements else data.dataset_type if data.dataset_type in PUBLIC_TYPES else "e2v"},
        source="--manifest" if data.manifest and not data.data_root else "--data-root",
        target_resolution=tuple(data.resolution), frame_buckets=(), elements=() if no_elements else elements,
        vae=VaeProcessorConfig(resolution=tuple(data.resolution), **asdict(c)),
        clip=ClipProcessorConfig(resolution=(clip_size, clip_size)))
    return with_eval_manifest(eval_manifest, [check_extraction(main, "--frame-extraction")])


def with_eval_manifest(eval_manifest: str | None, cfgs: list[DatasetConfig]) -> list[DatasetConfig]:
    """--eval-manifest: a held-out dataset listed like --manifest (relative paths beside it), read as the first
    dataset's settings read it (elements, sizes, frame extraction)."""
    if not eval_manifest:
        return cfgs
    manifest = Path(eval_manifest).resolve()
    return cfgs + [replace(cfgs[0], data_root=str(manifest.parent), manifest=str(manifest), weight=1.0, eval=True,
                           source="--eval-manifest")]


help_from_docstrings(globals())
