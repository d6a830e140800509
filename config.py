"""Every CLI's config (tyro): TrainConfig, InferConfig, BenchConfig, EvalConfig, data.py's commands, and the run's
datasets made of a TrainConfig's flags or its dataset file (dataset_configs). It imports tyro, the standard library
and three a2 modules that import only those (a2/cli.py: parse_cli and the one-line errors; a2/elements.py: the
--elements grammar; a2/dataset_config.py: the conditioning flags and the dataset file), so that each script parses
its flags (parse_cli) before its heavy imports: --help, a typo or a config error answer at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from a2.cli import ConfigError, OnOffAuto, check_dir_to_write, help_from_docstrings
from a2.dataset_config import (
    PUBLIC_TYPES,
    ClipProcessorConfig,
    ConditioningConfig,
    DatasetConfig,
    DataSource,
    VaeProcessorConfig,
    check_extraction,
    check_frames,
    check_size,
    height_width,
    load_dataset_config,
)
from a2.elements import A2_ELEMENTS, parse_elements

# a2/kinds.py's KIND_DEFS names, in its order (a test holds them equal): bench.py --layout's choices
KIND_NAMES = ("t2v", "prefix", "inplace", "incontext", "clean", "phantom", "v3", "magref", "refalign", "vace",
              "standin", "kaleido")


def resolve_compile(compile: bool | None, device_type: str) -> bool:
    """--compile as given, else on with CUDA and off on the CPU (MemoryConfig.compile)."""
    return device_type == "cuda" if compile is None else compile


# ---------------------------------------------------------------- evaluation (a2/evaluate.py)


@dataclass
class EvalConfig:
    """Encoders that score generated videos (a2/evaluate.py): local dirs only, nothing downloads; a metric whose
    encoder is not given is skipped with one message."""

    clip_image: str | None = None
    """The encoder of CLIP-I (and of CLIP temporal consistency): a transformers CLIPModel /
    CLIPVisionModel(WithProjection) dir, or a dir with image_encoder/ + image_processor/. Default: the model's own image
    encoder (A2: CLIP ViT-H/14)."""
    clip_text: str | None = None
    """The encoder of CLIP-T: a transformers CLIPModel dir (text and vision towers, tokenizer,
    preprocessor_config.json), e.g. laion/CLIP-ViT-H-14-laion2B-s32B-b79K, the CLIP that A2's image encoder comes
    from."""
    dino: str | None = None
    """The encoder of DINO-I (and of DINO temporal consistency): a transformers Dinov2Model dir, e.g.
    facebook/dinov2-base."""
    face: str | None = None
    """The encoder of face similarity: a dir with model.pt2 (torch.export, dynamic batch and size) or model.pt
    (TorchScript), a module (B, 3, H, W) RGB in [0, 1] -> (B, D) embeddings that finds and aligns the face itself
    (non-finite rows: no face); or a transformers image model dir, which embeds whole images (for face-crop references
    and videos)."""
    faces: tuple[str, ...] = ("subject",)
    """The elements scored by --eval.face (A2's subject is a person)."""
    max_frames: int = 0
    """Scores this many evenly spaced frames (0: all)."""
    # OpenS2V-Eval v1.1's metrics under their names (a2/opens2v.py), computed on the decoded video tensor

    aes_clip: str | None = None
    """The CLIP of aes_score: a CLIP ViT-L/14 dir (openai/clip-vit-large-patch14), used with --eval.aes-mlp."""
    aes_mlp: str | None = None
    """The head of aes_score: the LAION aesthetic MLP's state dict (OpenS2V-Weight/aesthetic-model.pth)."""
    facesim: str | None = None
    """The model of cur_score on the --eval.faces elements: an OpenS2V-Weight dir (face_extractor/ +
    glint360k_curricular_face_r101_backbone.bin); it needs insightface and onnxruntime."""
    gme: str | None = None
    """The model of gme_score: a gme-Qwen2-VL dir (Alibaba-NLP/gme-Qwen2-VL-7B-Instruct)."""
    motion_fb: bool = False
    """Scores motion_fb: OpenCV Farneback flow over all frames, as OpenS2V-Eval's MotionAmplitude."""


@dataclass
class OpenS2VConfig:
    """Score a dir of <sample id>.mp4 with OpenS2V-Eval v1.1's metrics (those a2 computes; their own scripts' files
    in the same dir are merged too) and their TotalScore: python3 -m a2.opens2v."""

    videos: str
    """The dir of <sample id>.mp4 (infer.py --eval-set's, or any model's)."""
    eval_set: str
    """An OpenS2V-Eval set as downloaded, e.g. OpenS2V-Eval/Open-Domain_Eval.json (beside its Images/)."""
    json_dir: str | None = None
    """Where the per-metric JSON files go, in their format (default: VIDEOS/opens2v_json)."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(motion_fb=True))
    """The encoders of OpenS2V-Eval's metrics, under the names train_a2.py and infer.py give them: --eval.aes-clip +
    --eval.aes-mlp (aes_score, and a2's subject proxy), --eval.facesim (cur_score), --eval.gme (gme_score);
    --eval.motion-fb is on (--eval.no-motion-fb skips it). a2's own metrics (--eval.clip-image, --eval.dino, ...) are
    infer.py --eval-set's."""
    gme_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """gme-Qwen2-VL's dtype: float16 as theirs; float32 on a CPU."""
    leaderboard: str | None = None
    """The published results_<domain>.csv the run is ranked among (default: the v1.1 tables shipped in
    a2/opens2v_leaderboard/)."""
    device: str = "auto"
    """Where the encoders run: cuda, cpu, ... (auto: CUDA when there is one)."""
    redo: bool = False
    """Recomputes a2's metric files for every video (default: each file scores the videos it does not hold yet)."""

    def __post_init__(self):
        own = [f"--eval.{f.name.replace('_', '-')}" for f in fields(EvalConfig) if f.name in OWN_METRICS
               and getattr(self.eval, f.name) != getattr(EvalConfig(), f.name)]
        if own:
            raise ConfigError(f"{', '.join(own)}: a2's own metrics, which infer.py --eval-set scores; OpenS2V-Eval's "
                              "are --eval.aes-clip / --eval.aes-mlp, --eval.facesim, --eval.gme, --eval.motion-fb")


# EvalConfig's fields of a2's own metrics (a2/evaluate.py), not OpenS2V-Eval's
OWN_METRICS = ("clip_image", "clip_text", "dino", "face", "faces", "max_frames")


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

LORA_TARGETS = (
    r".*blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|attn2\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)"
    r"|ffn\.net\.(0\.proj|2))"
)


# The recipe a run takes for every field of it left out, by model. A real model's is the one its users expect:
# SkyReels-A2-14B's LoRA at 480x832, 81 frames. A built-in tiny model trains at its own size (infer.py samples it
# there too) with what learns on its random weights in minutes (README's main job: colour match and distance in
# demo.png): its blocks add their outputs through gates of ~0.1 and its output head is random, so the LoRA takes a
# larger alpha and the head (proj_out); its sampler spends most of its steps at high noise (its scheduler's shift is
# 8, A2's), where the shapes are placed, so training draws its sigmas the same way; a rate ten times a real model's.
RECIPES = {
    "model": dict(resolution=(480, 832), num_frames=81, lora_alpha=32.0, lora_target=LORA_TARGETS,
                  sigma_sampling="logit_normal", sigma_shift=5.0, lr=1e-4, warmup_steps=100, val_steps=None),
    "tiny": dict(resolution=(64, 64), num_frames=33, lora_alpha=320.0, lora_target=LORA_TARGETS + r"|proj_out",
                 sigma_sampling="shifted", sigma_shift=8.0, lr=1e-3, warmup_steps=10, val_steps=10),
}  # val_steps: a tiny model samples in 10 steps, as infer.py samples it (None: the kind's own)
# Kaleido's training yaml (zai-org/Kaleido configs/training/video_wanx_14B_concat.yaml: lr 5e-6, sat's warmup 0.01 of
# its 5000 iterations, 480x832, 81 frames) and RFLoss (logit-normal(0, 1) sigmas, shifted by the run's size:
# rf_shift, filled in TrainConfig.__post_init__)
RECIPES["kaleido"] = {k: v for k, v in dict(RECIPES["model"], sigma_sampling="logit_normal_shifted", lr=5e-6,
                                             warmup_steps=50).items() if k != "sigma_shift"}
RECIPES["tiny-kaleido"] = {k: v for k, v in dict(RECIPES["tiny"], sigma_sampling="logit_normal_shifted").items()
                           if k != "sigma_shift"}


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
    """A built-in tiny model (a2/tiny.py: tiny, tiny-t2v, ...), not a real-size random one (random-14B)."""
    return model == "tiny" or model.startswith("tiny-")


@dataclass(frozen=True)
class MemoryConfig:
    """How a training step fits on its GPU: the memory plan and the flags that force or replace its pieces, shared by
    train_a2.py and bench.py (their flags keep these names)."""

    mode: Annotated[Literal["auto", "manual"], tyro.conf.arg(name="memory")] = "auto"
    """How the step's memory is planned. auto (CUDA): one rule (a2/memory.py) plans it from the model, the shape and the
    free GPU and host memory before the weights move to the GPU, and prints the plan and why: the fewest recomputed
    blocks that fit, keeping their self-attention; then every block recomputed with what it keeps offloaded to host
    memory; then (LoRA) fp8 frozen weights; then the fewest blocks swapped to host memory. --gradient-checkpointing,
    --checkpoint-fraction and --save-attention are then ignored, and --fp8-base, --offload-activations and --swap-blocks
    force their piece on. manual, and on the CPU: all those flags as given."""
    max_memory_gb: float | None = None
    """Makes --memory auto plan for this many GiB per GPU instead of the free memory (e.g. 24 to plan for a smaller
    card); bench.py also caps the CUDA allocator there for its timed steps (a smaller card, emulated)."""
    dry_run: bool = False
    """Tells you before you rent whether a step fits: on any machine (no GPU, no weights read, no data loaded) it builds
    the transformer at real size on fake tensors, plans and applies its memory as on a GPU with --max-memory-gb (default
    80), traces two eager training steps' live bytes (a2/trace.py) and prints the device peak by category beside the
    plan's estimate, in GiB; with --fsdp or --context-parallel, of one rank. It exits 0 if the step fits, 3 if not."""
    dry_run_ranks: int | None = None
    """With --dry-run: the run's GPUs (torchrun's world size) it plans one rank of; --fsdp shards over them. Default:
    --context-parallel (one context-parallel group)."""
    compile: OnOffAuto = None
    """Compiles each transformer block with torch.compile (recomputed blocks together with their checkpoint); --compile
    False runs eager. Default: on with CUDA, the fastest setting that fits (A2-14B LoRA on an H100: 12.09 s/step
    compiled vs 15.31 eager, 55.2 vs 59.5 GiB peak; 1.3B full FT 3.16 -> 2.40 s/step), off on the CPU. The memory plan
    is made for the setting used (printed at start). It costs ~1 min up front and a recompile per new input shape
    (bucket); the recompile limit is raised to the run's shapes so that no block falls back to eager."""
    attention_backend: str | None = None
    """The diffusers attention backend (native, _native_cudnn, _native_flash, flash, _flash_3, ...). Default: PyTorch
    SDPA's own choice, which on an H100 ran as fast as _native_cudnn and 1.3x faster than _native_flash (bench.py)."""
    gradient_checkpointing: bool = True
    """With --memory manual: recomputes blocks in the backward (see --checkpoint-fraction)."""
    checkpoint_fraction: float = 1.0
    """With --memory manual: the fraction of transformer blocks recomputed in the backward (lower: faster, more
    memory)."""
    save_attention: bool = False
    """With --memory manual: selective checkpointing, where recomputed blocks keep their self-attention outputs (about
    half the forward FLOPs at 81x480x832) and redo only the rest (a2.transformer.configure_blocks). It costs tokens x
    dim bf16 per block (A2-14B at 81x480x832: 0.31 GiB, ~12.5 GiB for 40 blocks)."""
    offload_activations: bool = False
    """Moves what the recomputed blocks keep for the backward (their inputs; with --save-attention the attention
    outputs) to pinned host memory in the forward, and brings it back one block ahead in the backward, on a side CUDA
    stream (a2/offload.py). It costs host RAM of that size and two copies of it per step; the results are unchanged. Not
    with --fsdp."""
    swap_blocks: int = 0
    """Keeps the frozen weights of the last N blocks in pinned host memory and copies them to the GPU one block ahead of
    use, in the forward and the backward (a2/offload.py); LoRA only, not with --training-type full or --fsdp. It frees
    their bytes on the GPU (A2-14B: 0.65 GiB a block in bf16) for two host->GPU copies of them per step."""
    fp8_base: bool = False
    """Stores the frozen linear weights of the blocks as float8 e4m3 with per-output-channel scales, dequantized per
    layer in the forward (a2/fp8.py); LoRA only, not with --fsdp. It halves their bytes against bf16 (A2-14B: 15 GiB
    less). Norms, embeddings, the output head and the LoRA stay as they are, and the exported LoRA loads on the bf16
    model. Gradients differ from the bf16 model's by ~3% (e4m3 rounding, tests/test_fp8.py)."""
    fp8_matmul: bool = False
    """Multiplies the forward's linears fp8 x fp8 (torch._scaled_mm, the input quantized per token) instead of
    dequantizing to bf16, with --fp8-base on CUDA compute capability 9.0+ (H100); the backward stays bf16. It is off by
    default: not yet measured faster."""


@dataclass
class ModelConfig:
    """The model a run trains or samples, the parts it is completed with and its image encoder's input size
    (TrainConfig's and InferConfig's first flags)."""

    model: str = "tiny"
    """The model to train or sample: a diffusers-format model dir (SkyReels-A2, Wan2.1 I2V or T2V, Wan 2.2 A14B
    T2V/I2V, Wan 2.2 TI2V-5B, SkyReels-V3 R2V, Wan2.1-VACE, Wan2.2-VACE-Fun A14B; a Wan 2.2 pair samples with both
    experts); a Phantom-Wan or RefAlign checkpoint (file or dir, RefAlign's named so; each in its own layout, as V3 and
    VACE), or Wan-AI's Wan2.1-VACE / alibaba-pai's Wan2.2-VACE-Fun as released; a Hugging Face Hub id
    (Skywork/SkyReels-A2, downloaded once into the Hub cache; HF_HUB_OFFLINE is respected); a built-in offline tiny
    model, trained and sampled at its own size (RECIPES; infer.py: 64x64, 33 frames, 10 steps): tiny (A2-shaped),
    tiny-t2v, tiny-wan22-t2v, tiny-wan22-i2v, tiny-ti2v, tiny-phantom, tiny-v3, tiny-magref, tiny-refalign, tiny-vace,
    tiny-vace-fun (its expert pair); or a real-size model with random weights built on the GPU, for speed and memory
    at real shapes without a download: random-1.3B (Wan2.1 T2V 1.3B), random-14B (A2 / Wan2.1 I2V 14B), random-5B
    (Wan 2.2 TI2V-5B)."""
    image_encoder: str | None = None
    """A dir (or Hub id) with image_encoder/ + image_processor/ (CLIP ViT-H/14) that gives a T2V base expanded to E2V
    (a transformer with an image branch whose model dir has none) its image branch."""
    clip_size: int = 512
    """The square size that the CLIP-path element images are brought to (A2: 512, pad_white) before
    CLIPImageProcessor."""
    components: str | None = None
    """A dir (or Hub id) of the diffusers Wan parts that a released original-Wan checkpoint (Phantom-Wan, MAGREF) runs
    with: vae/, text_encoder/, tokenizer/, scheduler/, and for MAGREF image_encoder/ and image_processor/. Default: the
    checkpoint's own dir when it holds them, else Wan2.1-T2V-1.3B-Diffusers (Phantom) or Wan2.1-I2V-14B-480P-Diffusers
    (MAGREF) from the Hub."""


@dataclass
class TrainModelConfig(ModelConfig):
    """The model a run trains, the parts it is completed with, the expert of a Wan 2.2 pair and the paths the
    references take."""

    e2v_type: Literal["auto", "dual", "vae", "clip"] = "auto"
    """Which paths the references take. dual: VAE latents and CLIP tokens (A2); vae: VAE only (no image branch); clip:
    CLIP only; auto: dual when the model has an image branch (or gets one: a T2V base with --image-encoder), vae for Wan
    2.2 I2V A14B, which has none."""
    expert: Literal["high", "low"] | None = None
    """Trains one expert of a Wan 2.2 A14B pair: high is `transformer` (sigma >= boundary_ratio, the noisy steps), low
    is `transformer_2` (sigma < boundary_ratio). Only that expert is loaded, and sigma is drawn from --sigma-sampling's
    distribution truncated to the expert's range (inverse CDF), so the two experts together see exactly that
    distribution."""


@dataclass
class LoraConfig:
    """What trains: a LoRA (its shape and where it goes) or all the transformer's weights."""

    training_type: Literal["lora", "full"] = "lora"
    """What trains. lora: a LoRA adapter on the frozen transformer; full: all transformer weights."""
    lora_rank: int = 32
    """The LoRA rank r (the columns of the down matrix)."""
    lora_alpha: float | None = None
    """The LoRA alpha: the update is scaled by alpha / rank. Left out: the model's recipe (RECIPES)."""
    lora_dropout: float = 0.0
    """The dropout probability on the LoRA input."""
    lora_target: str | None = None
    """The modules that get a LoRA, as a regex over module names (peft's full match): self- and cross-attention q/k/v/o,
    the image K/V projections and the FFN (LORA_TARGETS), and a tiny model's output head too.
    Left out: the model's recipe (RECIPES)."""
    vace_lora_target: Literal["vace", "base", "both"] | None = None
    """On a VACE model (Wan2.1-VACE, Wan2.2-VACE-Fun), the blocks whose --lora-target modules get the LoRA: vace, its
    context blocks; base, the transformer blocks; both. Left out: vace, for subject fidelity: the references reach
    the model through the context blocks alone, so that is where it learns them, while the base's text-to-video stays
    as it was; it is also what the labs train (VideoX-Fun's VACE-Fun --trainable_modules vace, DiffSynth-Studio's VACE
    LoRAs --lora_base_model vace, VACE's paper on a frozen base)."""


@dataclass
class ParallelConfig:
    """Where a run computes and how it splits over ranks."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train. auto: CUDA when there is a GPU (each torchrun rank on its LOCAL_RANK GPU), else the CPU."""
    mixed_precision: Literal["bf16", "no"] = "bf16"
    """Computes in bf16 autocast on CUDA (fp32 master weights); ignored on the CPU."""
    fsdp: bool = False
    """Shards the transformer over the ranks (FSDP2 fully_shard per block, then the root; bf16 compute / fp32 reduce on
    CUDA) instead of DDP, for a model one GPU cannot hold: each rank keeps 1/N of the weights and gathers a block at a
    time. Full fine-tuning shards the gradients and optimizer state too; a LoRA shards the frozen base (its adapter
    trains, checkpoints and exports as under DDP). Only rank 0 reads the weights (the others build the model on the
    meta device and receive their shards), so host RAM holds one full copy, not one per rank. Checkpoints are sharded
    (torch.distributed.checkpoint, loadable at another world size; a LoRA's hold the adapter alone); the export is
    gathered on rank 0."""
    context_parallel: int = 1
    """Splits each sample's tokens over this many ranks (Ulysses context parallel, a2/parallel.py): torchrun's world is
    data-parallel ranks x this. Consecutive ranks form a group (one node), train the same samples with the same noise
    and timestep, and each holds 1/N of the sequence's activations. N must divide the attention heads (14B: 40, 1.3B:
    12). It works with DDP or --fsdp (sharded over all ranks); the global batch counts data-parallel ranks only."""


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


@dataclass
class ObjectiveConfig:
    """The flow-matching loss: how sigma is drawn and how the loss is weighted."""

    sigma_sampling: Literal["logit_normal", "uniform", "shifted", "logit_normal_shifted"] | None = None
    """How the training sigma is drawn. logit_normal(0, 1): SD3's default, which puts the steps where flow matching
    learns most; uniform; shifted: uniform u mapped by shift·u/(1+(shift-1)·u), the sampler's schedule;
    logit_normal_shifted: the logit-normal draw mapped so (Kaleido's RFLoss, its shift by the training size).
    Left out: the model's recipe (RECIPES)."""
    logit_mean: float = 0.0
    """The mean of the normal whose sigmoid is sigma (--sigma-sampling logit_normal)."""
    logit_std: float = 1.0
    """The standard deviation of that normal (--sigma-sampling logit_normal)."""
    sigma_shift: float | None = None
    """The shift of --sigma-sampling shifted and logit_normal_shifted (1: none; larger: more steps at high noise).
    Left out: the model's recipe (RECIPES)."""
    loss_weighting: Literal["none", "cosmap"] = "none"
    """The per-sample loss weight over sigma: none (plain MSE) or cosmap (SD3's 2 / (pi (1 - 2 sigma + 2 sigma^2)))."""
    loss_on_references: bool = True
    """Includes the reference latent frames in the loss (the model denoises them at inference too)."""
    timestep_buckets: int = 0
    """Stratifies the sigmas of each global batch over this many equal-probability buckets of the --sigma-sampling
    distribution (every bucket once per N samples; a2/flow.py timestep_bucket), the same for every split over ranks and
    accumulation. At a global batch of a few samples this evens out the sigmas each step sees. 0 (default): independent
    draws, the distribution itself."""


@dataclass
class ReferencesConfig:
    """What a sample's prompt and references go through in training: dropout, augmentation, RefAlign's alignment
    loss."""

    text_dropout: float = 0.1
    """The probability of training a sample with the empty prompt (classifier-free guidance on text)."""
    reference_dropout: float = 0.0
    """The probability of dropping all references of a sample (zero condition latents, mask and image tokens)."""
    joint_dropout: float = 0.0
    """The probability of dropping the prompt and the references together. Above 0 the three dropouts are exclusive
    cases of one draw, as RefAlign trains (its 0.1 / 0.1 / 0.1: the prompt alone, the references alone, both); at 0 the
    prompt and the references are dropped independently."""
    reference_augment: bool = False
    """Augment each reference image every step before it is encoded (RefAlign's: flip, rotation up to 45 degrees,
    shear, scale/translate, perspective, colour/brightness jitter, blur; white fill, a2/augment.py), drawn from the
    sample's seed. It needs the pixels: not with --cache-dir, whose latents are of the images as read."""
    align_loss: bool = False
    """Add RefAlign's reference-alignment loss (a2/align.py): the reference tokens after --align-blocks, through
    per-block projectors, aligned with DINOv3 features of the reference images (--align-model). Kinds phantom, v3,
    incontext, standin (the others have no reference tokens). The projectors train with the run, never exported."""
    align_model: str | None = None
    """The local DINOv3 model dir (transformers' DINOv3ViTModel) of the alignment targets; RefAlign uses ViT-B/16
    (768-d) for the 1.3B model and ViT-L/16 (1024-d) for the 14B."""
    align_blocks: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8)
    """The blocks whose output reference tokens are aligned (RefAlign: the first nine)."""
    align_weight: float = 1.0
    """The weight of the alignment loss added to the flow-matching loss."""
    align_gate_floor: float = 0.0
    """The floor of the alignment loss's timestep gate, floor + (1 - floor) (t/1000)^power (RefAlign: 0 and 3, its
    gate_from_timestep(t, 0, 1000, beta=3.0) in diffsynth/pipelines/wan_video_new6.py)."""
    align_gate_power: float = 3.0
    """The power of the timestep gate (see --align-gate-floor)."""


@dataclass
class OptimConfig:
    """The optimizer, its schedule, the batch and the run's length."""

    lr: float | None = None
    """The AdamW peak learning rate (after warmup). Left out: the model's recipe (RECIPES)."""
    weight_decay: float = 0.0
    """The AdamW decoupled weight decay (per step, multiplied by the learning rate)."""
    adam_eps: float = 1e-8
    """The AdamW epsilon. Components whose gradient is below it are pure rounding noise (q/k null directions), which
    Adam would scale up to ~lr; equivalence tests raise it to 1e-4 to compare runs to 1e-6."""
    warmup_steps: int | None = None
    """The optimizer steps of linear learning-rate warmup, from lr / warmup_steps to lr.
    Left out: the model's recipe (RECIPES)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """The learning rate after warmup: constant, or cosine decay to 0 at --max-steps."""
    max_grad_norm: float = 1.0
    """Clips the global gradient L2 norm to this (the norm is logged as grad_norm, before clipping)."""
    max_nonfinite_steps: int = 3
    """Stops a diverged run: a step whose loss or gradient norm is not finite has its optimizer step skipped (on the
    device, no extra sync), and after this many in a row the run stops (exit 1) naming its last checkpoint with finite
    weights. It is checked at every log step and checkpoint; no checkpoint is written while the last step was
    non-finite."""
    ema_decay: float = 0.0
    """Keeps an EMA of the trained weights with this decay (e.g. 0.999), warmed up as min(decay, (1+t)/(10+t)) after
    step t (a2/ema.py). It is kept on the device (--fsdp: sharded like the weights), checkpointed and resumed, used for
    the validation videos and the eval loss (eval_ema/...), and exported beside the weights (..._ema.safetensors or
    transformer_ema/). 0 (default): off; it costs one more copy of the trained weights."""
    micro_batch: int = 1
    """The samples per rank per forward."""
    grad_accum: int = 1
    """The micro-batches accumulated per optimizer step (global batch = micro_batch x grad_accum x ranks)."""
    max_steps: int = 2000
    """The optimizer steps of the whole run (a resumed run counts on from its checkpoint's step)."""
    seed: int = 0
    """Seeds everything random (data order, sigma, noise, dropout, VAE posterior): each draw is a function of this seed,
    the step and the sample's index in the global batch, never of the rank."""
    overfit_batches: int = 0
    """A debug check: trains on the first N global batches only, each coming back with the same sigma, noise and
    dropout. The loss must fall far towards 0; a loop or conditioning bug shows here first."""


@dataclass
class RunDirConfig:
    """The run dir: where it is, its checkpoints, resuming and the logs."""

    output_dir: str = "runs"
    """The parent dir of the run dirs."""
    run_name: str | None = None
    """The run dir's name under --output-dir (default: a timestamp)."""
    resume: str | None = None
    """`auto`: continue this run dir from its newest complete checkpoint (a dir that does not exist yet, or holds
    none, starts at step 0, so the same command serves the first launch and every requeue); or a checkpoint dir.
    Checked against this run's config before any model loads. Without --resume a run dir holding checkpoints is
    refused. Exit codes: 0 done; 143 stopped by SIGTERM/SIGINT (any rank, torchrun or the process group) after
    checkpointing the step it was in: resumable; 2 an input problem (config, data, run dir in use, checkpoint that
    does not fit), one line; 1 a failure (a diverged run names its last checkpoint with finite weights)."""
    ckpt_every: int = 500
    """Writes a checkpoint every N optimizer steps (and at the end, and on SIGTERM/SIGINT)."""
    keep_last: int = 3
    """The complete checkpoints kept in the run dir (older ones are deleted)."""
    log_every: int = 10
    """Logs loss, lr, grad norm and throughput to metrics.jsonl every N steps (the one host sync of a step)."""
    tensorboard: bool = False
    """Also writes the logged values as TensorBoard scalars into run_dir/tb."""


@dataclass
class ValidationConfig:
    """The eval loss on held-out samples and the validation videos."""

    eval_split: int = 0
    """Holds out this many clips of the training data (all their windows) for the eval loss, drawn with --seed and never
    trained on. 0 (default): none (an --eval-manifest or a dataset config's `eval` datasets can still be given)."""
    eval_manifest: str | None = None
    """A held-out dataset for the eval loss, listed like --manifest (read with the training data's settings)."""
    eval_every: int = 0
    """Computes the eval loss every N steps (and at the end) when there are held-out samples (0: at the end only): the
    loss of each held-out sample at --eval-quantiles fixed sigmas with fixed noise (the same draws each time), as
    eval/loss and eval/loss@<sigma> in metrics.jsonl and tensorboard. It costs one forward per sample per sigma, split
    over ranks."""
    eval_quantiles: int = 9
    """The number of sigmas of the eval loss: the quantiles (i + 1) / (n + 1), i < n, of the --sigma-sampling
    distribution (in the expert's range on Wan 2.2); 9 as diffusion-pipe (0.1 ... 0.9)."""
    val_every: int = 0
    """Renders validation videos every N steps (0: only at the end, when --val-elements are given). Text-only runs
    (--dataset-type t2v) render --val-prompt alone, every N steps."""
    val_elements: tuple[str, ...] = ()
    """The validation element images (path or name=path), as infer.py --elements. On a Wan 2.2 TI2V-5B image-to-video
    run (--frame-conditioning first), one image: the first frame (as infer.py --image)."""
    val_prompt: str = "A man is holding a teddy bear in the forest."
    """The prompt of the validation videos."""
    val_steps: int | None = None
    """The sampler steps of a validation video (default: the kind's own, a tiny model's 10 (RECIPES), as infer.py's; a
    validation video is the one infer.py makes from the exported weights, the same prompt and elements and no sampling
    flag)."""
    val_guidance_scale: float | None = None
    """The classifier-free guidance scale of the validation videos (default: the kind's own, as infer.py's)."""
    val_flow_shift: float | None = None
    """The sampler shift of the validation videos (default: the kind's own, as infer.py's)."""
    val_metrics: bool = True
    """Scores each validation video (a2/evaluate.py) into metrics.jsonl (and tensorboard) as val/<metric> at its step:
    motion, temporal consistency and CLIP-I with the model's own image encoder; DINO-I, CLIP-T and face similarity with
    the --eval.* dirs (loaded once, kept on the GPU in the training dtype)."""


@dataclass
class TrainConfig:
    """E2V training on Wan / SkyReels-A2. Defaults are a LoRA; the size, frames, LoRA alpha and targets, sigma
    sampling and learning rate left out are the model's recipe (RECIPES): A2-14B's at 480x832, 81 frames, or a
    built-in tiny model's own."""

    model: tyro.conf.OmitArgPrefixes[TrainModelConfig] = field(default_factory=TrainModelConfig)
    """The model a run trains, the parts it is completed with, the expert of a Wan 2.2 pair and the paths the
    references take."""
    lora: tyro.conf.OmitArgPrefixes[LoraConfig] = field(default_factory=LoraConfig)
    """What trains: a LoRA (its shape and where it goes) or all the transformer's weights."""
    parallel: tyro.conf.OmitArgPrefixes[ParallelConfig] = field(default_factory=ParallelConfig)
    """Where a run computes and how it splits over ranks."""
    memory: tyro.conf.OmitArgPrefixes[MemoryConfig] = field(default_factory=MemoryConfig)
    """How the step fits on each GPU (a2/memory.py): the plan, recomputation, offload, fp8, block swap, compilation,
    the dry run."""
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
    --eval.face; a2/evaluate.py); a metric whose encoder is not given is skipped with one message."""

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
SECTIONS = dict(model=TrainModelConfig, lora=LoraConfig, parallel=ParallelConfig, data=DataConfig,
                objective=ObjectiveConfig, references=ReferencesConfig, optim=OptimConfig, rundir=RunDirConfig,
                validation=ValidationConfig)
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}  # flag's field -> its section


def from_flags(**flags) -> TrainConfig:
    """A TrainConfig from its flags' names (lr=1e-3, memory=MemoryConfig(...)), as the CLI takes them: each goes
    to its section; for Python callers and tests."""
    parts = {name: {} for name in SECTIONS}
    rest = {}
    for k, v in flags.items():
        (parts[SECTION_OF[k]] if k in SECTION_OF else rest)[k] = v
    return TrainConfig(**{name: SECTIONS[name](**kw) for name, kw in parts.items()}, **rest)


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


def run_datasets(cfg: TrainConfig) -> list[DatasetConfig]:
    """The datasets of a run (dataset_configs) of its data and conditioning sections, --clip-size and --eval-manifest;
    a --resolution typed (not the recipe's) is held against a dataset file's. train_a2.py and data.py validate, before
    their heavy imports and after."""
    return dataset_configs(cfg.data, cfg.conditioning, cfg.model.clip_size, cfg.validation.eval_manifest,
                           resolution_given="resolution" not in cfg.filled)


def with_eval_manifest(eval_manifest: str | None, cfgs: list[DatasetConfig]) -> list[DatasetConfig]:
    """--eval-manifest: a held-out dataset listed like --manifest (relative paths beside it), read as the first
    dataset's settings read it (elements, sizes, frame extraction)."""
    if not eval_manifest:
        return cfgs
    manifest = Path(eval_manifest).resolve()
    return cfgs + [replace(cfgs[0], data_root=str(manifest.parent), manifest=str(manifest), weight=1.0, eval=True,
                           source="--eval-manifest")]


# ---------------------------------------------------------------- inference (infer.py)


@dataclass
class InferConfig(ModelConfig):
    """Generate a video from element images and a prompt (or a prompt alone on a T2V model), check parity between
    runs, or compare a LoRA with its base model over a prompt list or an eval set."""

    transformer: str | None = None
    """A transformer dir that replaces the model's own: a full fine-tune (train_a2.py's runs/<run>/transformer), e.g. a
    T2V model trained as E2V after expansion; with a Wan 2.2 pair, the high-noise expert."""
    transformer_2: str | None = None
    """A low-noise expert dir that replaces a Wan 2.2 A14B model's transformer_2 (runs/<run>/transformer_2)."""
    elements: tuple[str, ...] = ()
    """The element images in position order, each `path` or `name=path` (the name from --element-specs, e.g.
    subject=me.png). Leave it empty for a T2V model (text only)."""
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
    (a2.kinds.kind_elements): SkyReels-A2's subject/object/background; on the released S2V models (Phantom-Wan,
    SkyReels-V3 R2V, RefAlign, MAGREF) ref0, ref1, ... framed as their labs frame references (one frame each,
    fit_pad_white)."""
    preset: Literal["v3-cfg", "diffusers"] | None = None
    """Samples as another of the lab's own entry points for its model (a2.kinds.Kind.modes). v3-cfg: SkyReels-V3's
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
    prompt: str = "A man is holding a teddy bear in the forest."
    """The text prompt of the video."""
    negative_prompt: str | None = None
    """The negative prompt of classifier-free guidance (default: the model's own sampler's: A2's English one, Wan's
    Chinese one, MAGREF's, V3's empty one)."""
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
    0, steps + 1) without the 0 (a2/pipeline.py schedule_sigmas)."""
    conditioning: tyro.conf.OmitArgPrefixes[ConditioningConfig] = field(default_factory=ConditioningConfig)
    """How the element images condition the model: train_a2.py's conditioning flags, so a run samples with the
    flags it trained with."""
    decode: Literal["drop_refs", "video_only", "all", "none"] | None = None
    """What is decoded. drop_refs: all latents, then the reference frames are dropped (A2, MAGREF); video_only: the
    video latents alone (VACE); all: every frame, the references' included; none: no decode, the latents only (e.g.
    for --save-latents). Default: the kind's own sampler's."""
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
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype of all model weights and of the computation."""
    device: str = "auto"
    """Torch device to run on (cuda, cuda:1, cpu). auto: the GPU when there is one, else the CPU."""
    out: str = "outputs/a2.mp4"
    """The output mp4 path."""
    fps: int | None = None
    """The frames per second of the written mp4. Left out: the kind's own (docs/kinds.md): A2 and MAGREF 15,
    Phantom-Wan, RefAlign and Wan VACE 16, SkyReels-V3 24, Stand-In 25."""
    side_by_side: bool = True
    """Shows the reference images left of each frame, as A2's infer.py does."""
    save_latents: str | None = None
    """Writes the final latents and the condition tensor here (a parity reference)."""
    compare: str | None = None
    """Compares this run's latents and condition with a --save-latents file; exits 1 when max |Δ| > --tolerance."""
    tolerance: float = 1e-4
    """The largest max |Δ| per tensor that passes --compare."""
    prompts_file: str | None = None
    """Evaluates a LoRA: renders every prompt of this file (one per line, or .jsonl rows with a `prompt` field, e.g. a
    train.jsonl; rows may carry elements and a seed as in --eval-set) without and with --lora, same seed, side by side
    (left: base, right: LoRA), one mp4 per prompt."""
    eval_set: str | None = None
    """Renders and scores an eval set. An OpenS2V-Eval set as downloaded (`OpenS2V-Eval/Open-Domain_Eval.json`, beside
    its Images/) renders one <sample id>.mp4 per sample into --out-dir (resumable), scored by `python3 -m a2.opens2v`. A
    .jsonl file scores the model (and a --lora against it) on a2's own metrics, one video per row: {"prompt": "...",
    "elements": {"subject": "me.png", ...} or ["me.png", ...] (by position; paths relative to the file), "seed": 1,
    "faces": ["subject"]}; elements, seed and faces are optional (default --elements, --seed, --eval.faces). Each row is
    rendered (without | with the LoRA, same seed, side by side) and scored by a2/evaluate.py into --out-dir's
    metrics.csv and metrics.jsonl (a row per video and element, plus the means), and the means are printed with the base
    vs LoRA deltas."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The local encoder dirs that score --eval-set videos (--eval.clip-image, --eval.dino, --eval.clip-text,
    --eval.face; a2/evaluate.py); a metric whose encoder is not given is skipped with one message."""
    out_dir: str = "outputs/eval"
    """Where --prompts-file and --eval-set write <index>_<prompt>.mp4 and prompts.jsonl (file -> prompt)."""

    def __post_init__(self):
        self.lora = (self.lora,) if isinstance(self.lora, str) else tuple(self.lora or ())  # lora="x" from Python
        height_width(self.height, self.width, self.resolution, (0, 0))  # --resolution and --height/--width agree
        if self.num_frames is not None:
            check_frames(self.num_frames)


# ---------------------------------------------------------------- benchmark (bench.py)


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
    """The conditioning kind of a2/conditioning.py whose step is timed, as train_a2.py's (model_inputs + forward_loss)
    on a synthetic batch: --refs element images clipped to what the kind holds, its first --frame-conditioning mode, and
    a 36-channel model where the kind conditions on channels. default: A2's prefix kind (--refs CLIP images; the
    reference frames are part of --frames), t2v with --refs 0, phantom with --align-refs N. E.g. magref: MAGREF's
    canvas, one CLIP image; standin: Stand-In on T2V, one reference's tokens appended, its reference LoRA (rank
    --lora-rank) trained instead of a peft LoRA."""
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
    ema_decay: float = 0.0
    """Times the step with train_a2.py's EMA of the trained weights at this decay (--ema-decay; 0: none)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype (bfloat16: autocast; frozen LoRA base weights are stored in it). auto: bfloat16 on a GPU, float32
    on the CPU."""
    steps: int = 5
    """The timed training steps (with --data-root: timed samples)."""
    warmup: int = 2
    """The untimed steps run first (compilation, allocator warmup)."""
    out: str | None = None
    """Appends the result as one JSON line to this file."""
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
    check_backends: tuple[str, ...] = ()
    """Checks these attention backends instead of timing: the relative L2 error of the output and the gradients under
    bf16 autocast with each of them against an fp32 reference, on the preset cut to 2 blocks (does the fast kernel train
    right?)."""
    peak_tflops: float | None = None
    """The device's peak dense TFLOP/s for MFU (default: looked up from the GPU name; none on the CPU)."""
    context_parallel: int = 1
    """With --dry-run: plans and traces one rank of a context-parallel group of N (a2/parallel.py, emulated in one
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
    memory_table: bool = False
    """Prints docs/memory.md's memory table instead of timing: the rule's plan for each row of bench.py's MEMORY_GRID
    (A2-14B and SkyReels-V3, LoRA and full, 480p and 720p, context parallel 1-8, FSDP, 24-141 GiB cards); with
    --dry-run also each plan traced at full size (minutes a row)."""
    compare_run: str | None = None
    """A train_a2.py run dir at the same shape and settings: also prints its median s/step (metrics.jsonl, after the
    first logged interval) against this step's, as the training loop's overhead over the bare step."""

    def __post_init__(self):
        height_width(self.height, self.width, self.resolution, (64, 64))  # they agree, multiples of 16 (told now)
        check_frames(self.frames, "--frames")
        if self.compare_run and not (Path(self.compare_run) / "metrics.jsonl").is_file():
            raise ConfigError(f"--compare-run {self.compare_run}: no metrics.jsonl there (a train_a2.py run dir)")

    @property
    def size(self) -> tuple[int, int]:
        """(height, width): --resolution or --height/--width, 64 for what is given by neither."""
        return height_width(self.height, self.width, self.resolution, (64, 64))


# ---------------------------------------------------------------- data.py's commands (a2/public_index.py's indexes)


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


@dataclass
class IndexOpenS2V:
    """Index OpenS2V-5M as downloaded (Videos/total_partN/, Background/total_partN/, Jsons/mask_and_bbox_High-
    Quality/total_partN.json): streams each part's JSON (never loaded whole), one part at a time, resumable."""

    root: tyro.conf.Positional[str]
    """The dataset dir (Videos/, Background/, Jsons/)."""
    out: tyro.conf.Positional[str]
    """The dir for index.jsonl, report.txt and the per-part files (for resuming)."""
    min_crop_ratio: float = 0.1
    """Drops a subject/object mask whose tight box covers less than this fraction of the cropped frame (BindWeave)."""
    min_aes: float = 4.5
    """Keeps a mask with an aesthetic score >= this, or a GME score >= --min-gme (BindWeave: 4.5)."""
    min_gme: float = 0.6
    """Keeps a mask with a GME score >= this, or an aesthetic score >= --min-aes (BindWeave: 0.6)."""
    min_background_aes: float = 0.0
    """Uses the Background png only when its background_ase_score >= this (BindWeave's feature extraction uses 10.0,
    which keeps almost none; the demo dataloader keeps all)."""
    background: bool = True
    """Uses the Background png (a clip without one is kept without a background, counted and named in the report);
    --no-background indexes no background."""
    cross_pairs: str | None = None
    """The cluster_videos.json of Jsons/cross_video_pairs: marks each listed clip with its cluster, for training's
    --cross-video (the reference from a paired clip)."""

    def rule(self) -> str:
        return (f"subject/object masks by word_tags (subject+pre_define -> subject, object -> object); a mask is kept "
                f"if crop_ratio >= {self.min_crop_ratio} and (aes >= {self.min_aes} or gme >= {self.min_gme}), the "
                f"largest subject crop when no subject mask is kept; references: every kept mask, largest first "
                f"(A2's subject / object: the largest of each); background png if found and background_ase_score >= "
                f"{self.min_background_aes}, else none")


@dataclass
class IndexPhantom:
    """Index Phantom-Data (koala36M_multi_ref_merged_filtered.parquet + the clips you downloaded), streamed in
    row groups (one resumable part each)."""

    root: tyro.conf.Positional[str]
    """The dir holding koala36M_multi_ref_merged_filtered.parquet (or give --parquet)."""
    out: tyro.conf.Positional[str]
    """The dir for index.jsonl, report.txt and the per-part files (for resuming)."""
    videos: str | None = None
    """The dir of the downloaded clips, <vid>.mp4 (default ROOT/videos)."""
    parquet: str | None = None
    """The training meta parquet (default ROOT/koala36M_multi_ref_merged_filtered.parquet)."""

    def rule(self) -> str:
        return ("each cross_pair phrase is a reference: its first refer_result whose clip is downloaded; a person "
                "phrase/box class first (A2's subject), the others in phrase order (the first: A2's object); box "
                "(768 canvas) scaled to the frame and clipped")


@dataclass
class IndexHumoSet:
    """Index HuMoSet (video/, reference_image/, video_caption.parquet): the reference photo is the subject."""

    root: tyro.conf.Positional[str]
    """The dataset dir (video/, reference_image/, video_caption.parquet)."""
    out: tyro.conf.Positional[str]
    """The dir for index.jsonl, report.txt and the per-part files (for resuming)."""

    def rule(self) -> str:
        return "reference_image/<video stem>.<png|jpg|jpeg|webp> (or the parquet's reference column) -> subject"


@dataclass
class ExportElements:
    """Write the element images training builds from an index: DIR/<clip key>/<element>.png + DIR/produced.json."""

    manifest: str
    """The index.jsonl of `data.py index`."""
    out: str
    """The dir to write into (created)."""
    sam: str | None = None
    """Segments the box and photo references with this local SAM dir (as training with --sam)."""
    cross_video: bool = False
    """Takes subject and object from a paired clip of the same cluster (as training with --cross-video)."""
    limit: int = 0
    """Exports only the first N clips (0: all)."""


IndexCommand = Annotated[IndexOpenS2V, tyro.conf.subcommand("opens2v")] | \
    Annotated[IndexPhantom, tyro.conf.subcommand("phantom")] | Annotated[IndexHumoSet, tyro.conf.subcommand("humoset")]

# `data.py COMMAND ...` (as tyro.extras.subcommand_cli_from_dict builds it, parsed by parse_cli)
DataCommand = (Annotated[Any, tyro.conf.subcommand("make-sample", constructor=MakeSample)]
               | Annotated[Any, tyro.conf.subcommand("validate", constructor=Validate)]
               | Annotated[Any, tyro.conf.subcommand("index", constructor=IndexCommand, description=(
                   "Index a public S2V dataset as published (OpenS2V-5M, Phantom-Data, HuMoSet) for training."))]
               | Annotated[Any, tyro.conf.subcommand("export-elements", constructor=ExportElements)])


help_from_docstrings(globals())
