"""The config's sections: what library code reads of a run's flags, one dataclass per concern (the shape of
torchtitan's job config), and the commands of the library's own entry points (python3 -m a2.eval.opens2v, data.py index
and export-elements). config.py makes the CLIs of them (TrainConfig is these sections, with the data section of
a2/config/dataset_config.py beside the dataset file); a library function takes the sections it reads, never a whole
CLI's config. Each field's docstring is its --help. It imports tyro, the standard library and a2/cli.py only, so that a
script parses its flags before its heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

import tyro

from a2.cli import ConfigError, OnOffAuto, help_from_docstrings


def resolve_compile(compile: bool | None, device_type: str) -> bool:
    """--compile as given, else on with CUDA and off on the CPU (MemoryConfig.compile)."""
    return device_type == "cuda" if compile is None else compile


# ---------------------------------------------------------------- evaluation (a2/eval/evaluate.py, a2/eval/opens2v.py)


@dataclass
class EvalConfig:
    """Encoders that score generated videos (a2/eval/evaluate.py): local dirs only, nothing downloads; a metric whose
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
    (non-finite rows: no face); or an OpenS2V-Weight dir (--eval.facesim's face model); or a transformers image model
    dir, which embeds whole images (for face-crop references and videos)."""
    faces: tuple[str, ...] = ("subject",)
    """The elements scored by --eval.face (A2's subject is a person)."""
    max_frames: int = 0
    """Scores this many evenly spaced frames (0: all)."""
    # OpenS2V-Eval v1.1's metrics under their names (a2/eval/opens2v.py), computed on the decoded video tensor

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


# EvalConfig's fields of a2's own metrics (a2/eval/evaluate.py), not OpenS2V-Eval's
OWN_METRICS = ("clip_image", "clip_text", "dino", "face", "faces", "max_frames")


@dataclass
class OpenS2VConfig:
    """Score a dir of <sample id>.mp4 with OpenS2V-Eval v1.1's metrics (those a2 computes; their own scripts' files
    in the same dir are merged too) and their TotalScore: python3 -m a2.eval.opens2v."""

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
    a2/eval/opens2v_leaderboard/)."""
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


# ---------------------------------------------------------------- training (config.TrainConfig's sections)


LORA_TARGETS = (
    r".*blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|attn2\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)"
    r"|ffn\.net\.(0\.proj|2))"
)


@dataclass(frozen=True)
class MemoryConfig:
    """How a training step fits on its GPU: the memory plan and the flags that force or replace its pieces, shared by
    train_a2.py and bench.py (their flags keep these names)."""

    mode: Annotated[Literal["auto", "manual"], tyro.conf.arg(name="memory")] = "auto"
    """How the step's memory is planned. auto (CUDA): one rule (a2/memory/memory.py) plans it from the model, the shape
    and the free GPU and host memory before the weights move to the GPU, and prints the plan and why: the fewest
    recomputed blocks that fit, keeping their self-attention; then every block recomputed with what it keeps offloaded
    to host memory; then (LoRA) fp8 frozen weights; then the fewest blocks swapped to host memory.
    --gradient-checkpointing, --checkpoint-fraction and --save-attention are then ignored, and --fp8-base,
    --offload-activations and --swap-blocks force their piece on. manual, and on the CPU: all those flags as given."""
    max_memory_gb: float | None = None
    """Makes --memory auto plan for this many GiB per GPU instead of the free memory (e.g. 24 to plan for a smaller
    card); bench.py also caps the CUDA allocator there for its timed steps (a smaller card, emulated)."""
    dry_run: bool = False
    """Tells you before you rent whether a step fits: on any machine (no GPU, no weights read, no data loaded) it builds
    the transformer at real size on fake tensors, plans and applies its memory as on a GPU with --max-memory-gb (default
    80), traces two eager training steps' live bytes (a2/train/trace.py) and prints the device peak by category beside
    the plan's estimate, in GiB; with --fsdp or --context-parallel, of one rank. It exits 0 if the step fits, 3 if
    not."""
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
    half the forward FLOPs at 81x480x832) and redo only the rest (a2.model.transformer.configure_blocks). It costs
    tokens x dim bf16 per block (A2-14B at 81x480x832: 0.31 GiB, ~12.5 GiB for 40 blocks)."""
    offload_activations: bool = False
    """Moves what the recomputed blocks keep for the backward (their inputs; with --save-attention the attention
    outputs) to pinned host memory in the forward, and brings it back one block ahead in the backward, on a side CUDA
    stream (a2/memory/offload.py). It costs host RAM of that size and two copies of it per step; the results are
    unchanged. Not with --fsdp."""
    swap_blocks: int = 0
    """Keeps the frozen weights of the last N blocks in pinned host memory and copies them to the GPU one block ahead of
    use, in the forward and the backward (a2/memory/offload.py); LoRA only, not with --training-type full or --fsdp. It
    frees their bytes on the GPU (A2-14B: 0.65 GiB a block in bf16) for two host->GPU copies of them per step."""
    fp8_base: bool = False
    """Stores the frozen linear weights of the blocks as float8 e4m3 with per-output-channel scales, dequantized per
    layer in the forward (a2/memory/fp8.py); LoRA only, not with --fsdp. It halves their bytes against bf16 (A2-14B: 15
    GiB less). Norms, embeddings, the output head and the LoRA stay as they are, and the exported LoRA loads on the bf16
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
    """The model to train or sample: a diffusers-format model dir (SkyReels-A2, Wan2.1 I2V or T2V, Wan 2.2 A14B T2V/I2V,
    Wan 2.2 TI2V-5B, SkyReels-V3 R2V, Wan2.1-VACE, Wan2.2-VACE-Fun A14B; a Wan 2.2 pair samples with both experts); a
    Phantom-Wan or RefAlign checkpoint (file or dir, RefAlign's named so; each in its own layout, as V3 and VACE), or
    Wan-AI's Wan2.1-VACE / alibaba-pai's Wan2.2-VACE-Fun / zai-org's Kaleido-14B-S2V (SAT) as released; a Hugging Face
    Hub id (Skywork/SkyReels-A2, downloaded once into the Hub cache; HF_HUB_OFFLINE is respected); a built-in offline
    tiny model, trained and sampled at its own size (RECIPES; infer.py: 64x64, 33 frames, 10 steps): tiny (A2-shaped),
    tiny-t2v, tiny-wan22-t2v, tiny-wan22-i2v, tiny-ti2v, tiny-phantom, tiny-v3, tiny-magref, tiny-refalign, tiny-vace,
    tiny-vace-fun (its expert pair), tiny-kaleido; or a real-size model with random weights built on the GPU, for speed
    and memory at real shapes without a download: random-1.3B (Wan2.1 T2V 1.3B), random-14B (A2 / Wan2.1 I2V 14B),
    random-5B (Wan 2.2 TI2V-5B)."""
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
class LoraSection:
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
    """Splits each sample's tokens over this many ranks (Ulysses context parallel, a2/model/parallel.py): torchrun's
    world is data-parallel ranks x this. Consecutive ranks form a group (one node), train the same samples with the same
    noise and timestep, and each holds 1/N of the sequence's activations. N must divide the attention heads (14B: 40,
    1.3B: 12). It works with DDP or --fsdp (sharded over all ranks); the global batch counts data-parallel ranks
    only."""


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
    distribution (every bucket once per N samples; a2/train/flow.py timestep_bucket), the same for every split over
    ranks and accumulation. At a global batch of a few samples this evens out the sigmas each step sees. 0 (default):
    independent draws, the distribution itself."""


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
    shear, scale/translate, perspective, colour/brightness jitter, blur; white fill, a2/kinds/align.py), drawn from the
    sample's seed. It needs the pixels: not with --cache-dir, whose latents are of the images as read."""
    align_loss: bool = False
    """Add RefAlign's reference-alignment loss (a2/kinds/align.py): the reference tokens after --align-blocks, through
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
    weight_decay: float | None = None
    """The AdamW decoupled weight decay (per step, multiplied by the learning rate), on every trainable weight.
    Left out: the model's recipe (RECIPES): 0; Kaleido's 1e-4."""
    adam_betas: tuple[float, float] | None = None
    """The AdamW betas (the moments' decays), e.g. --adam-betas 0.9 0.95. Left out: the model's recipe (RECIPES):
    torch's (0.9, 0.999); Kaleido's (0.9, 0.95)."""
    adam_eps: float = 1e-8
    """The AdamW epsilon. Components whose gradient is below it are pure rounding noise (q/k null directions), which
    Adam would scale up to ~lr; equivalence tests raise it to 1e-4 to compare runs to 1e-6."""
    warmup_steps: int | None = None
    """The optimizer steps of linear learning-rate warmup, from lr / warmup_steps to lr.
    Left out: the model's recipe (RECIPES)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """The learning rate after warmup: constant, or cosine decay to 0 at --max-steps."""
    max_grad_norm: float | None = None
    """Clips the global gradient L2 norm to this (the norm is logged as grad_norm, before clipping). Left out: the
    model's recipe (RECIPES): 1; Kaleido's 0.1."""
    max_nonfinite_steps: int = 3
    """Stops a diverged run: a step whose loss or gradient norm is not finite has its optimizer step skipped (on the
    device, no extra sync), and after this many in a row the run stops (exit 1) naming its last checkpoint with finite
    weights. It is checked at every log step and checkpoint; no checkpoint is written while the last step was
    non-finite."""
    ema_decay: float = 0.0
    """Keeps an EMA of the trained weights with this decay (e.g. 0.999), warmed up as min(decay, (1+t)/(10+t)) after
    step t (a2/train/step.py). It is kept on the device (--fsdp: sharded like the weights), checkpointed and resumed,
    used for the validation videos and the eval loss (eval_ema/...), and exported beside the weights
    (..._ema.safetensors or transformer_ema/). 0 (default): off; it costs one more copy of the trained weights."""
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


# a2's AdamW, the recipe of every model whose own names no other (config.py RECIPES): torch's betas, no weight decay,
# clipping at 1; and what a step built outside a run (bench.py, its dry run) takes
ADAMW = dict(adam_betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)


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
    """Scores each validation video (a2/eval/evaluate.py) into metrics.jsonl (and tensorboard) as val/<metric> at its
    step: motion, temporal consistency and CLIP-I with the model's own image encoder; DINO-I, CLIP-T and face similarity
    with the --eval.* dirs (loaded once, kept on the GPU in the training dtype)."""


# ---------------------------------------------------------------- data.py index, export-elements
# (a2/data/public_index.py)


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
class IndexKaleido:
    """Index Kaleido's training layout (zai-org/Kaleido data_video.py SFTDataset): videos/<id>.mp4, labels/<id>.txt
    (its first line the caption), references/<id>/ref1.png, ref2.png, ref3.png. OUT/index.jsonl is a manifest
    (--manifest OUT/index.jsonl, no --dataset-type) whose references are the model's, in that order."""

    root: tyro.conf.Positional[str]
    """The dataset dir (videos/, labels/, references/)."""
    out: tyro.conf.Positional[str]
    """The dir for index.jsonl, report.txt and the per-part files."""

    def rule(self) -> str:
        return ("videos/<id>.mp4, caption: labels/<id>.txt's first line; references: references/<id>/ref1..3.png "
                "those present, in that order (ref0.. of the manifest); a clip without a label or a reference is "
                "dropped")


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


help_from_docstrings(globals())
