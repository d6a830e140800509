"""Every CLI's config (tyro): TrainConfig, InferConfig, BenchConfig, DemoConfig, data.py's commands, made of the
sections library code reads (a2/config/sections.py; the data and conditioning sections beside the dataset file,
a2/config/dataset_config.py), the model's recipe (RECIPES) and a TrainConfig's datasets (run_datasets). It imports tyro,
the standard library and a2 modules that import only those (a2/cli.py: parse_cli and the one-line errors;
a2/config/dataset_config.py, a2/config/sections.py), so that each script parses its flags (parse_cli) before its heavy
imports: --help, a typo or a config error answer at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from a2.cli import ConfigError, check_dir_to_write, help_from_docstrings
from a2.config.dataset_config import (
    ConditioningConfig,
    DataConfig,
    DatasetConfig,
    check_frames,
    dataset_configs,
    height_width,
)
from a2.config.sections import (
    ADAMW,
    LORA_TARGETS,
    EvalConfig,
    ExportElements,
    IndexHumoSet,
    IndexKaleido,
    IndexOpenS2V,
    IndexPhantom,
    LoraSection,
    MemoryConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    ReferencesConfig,
    RunDirConfig,
    TrainModelConfig,
    ValidationConfig,
)
from a2.config.sections import OpenS2VConfig as OpenS2VConfig  # a2.eval.opens2v's CLI, listed with the others

# a2/kinds/kinds.py's KIND_DEFS names, in its order (a test holds them equal): bench.py --layout's choices
KIND_NAMES = ("t2v", "prefix", "inplace", "incontext", "clean", "phantom", "v3", "magref", "refalign", "vace",
              "standin", "kaleido")


# ---------------------------------------------------------------- demo (demo.py)


@dataclass
class DemoConfig:
    """Render a run's LoRA and its base model from the same elements and seed; write the picture (demo.py)."""

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """The training run's dir (holds pytorch_lora_weights.safetensors, config.json, run.json and metrics.jsonl)."""
    elements: tuple[str, ...] = ()
    """The element images to render with (the run's --val-elements when left out)."""
    clip: str | None = None
    """A training clip (video file) the videos are measured against."""
    prompt: str | None = None
    """The prompt (the clip's caption file beside it when left out, else infer.py's default)."""
    seed: int = 42
    """The seed of both videos' noise."""
    steps: int | None = None
    """Denoising steps (infer.py's default when left out)."""
    guidance_scale: float | None = None
    """Classifier-free guidance scale (infer.py's default when left out)."""
    frames: int = 4
    """Frames shown per video, evenly spaced."""
    out: str | None = None
    """The PNG to write (RUN_DIR/demo.png when left out)."""

    def __post_init__(self):
        for flag, v in (("--frames", self.frames), ("--steps", self.steps)):
            if v is not None and v < 1:
                raise ConfigError(f"{flag} {v}: at least 1")


# ---------------------------------------------------------------- training (train_a2.py)

# The recipe a run takes for every field of it left out, by model. A real model's is the one its users expect:
# SkyReels-A2-14B's LoRA at 480x832, 81 frames. A built-in tiny model trains at its own size (infer.py samples it
# there too) with what learns on its random weights in minutes (README's main job: colour match and distance in
# demo.png): its blocks add their outputs through gates of ~0.1 and its output head is random, so the LoRA takes a
# larger alpha and the head (proj_out); its sampler spends most of its steps at high noise (its scheduler's shift is
# 8, A2's), where the shapes are placed, so training draws its sigmas the same way; a rate ten times a real model's.
# Both take a2's AdamW (ADAMW: torch's betas, no weight decay, clipping at 1).
RECIPES = {
    "model": dict(resolution=(480, 832), num_frames=81, lora_alpha=32.0, lora_target=LORA_TARGETS,
                  sigma_sampling="logit_normal", sigma_shift=5.0, lr=1e-4, warmup_steps=100, val_steps=None, **ADAMW),
    "tiny": dict(resolution=(64, 64), num_frames=33, lora_alpha=320.0, lora_target=LORA_TARGETS + r"|proj_out",
                 sigma_sampling="shifted", sigma_shift=8.0, lr=1e-3, warmup_steps=10, val_steps=10, **ADAMW),
}  # val_steps: a tiny model samples in 10 steps, as infer.py samples it (None: the kind's own)
# Kaleido's training yaml (zai-org/Kaleido configs/training/video_wanx_14B_concat.yaml: lr 5e-6, sat's warmup 0.01 of
# its 5000 iterations, 480x832, 81 frames; AdamW betas (0.9, 0.95) and weight decay 1e-4 :84-91, gradient clipping
# 0.1 :65) and RFLoss (logit-normal(0, 1) sigmas, shifted by the run's size: rf_shift, filled in
# TrainConfig.__post_init__). Its tiny model takes the same optimizer at the tiny rate. Not taken: its gradient
# accumulation 8 (:63), a global batch that also scales with its GPUs (--grad-accum is the user's), and sat's
# weight-decay groups (biases and norms undecayed: sat/training/deepspeed_training.py:698-726), 5e-10 a step here.
KALEIDO_ADAMW = dict(adam_betas=(0.9, 0.95), weight_decay=1e-4, max_grad_norm=0.1)
RECIPES["kaleido"] = {k: v for k, v in dict(RECIPES["model"], sigma_sampling="logit_normal_shifted", lr=5e-6,
                                             warmup_steps=50, **KALEIDO_ADAMW).items() if k != "sigma_shift"}
RECIPES["tiny-kaleido"] = {k: v for k, v in dict(RECIPES["tiny"], sigma_sampling="logit_normal_shifted",
                                                  **KALEIDO_ADAMW).items() if k != "sigma_shift"}


def rf_shift(height: int, width: int) -> float:
    """Kaleido's RFLoss shift at a training size (sgm/modules/diffusionmodules/loss.py:16-29, 579-583): exp(mu), mu =
    get_lin_function(y1=0.5, y2=1.15) of the latent tokens a frame (Wan 2.1: VAE stride 8, patch 2x2); its time_shift
    e^mu / (e^mu + 1/s - 1) is the shift map at shift e^mu (480x832: 2.056; 64x64: 1.583)."""
    tokens = (height // 8) * (width // 8) // 4
    return math.exp(0.5 + (1.15 - 0.5) / (4096 - 256) * (tokens - 256))


def recipe_of(model: str) -> dict:
    """The recipe of --model: Kaleido's (its built-in tiny, or a dir holding its SAT release: a2/kaleido.py), a
    built-in tiny model's, else a real model's."""
    if model == "tiny-kaleido":
        return RECIPES[model]
    if not is_tiny(model) and Path(model).is_dir():
        from a2 import kaleido  # torch: only for a local dir, which the run loads next

        if kaleido.checkpoint(model) is not None:
            return RECIPES["kaleido"]
    return RECIPES["tiny" if is_tiny(model) else "model"]


def is_tiny(model: str) -> bool:
    """A built-in tiny model (a2/model/tiny.py: tiny, tiny-t2v, ...), not a real-size random one (random-14B)."""
    return model == "tiny" or model.startswith("tiny-")


@dataclass
class TrainConfig:
    """E2V training on Wan / SkyReels-A2. Defaults are a LoRA; the size, frames, LoRA alpha and targets, sigma
    sampling and learning rate left out are the model's recipe (RECIPES): A2-14B's at 480x832, 81 frames, or a
    built-in tiny model's own."""

    model: tyro.conf.OmitArgPrefixes[TrainModelConfig] = field(default_factory=TrainModelConfig)
    """The model a run trains, the parts it is completed with, the expert of a Wan 2.2 pair and the paths the
    references take."""
    lora: tyro.conf.OmitArgPrefixes[LoraSection] = field(default_factory=LoraSection)
    """What trains: a LoRA (its shape and where it goes) or all the transformer's weights."""
    parallel: tyro.conf.OmitArgPrefixes[ParallelConfig] = field(default_factory=ParallelConfig)
    """Where a run computes and how it splits over ranks."""
    memory: tyro.conf.OmitArgPrefixes[MemoryConfig] = field(default_factory=MemoryConfig)
    """How the step fits on each GPU (a2/memory/memory.py): the plan, recomputation, offload, fp8, block swap,
    compilation, the dry run."""
    data: tyro.conf.OmitArgPrefixes[DataConfig] = field(default_factory=DataConfig)
    """The training data: where it is, what it is, how its clips are cut and sized, how it is loaded and cached."""
    conditioning: tyro.conf.OmitArgPrefixes[ConditioningConfig] = field(default_factory=ConditioningConfig)
    """How element images and video frames condition the model (shared with infer.py and a dataset file's
    processors.vae; with --dataset-config the file's values hold, and a flag that disagrees is an error)."""
    objective: tyro.conf.OmitArgPrefixes[ObjectiveConfig] = field(default_factory=ObjectiveConfig)
    """The flow-matching loss: how sigma is drawn and how the loss is weighted."""
    references: tyro.conf.OmitArgPrefixes[ReferencesConfig] = field(default_factory=ReferencesConfig)
    """What a sample's prompt and references go through in training: dropout, augmentation, RefAlign's alignment
    loss."""
    optim: tyro.conf.OmitArgPrefixes[OptimConfig] = field(default_factory=OptimConfig)
    """The optimizer, its schedule, the batch and the run's length."""
    rundir: tyro.conf.OmitArgPrefixes[RunDirConfig] = field(default_factory=RunDirConfig)
    """The run dir: where it is, its checkpoints, resuming and the logs."""
    validation: tyro.conf.OmitArgPrefixes[ValidationConfig] = field(default_factory=ValidationConfig)
    """The eval loss on held-out samples and the validation videos."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The local encoder dirs that score validation videos (--eval.clip-image, --eval.dino, --eval.clip-text,
    --eval.face; a2/eval/evaluate.py); a metric whose encoder is not given is skipped with one message."""

    def __post_init__(self):
        # the fields left out (None) take the model's recipe (RECIPES) here, the one place it is applied: every
        # TrainConfig (flags, Python, data.py validate) is the run it describes; `filled` says what it filled
        recipe = recipe_of(self.model.model)
        self.filled = {k: v for k, v in recipe.items() if getattr(getattr(self, SECTION_OF[k]), k) is None}
        for name in {SECTION_OF[k] for k in self.filled}:  # new section objects: the ones given stay as they were
            setattr(self, name, replace(getattr(self, name), **{k: v for k, v in self.filled.items()
                                                                  if SECTION_OF[k] == name}))
        o = self.objective
        if o.sigma_sampling == "logit_normal_shifted" and o.sigma_shift is None and self.data.resolution:
            self.objective = replace(o, sigma_shift=rf_shift(*self.data.resolution))  # RFLoss's, by the run's size
            self.filled["sigma_shift"] = self.objective.sigma_shift


# the sections whose flags take no prefix, by name; memory and conditioning keep their nested fields in a run's
# config.json, as eval does (--eval.*)
SECTIONS = dict(model=TrainModelConfig, lora=LoraSection, parallel=ParallelConfig, data=DataConfig,
                objective=ObjectiveConfig, references=ReferencesConfig, optim=OptimConfig, rundir=RunDirConfig,
                validation=ValidationConfig)
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}  # flag's field -> its section


def sectioned(cls, sections: dict, flags: dict):
    """A cls from its flags' names, as the CLI takes them: a field of one of `sections` (its field name -> its class)
    goes to that section, the others to cls itself, as does a section given whole (sampling=InferSampling(...))."""
    section_of = {f.name: name for name, sec in sections.items() for f in fields(sec)}
    parts = {name: {} for name in sections}
    rest = {}
    for k, v in flags.items():
        (parts[section_of[k]] if k in section_of else rest)[k] = v
    return cls(**{name: sections[name](**kw) for name, kw in parts.items() if kw or name not in rest}, **rest)


def from_flags(**flags) -> TrainConfig:
    """A TrainConfig from its flags' names (lr=1e-3, memory=MemoryConfig(...)), as the CLI takes them: each goes
    to its section; for Python callers and tests."""
    return sectioned(TrainConfig, SECTIONS, flags)


def with_flags(cfg: TrainConfig, **flags) -> TrainConfig:
    """A copy of cfg with these flags changed (by their names, as from_flags takes them)."""
    return from_flags(**{**flat_config(cfg, nested=False), **flags})


def flat_config(cfg: TrainConfig, nested: bool = False) -> dict:
    """cfg by flag name, as a run's config.json holds it (the layout of every run dir before the config had sections,
    so old checkpoints compare key by key): the unprefixed sections flattened; memory, conditioning and eval as dicts
    with nested=True (JSON), else as the section objects."""
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in SECTIONS:
            out.update({g.name: getattr(v, g.name) for g in fields(v)})
        else:
            out[f.name] = asdict(v) if nested and hasattr(v, "__dataclass_fields__") else v
    return out


def run_datasets(cfg: TrainConfig) -> list[DatasetConfig]:
    """The datasets of a run (dataset_configs) of its data and conditioning sections, --clip-size and --eval-manifest;
    a --resolution typed (not the recipe's) is held against a dataset file's. train_a2.py and data.py validate, before
    their heavy imports and after."""
    return dataset_configs(cfg.data, cfg.conditioning, cfg.model.clip_size, cfg.validation.eval_manifest,
                           resolution_given="resolution" not in cfg.filled)


# ---------------------------------------------------------------- inference (infer.py)


@dataclass
class InferWeights:
    """The transformer weights that replace the model's own (a full fine-tune, a Wan 2.2 pair's experts) and the
    dtype every weight is loaded in and computes in."""

    transformer: str | None = None
    """A transformer dir that replaces the model's own: a full fine-tune (train_a2.py's runs/<run>/transformer), e.g. a
    T2V model trained as E2V after expansion; with a Wan 2.2 pair, the high-noise expert."""
    transformer_2: str | None = None
    """A low-noise expert dir that replaces a Wan 2.2 A14B model's transformer_2 (runs/<run>/transformer_2)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype of all model weights and of the computation."""


@dataclass
class InferControls:
    """What the video is conditioned on besides the prompt and --elements: the elements' specs, VACE's control
    video and its mask, TI2V-5B's first frame."""

    control_video: str | None = None
    """A VACE model's video to condition on beside the references (a pose, depth or masked clip, Wan's src_video): its
    first --num-frames frames (a video file, or a .npz of uint8 `frames`), centre-cropped to the size and resized.
    Without it (and --mask) VACE samples from the references alone (R2V)."""
    mask: str | None = None
    """The mask of --control-video, white where VACE generates (Wan's src_mask, read from its first channel): a video
    of its frames (a video file, or a .npz of uint8 `frames` as --control-video takes), or one image for all of them.
    Without it the whole control video is to transform."""
    image: str | None = None
    """The first frame of a Wan 2.2 TI2V-5B image-to-video, resized to --height x --width with Lanczos (as diffusers'
    VideoProcessor); its clean latent replaces the first latent frame at timestep 0."""
    element_specs: tuple[str, ...] = ()
    """The element specs (train_a2.py's --elements grammar). Default: the kind's, as train_a2.py takes them
    (a2.kinds.kinds.kind_elements): SkyReels-A2's subject/object/background; on the released S2V models (Phantom-Wan,
    SkyReels-V3 R2V, RefAlign, MAGREF) ref0, ref1, ... framed as their labs frame references (one frame each,
    fit_pad_white)."""


@dataclass
class InferSampling:
    """How the video is sampled: every flag left out is the model's own sampler's (its kind's Sampling, docs/kinds.md)
    or a --preset's."""

    preset: Literal["v3-cfg", "diffusers"] | None = None
    """Samples as another of the lab's own entry points for its model (a2.kinds.kinds.Kind.modes). v3-cfg: SkyReels-V3's
    pipeline class's own defaults (WanSkyReelsA2WanT2VPipeline.__call__), 50 steps, guidance 7.5 / 5 (three forwards a
    step), 105 frames; without it V3 samples as its generate_video.py does. diffusers (VACE): diffusers'
    WanVACEPipeline, the model dir's shift, UniPC from sigma 1 - 1e-6, no negative prompt, the references resized to
    multiples of 8 (Lanczos) and placed in reverse order. Without a preset every flag left out is the model's own
    sampler's (its kind's Sampling, docs/kinds.md): SkyReels-A2 shift 8, 15 fps; Phantom-Wan guidance 7.5 / 5, Wan's
    Chinese negative prompt, 16 fps; SkyReels-V3 as its generate_video.py, 8 steps, guidance 1 (one forward a step), an
    empty negative prompt, 121 frames (5 s at 24 fps); MAGREF 40 steps, shift 3, seed 3407 (its canvas placement too),
    its negative prompt, 15 fps; RefAlign Euler, 7.5 / 5, seed 0, 16 fps; Stand-In, chosen by its --lora file, Euler on
    linspace(1, 0), shift 5, 20 steps, seed 0, the noise on the CPU, 25 fps; Wan's VACE code, UniPC from sigma 0.999,
    shift 16, Wan's negative prompt, seed 2025 (VACE's script), 16 fps (Wan2.2-VACE-Fun: VideoX-Fun's Euler at shift 12,
    seed 43); and the references' VAE encode as each lab's."""
    negative_prompt: str | None = None
    """The negative prompt of classifier-free guidance (default: the model's own sampler's: A2's English one, Wan's
    Chinese one, MAGREF's, V3's empty one)."""
    steps: int | None = None
    """The sampler's denoising steps (default: the model's own sampler's, 50, MAGREF 40, Stand-In 20, SkyReels-V3 8; a
    built-in tiny model: 10; a --preset's own)."""
    guidance_scale: float | None = None
    """The classifier-free guidance scale (1: no guidance, one forward per step; default: the model's own, 5; the
    reference-guided kinds 7.5, SkyReels-V3 1)."""
    guidance_scale_img: float | None = None
    """The reference guidance of the in-context kinds, as Phantom-Wan, SkyReels-V3 and RefAlign sample (a third forward
    with zero references). Default: theirs (5) on their models; else off (text CFG only, references in both: the same
    video as 1, one forward fewer)."""
    guidance_scale_2: float | None = None
    """The CFG scale of a Wan 2.2 A14B pair's low-noise expert, as diffusers' Wan pipelines (default:
    --guidance-scale)."""
    seed: int | None = None
    """Seeds the initial noise, the condition's VAE posterior sample and MAGREF's canvas placement. Left out: the kind's
    own (docs/kinds.md): 42 (A2, Phantom-Wan, SkyReels-V3); MAGREF 3407; Stand-In and RefAlign 0; Wan VACE 2025;
    Wan2.2-VACE-Fun 43."""
    flow_shift: float | None = None
    """The sampler's sigma shift. Left out: the kind's own (docs/kinds.md), as its lab's script fixes it: SkyReels-A2 8,
    Phantom-Wan / V3 / RefAlign / Stand-In 5, MAGREF 3, Wan VACE 16, Wan2.2-VACE-Fun 12; a Wan base model's, the one
    its dir's scheduler config ships."""
    scheduler: Literal["unipc", "euler"] | None = None
    """The sampler: UniPC multistep (A2's) or flow-matching Euler (default: the model's own; Stand-In's Euler)."""
    schedule: Literal["model", "flowmatch"] = "model"
    """The sampler's unshifted sigmas. model: the model's (its kind's own: a released model's, else diffusers');
    flowmatch: DiffSynth's FlowMatchScheduler(sigma_min=0, extra_one_step=True) that Stand-In samples with, linspace(1,
    0, steps + 1) without the 0 (a2/kinds/kinds.py schedule_sigmas)."""
    decode: Literal["drop_refs", "video_only", "all", "none"] | None = None
    """What is decoded. drop_refs: all latents, then the reference frames are dropped (A2, MAGREF); video_only: the
    video latents alone (VACE); all: every frame, the references' included; none: no decode, the latents only (e.g.
    for --save-latents). Default: the kind's own sampler's."""
    fps: int | None = None
    """The frames per second of the written mp4. Left out: the kind's own (docs/kinds.md): A2 and MAGREF 15,
    Phantom-Wan, RefAlign and Wan VACE 16, SkyReels-V3 24, Stand-In 25."""


@dataclass
class InferParity:
    """Parity between runs: keep this run's final latents and condition, or compare them with a kept run's."""

    save_latents: str | None = None
    """Writes the final latents and the condition tensor here (a parity reference)."""
    compare: str | None = None
    """Compares this run's latents and condition with a --save-latents file; exits 1 when max |Δ| > --tolerance."""
    tolerance: float = 1e-4
    """The largest max |Δ| per tensor that passes --compare."""


@dataclass
class InferConfig(ModelConfig):
    """Generate a video from element images and a prompt (or a prompt alone on a T2V model), check parity between
    runs, or compare a LoRA with its base model over a prompt list or an eval set."""

    weights: tyro.conf.OmitArgPrefixes[InferWeights] = field(default_factory=InferWeights)
    """The transformer weights that replace the model's own (a full fine-tune, a Wan 2.2 pair's experts) and the
    dtype every weight is loaded in and computes in."""
    elements: tuple[str, ...] = ()
    """The element images in position order, each `path` or `name=path` (the name from --element-specs, e.g.
    subject=me.png). Leave it empty for a T2V model (text only)."""
    controls: tyro.conf.OmitArgPrefixes[InferControls] = field(default_factory=InferControls)
    """What the video is conditioned on besides the prompt and --elements: the elements' specs, VACE's control
    video and its mask, TI2V-5B's first frame."""
    sampling: tyro.conf.OmitArgPrefixes[InferSampling] = field(default_factory=InferSampling)
    """How the video is sampled: every flag left out is the model's own sampler's (its kind's Sampling, docs/kinds.md)
    or a --preset's."""
    prompt: str = "A man is holding a teddy bear in the forest."
    """The text prompt of the video."""
    height: int | None = None
    """The video height in pixels, a multiple of 16 (default 480; a built-in tiny model: 64)."""
    width: int | None = None
    """The video width in pixels, a multiple of 16 (default 832; a built-in tiny model: 64)."""
    resolution: tuple[int, int] | None = None
    """The (height, width) in pixels: train_a2.py's name for --height H --width W (give one form or the other)."""
    num_frames: int | None = None
    """The pixel frames (4k+1) generated in all, reference frames included where the kind places them in the sequence
    (A2: 12 of the default 81); Wan VACE's reference frames come on top (its --num-frames is the video). Left out:
    81; SkyReels-V3 121, its generate_video.py's 5 s; a built-in tiny model 33; --preset v3-cfg 105."""
    conditioning: tyro.conf.OmitArgPrefixes[ConditioningConfig] = field(default_factory=ConditioningConfig)
    """How the element images condition the model: train_a2.py's conditioning flags, so a run samples with the
    flags it trained with."""
    lora: tuple[str, ...] = ()
    """The LoRA files or dirs to load (several compose): diffusers keys (train_a2.py's
    pytorch_lora_weights.safetensors), original Wan / ComfyUI keys (`diffusion_model.`, e.g.
    pytorch_lora_weights_comfy.safetensors), musubi-tuner keys (`lora_unet_`), a peft `save_pretrained` adapter dir
    (adapter_config.json + adapter_model.safetensors), or a Stand-In file (its `self_attn.q_loras` keys: the reference
    LoRA of --reference-layout standin; an ordinary LoRA beside it adapts every token, as Stand-In's
    infer_with_lora.py)."""
    lora_high: str | None = None
    """The LoRA of a Wan 2.2 A14B pair's high-noise expert `transformer` (train_a2.py --expert high)."""
    lora_low: str | None = None
    """The LoRA of a Wan 2.2 A14B pair's low-noise expert `transformer_2` (train_a2.py --expert low)."""
    lora_scale: float = 1.0
    """The multiplier of the LoRA update (1: as trained)."""
    force: bool = False
    """Loads a LoRA whose pairs do not all fit the model (trained on another base): the pairs that fit load and the rest
    are skipped. Without it such a file is refused."""
    device: str = "auto"
    """Torch device to run on (cuda, cuda:1, cpu). auto: the GPU when there is one, else the CPU."""
    out: str = "outputs/a2.mp4"
    """The output mp4 path."""
    side_by_side: bool = True
    """Shows the reference images left of each frame, as A2's infer.py does."""
    parity: tyro.conf.OmitArgPrefixes[InferParity] = field(default_factory=InferParity)
    """Parity between runs: keep this run's final latents and condition, or compare them with a kept run's."""
    prompts_file: str | None = None
    """Evaluates a LoRA: renders every prompt of this file (one per line, or .jsonl rows with a `prompt` field, e.g. a
    train.jsonl; rows may carry elements and a seed as in --eval-set) without and with --lora, same seed, side by side
    (left: base, right: LoRA), one mp4 per prompt."""
    eval_set: str | None = None
    """Renders and scores an eval set. An OpenS2V-Eval set as downloaded (`OpenS2V-Eval/Open-Domain_Eval.json`, beside
    its Images/) renders one <sample id>.mp4 per sample into --out-dir (resumable), scored by
    `python3 -m a2.eval.opens2v`. A .jsonl file scores the model (and a --lora against it) on a2's own metrics, one
    video per row: {"prompt": "...", "elements": {"subject": "me.png", ...} or ["me.png", ...] (by position; paths
    relative to the file), "seed": 1, "faces": ["subject"]}; elements, seed and faces are optional (default --elements,
    --seed, --eval.faces). Each row is rendered (without | with the LoRA, same seed, side by side) and scored by
    a2/eval/evaluate.py into --out-dir's metrics.csv and metrics.jsonl (a row per video and element, plus the means),
    and the means are printed with the base vs LoRA deltas."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The local encoder dirs that score --eval-set videos (--eval.clip-image, --eval.dino, --eval.clip-text,
    --eval.face; a2/eval/evaluate.py); a metric whose encoder is not given is skipped with one message."""
    out_dir: str = "outputs/eval"
    """Where --prompts-file and --eval-set write <index>_<prompt>.mp4 and prompts.jsonl (file -> prompt)."""

    def __post_init__(self):
        self.lora = (self.lora,) if isinstance(self.lora, str) else tuple(self.lora or ())  # lora="x" from Python
        height_width(self.height, self.width, self.resolution, (0, 0))  # --resolution and --height/--width agree
        if self.num_frames is not None:
            check_frames(self.num_frames)

    @classmethod
    def from_flags(cls, **flags) -> InferConfig:
        """An InferConfig from its flags' names (steps=10, lora="x.safetensors"), as the CLI takes them: each goes to
        its section; for Python callers and tests."""
        return sectioned(cls, INFER_SECTIONS, flags)


# the sections of InferConfig whose flags take no prefix, by name (conditioning and eval are given whole)
INFER_SECTIONS = dict(weights=InferWeights, controls=InferControls, sampling=InferSampling, parity=InferParity)


# ---------------------------------------------------------------- benchmark (bench.py)


@dataclass
class BenchTiming:
    """How bench.py times the step (or the loader) and where the result goes."""

    steps: int = 5
    """The timed training steps (with --data-root: timed samples)."""
    warmup: int = 2
    """The untimed steps run first (compilation, allocator warmup)."""
    peak_tflops: float | None = None
    """The device's peak dense TFLOP/s for MFU (default: looked up from the GPU name; none on the CPU)."""
    out: str | None = None
    """Appends the result as one JSON line to this file."""
    compare_run: str | None = None
    """A train_a2.py run dir at the same shape and settings: also prints its median s/step (metrics.jsonl, after the
    first logged interval) against this step's, as the training loop's overhead over the bare step."""



@dataclass
class BenchOther:
    """What bench.py measures instead of the step's time: the attention backends' error, the memory table."""

    check_backends: tuple[str, ...] = ()
    """Checks these attention backends instead of timing: the relative L2 error of the output and the gradients under
    bf16 autocast with each of them against an fp32 reference, on the preset cut to 2 blocks (does the fast kernel train
    right?)."""
    memory_table: bool = False
    """Prints docs/memory.md's memory table instead of timing: the rule's plan for each row of bench.py's MEMORY_GRID
    (A2-14B and SkyReels-V3, LoRA and full, 480p and 720p, context parallel 1-8, FSDP, 24-141 GiB cards); with
    --dry-run also each plan traced at full size (minutes a row)."""


@dataclass
class BenchConfig:
    """Time a training step (or the data loader) at a real shape with random weights."""

    preset: Literal["tiny", "tiny-ti2v", "1.3B", "14B", "5B"] = "tiny"
    """The transformer size, with random weights (no download): tiny (tests; tiny-ti2v: shaped as TI2V-5B, for the clean
    kind), Wan 1.3B, Wan/A2 14B, or Wan 2.2 TI2V 5B."""
    frames: Annotated[int, tyro.conf.arg(aliases=("--num-frames",))] = 21
    """The pixel frames (4k+1) of the whole sequence, reference frames included (train_a2.py and infer.py:
    --num-frames)."""
    height: int | None = None
    """The video height in pixels, a multiple of 16 (default 64)."""
    width: int | None = None
    """The video width in pixels, a multiple of 16 (default 64)."""
    resolution: tuple[int, int] | None = None
    """The (height, width) in pixels: train_a2.py's name for --height H --width W (give one form or the other)."""
    refs: int = 3
    """The number of reference images (257 CLIP tokens each); 0 for T2V."""
    layout: Literal[("default",) + KIND_NAMES] = "default"
    """The conditioning kind of a2/kinds/conditioning.py whose step is timed, as train_a2.py's (model_inputs +
    forward_loss) on a synthetic batch: --refs element images clipped to what the kind holds, its first
    --frame-conditioning mode, and a 36-channel model where the kind conditions on channels. default: A2's prefix kind
    (--refs CLIP images; the reference frames are part of --frames), t2v with --refs 0, phantom with --align-refs N.
    E.g. magref: MAGREF's canvas, one CLIP image; standin: Stand-In on T2V, one reference's tokens appended, its
    reference LoRA (rank --lora-rank) trained instead of a peft LoRA."""
    mode: Annotated[Literal["lora", "full"], tyro.conf.arg(aliases=("--training-type",))] = "lora"
    """What trains. lora: a LoRA on the frozen transformer; full: all weights (fp32 master weights, bf16 autocast)."""
    lora_rank: int = 32
    """The LoRA rank r (alpha = r)."""
    batch: Annotated[int, tyro.conf.arg(aliases=("--micro-batch",))] = 1
    """The samples per forward (train_a2.py: --micro-batch)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to run. auto: the GPU when there is one, else the CPU."""
    memory: tyro.conf.OmitArgPrefixes[MemoryConfig] = field(default_factory=MemoryConfig)
    """How the step fits (train_a2.py's section, the same flags): --memory auto plans it on CUDA as train_a2.py does, so
    the figures are the defaults'; --memory manual, and the CPU, take the flags."""
    timing: tyro.conf.OmitArgPrefixes[BenchTiming] = field(default_factory=BenchTiming)
    """How the step (or the loader) is timed and where the result goes."""
    other: tyro.conf.OmitArgPrefixes[BenchOther] = field(default_factory=BenchOther)
    """What bench.py measures instead of the step's time."""
    ema_decay: float = 0.0
    """Times the step with train_a2.py's EMA of the trained weights at this decay (--ema-decay; 0: none)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype (bfloat16: autocast; frozen LoRA base weights are stored in it). auto: bfloat16 on a GPU, float32
    on the CPU."""
    data_root: str | None = None
    """Times the data loader instead of the transformer (decode, frame sampling, resize, element images) over this E2V
    dataset dir at frames x height x width with A2's elements: samples/s over --steps samples after --warmup."""
    num_workers: int = 0
    """The DataLoader worker processes of --data-root and --opens2v."""
    opens2v: str | None = None
    """Times the OpenS2V-5M indexing and loading instead of the transformer: builds a synthetic OpenS2V-5M layout in
    this dir (tests/media/hiker.mp4 looped to 81 frames at 1280x720, its first frame mirrored composited under a known
    mask, --clips records in one part JSON of the published schema), times `data.py index opens2v` on it (clips/s, MB/s
    of JSON), then the loader on 8 of its clips at frames x height x width (samples/s, element images built from the RLE
    masks on the fly)."""
    clips: int = 20000
    """The records in --opens2v's part JSON."""
    context_parallel: int = 1
    """With --dry-run: plans and traces one rank of a context-parallel group of N (a2/model/parallel.py, emulated in one
    process), at its share of the tokens (the whole sequence for heads / N in self-attention), with the rank's attention
    FLOPs and all-to-all bytes per block. The timed step is one process: time context parallel under torchrun with
    train_a2.py --context-parallel N."""
    fsdp: bool = False
    """With --dry-run: the transformer sharded over --dry-run-ranks ranks (FSDP2, one rank traced in one process, its
    collectives on a fake process group), as train_a2.py --fsdp shards it."""
    align_refs: int = 0
    """The reference latent frames appended after the video (Phantom's layout: their tokens are in the sequence); 0:
    none (see the module docstring)."""
    align_loss: bool = True
    """With --align-refs: adds RefAlign's alignment loss (projectors + DINOv3 targets); False: the same sequence without
    it, the baseline of its cost."""
    align_dim: Literal[768, 1024] = 768
    """The width of the random DINOv3 target model: 768 for ViT-B/16 (RefAlign's for 1.3B), 1024 for ViT-L/16 (for
    14B)."""
    align_blocks: tuple[int, ...] = tuple(range(9))
    """The blocks whose reference tokens are aligned (RefAlign: the first nine; a tiny preset has fewer, and the list is
    clipped)."""

    def __post_init__(self):
        height_width(self.height, self.width, self.resolution, (64, 64))  # they agree, multiples of 16 (told now)
        check_frames(self.frames, "--frames")
        run = self.timing.compare_run
        if run and not (Path(run) / "metrics.jsonl").is_file():
            raise ConfigError(f"--compare-run {run}: no metrics.jsonl there (a train_a2.py run dir)")

    @property
    def size(self) -> tuple[int, int]:
        """(height, width): --resolution or --height/--width, 64 for what is given by neither."""
        return height_width(self.height, self.width, self.resolution, (64, 64))


# ---------------------------------------------------------------- data.py's commands (a2/data/public_index.py's
# indexes)


@dataclass
class MakeSample:
    """Write a tiny synthetic E2V dataset (videos, captions, element images)."""

    out: tyro.conf.Positional[str]
    """The dir to write the dataset into (created)."""
    num_samples: int = 4
    """The number of samples (clips)."""
    num_frames: int = 33
    """The frames per clip."""
    height: int = 64
    """The frame height in pixels (even: H.264's 4:2:0)."""
    width: int = 64
    """The frame width in pixels (even: H.264's 4:2:0)."""

    def __post_init__(self):
        if self.num_samples < 1 or self.num_frames < 1:
            raise ConfigError(f"--num-samples {self.num_samples} --num-frames {self.num_frames}: each at least 1")
        if self.height < 2 or self.width < 2 or self.height % 2 or self.width % 2:
            raise ConfigError(f"--height {self.height} --width {self.width}: even numbers of pixels (H.264's 4:2:0)")
        check_dir_to_write("make-sample", self.out)


@dataclass
class Validate(TrainConfig):
    """Check a dataset as `train_a2.py` with the same flags reads it (give it the training command's flags), print
    the summary and every problem; exit status 2 when a problem would stop training."""

    world_size: int = 1
    """The processes of the training run (torchrun: nproc_per_node x nnodes). With --micro-batch and --grad-accum it
    makes the global batch that each bucket must fill to be trained."""


IndexCommand = (Annotated[IndexOpenS2V, tyro.conf.subcommand("opens2v")]
                | Annotated[IndexPhantom, tyro.conf.subcommand("phantom")]
                | Annotated[IndexHumoSet, tyro.conf.subcommand("humoset")]
                | Annotated[IndexKaleido, tyro.conf.subcommand("kaleido")])

# `data.py COMMAND ...` (as tyro.extras.subcommand_cli_from_dict builds it, parsed by parse_cli)
DataCommand = (Annotated[Any, tyro.conf.subcommand("make-sample", constructor=MakeSample)]
               | Annotated[Any, tyro.conf.subcommand("validate", constructor=Validate)]
               | Annotated[Any, tyro.conf.subcommand("index", constructor=IndexCommand, description=(
                   "Index a public S2V dataset as published (OpenS2V-5M, Phantom-Data, HuMoSet), or Kaleido's training "
                   "layout, for training."))]
               | Annotated[Any, tyro.conf.subcommand("export-elements", constructor=ExportElements)])


help_from_docstrings(globals())
