"""Can this run happen, and how: the one planner. From the model's ModelInfo and the config's sections to the Layout
(the conditioning kind and what it derives) and the Run (what a training run derives), with every rule that needs no
data or weights and its one error. Training (train_a2.py, its dry run), `data.py validate`, bench.py, validation and
sampling (infer.py, A2Pipeline.plan) all plan here, so none of them can drift from another.

  plan_layout      the Layout a model takes for these elements and conditioning flags, else a ConfigError
  sampling_plan    the same for one sampling call; validation_layout, validation_inputs: a run's validation video
  kind_datasets    the datasets as the model's kind reads them; model_layout: the model and layout of a run's flags
  plan_training    a training run: its Layout plus the checks of the flags -> Run; with_cache once the data is read
  bench_plan       bench.py's run: a preset's random model in the kind --layout names, and the sections its step reads;
                   bench_datasets: its loader's data
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from a2.cli import ConfigError, check_dir_to_write
from a2.config.dataset_config import (
    CONDITIONING_CHOICES,
    PUBLIC_TYPES,
    ConditioningConfig,
    DataConfig,
    DatasetConfig,
    VaeProcessorConfig,
    check_size,
    dataset_configs,
    element_kind,
    kind_of,
)
from a2.config.sections import (
    ADAMW,
    LoraSection,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    ReferencesConfig,
    resolve_compile,
)
from a2.elements import RELEASED_ELEMENTS, Element, pair_elements
from a2.images import MAGREF_GRIDS, load_first_frame, load_references
from a2.kinds import align
from a2.kinds.conditioning import VAE_T, Layout, clip_frames, element_layout, element_refusal, make_layout
from a2.kinds.kinds import KIND_DEFS, kind_elements, kind_sampling, largest_element_set
from a2.memory.memory import check_flags
from a2.model.tiny import TINY_MODELS, model_path
from a2.model.transformer import (
    TI2V_Z_DIM,
    ModelInfo,
    UnsupportedModel,
    detect_model,
    expert_sigma_range,
    is_hub_id,
    preset_config,
)


@dataclass(frozen=True)
class Run:
    """What a run derives from its config and model dir, computed once by plan_training, printed at start and saved
    as run.json beside config.json. Never written back into the config."""

    world: int
    global_batch: int  # micro_batch x grad_accum x world
    layout: Layout  # the conditioning kind and what it derives (plan_layout)
    elements: tuple[Element, ...]
    info: ModelInfo  # what detect_model read from the model dir
    subfolder: str  # the transformer trained: transformer, or a Wan 2.2 expert's transformer_2
    compute_dtype: torch.dtype  # frozen weights and encoders: bf16 on CUDA with --mixed-precision bf16, else fp32
    sigma_range: tuple[float, float]  # [lo, hi): all of [0, 1], or a Wan 2.2 expert's part
    cache: Path | None  # the precompute cache subdir of this data, encoders and preprocessing
    compile: bool  # the blocks are compiled: --compile, else on CUDA (resolve_compile)
    validates: bool = False  # it renders validation videos: from --val-elements, or from the prompt alone when it
    # trains T2V (with --val-every)
    encode_mode: str = "sample"  # the VAE encode of x0 and the condition: --vae-sample-mode, else the kind's own
    datasets: tuple[DatasetConfig, ...] = ()  # the run's datasets as its kind reads them (kind_datasets)


# ---------------------------------------------------------------- the layout: model x conditioning flags


def plan_layout(info, elements, vae, num_frames: int, e2v_type: str = "auto") -> Layout:
    """The run's Layout, or a ConfigError (one line naming the model dir, the kind and the fix) when the model cannot
    take it. info: a2.model.transformer.ModelInfo; elements: the datasets' Elements; vae: their VaeProcessorConfig."""
    kind = kind_of(vae, elements, info.ti2v)
    where = f"{info.path} ({info.name})"
    if vae.vace_scale != 1.0 and not (info.native_kind and KIND_DEFS[info.native_kind].context):
        raise ConfigError(f"--vace-scale {vae.vace_scale:g} scales the hints of VACE's context blocks; {where} is no "
                          "VACE model: drop it")
    if info.native_kind and KIND_DEFS[info.native_kind].native:  # a released S2V model: its layout and no other
        check_native_flags(info, vae, elements, e2v_type)
        try:
            return make_layout(info.native_kind, num_frames, [e.repeat for e in elements], e2v_type="vae",
                               context_scale=vae.vace_scale)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    if info.native_kind and kind == "prefix":  # MAGREF's weights take its canvas where the flags ask for A2's default
        kind = info.native_kind
    d = KIND_DEFS[kind]
    if not vae.concatenate_mask and d.channel:
        raise ConfigError(f"processors.vae.concatenate_mask false: {where} takes {info.in_channels} input channels"
                          + (" (noisy 16 | mask 4 | condition 16)" if info.e2v else ", expanded to 36 with the mask")
                          + f"; the {kind} kind always concatenates the mask: set it true")
    if info.ti2v and d.channel:
        raise ConfigError(f"{where} takes the latents alone: element references go in context "
                          f"(--reference-layout incontext), not in the {kind} kind's channels")
    clean, prefix_frames = 0, vae.prefix_frames
    if info.ti2v and vae.frame_conditioning != "full":
        if vae.frame_conditioning not in ("first", "prefix"):
            raise ConfigError(f"{where}: --frame-conditioning {vae.frame_conditioning} is not a run of leading "
                              "latent frames; use first or prefix")
        n = prefix_frames if vae.frame_conditioning == "prefix" else 1
        if (n - 1) % VAE_T or not 1 <= n < num_frames:
            raise ConfigError(f"{where}: --prefix-frames {n} must be 4k+1 (whole latent frames) and fewer than the "
                              f"clip's {num_frames} frames")
        clean = n
    elif vae.frame_conditioning == "prefix" and not 1 <= prefix_frames < num_frames:
        raise ConfigError(f"--prefix-frames {prefix_frames}: needs 1 <= prefix frames < the clip's {num_frames}")
    if vae.frame_conditioning not in d.frame_conditioning:  # else another kind would train silently
        raise ConfigError(f"{where}: the {kind} kind takes no --frame-conditioning {vae.frame_conditioning}: drop it")
    if kind == "magref":  # MAGREF's canvas is a Wan I2V first frame
        if not info.e2v:
            raise ConfigError(f"{where} takes {info.in_channels} input channels: reference_layout magref is MAGREF's "
                              "Wan I2V layout (noisy 16 | mask 4 | canvas 16); use a Wan 2.1 I2V or MAGREF model")
        check_canvas([e.name for e in elements])
    if d.packed and (info.e2v or info.ti2v or info.native_kind):  # Stand-In's packed reference
        raise ConfigError(f"{where}: reference_layout {vae.reference_layout} is Stand-In's, a LoRA on Wan T2V "
                          "(Wan2.1-T2V-14B, a Wan2.2-T2V-A14B expert); use a Wan T2V model")
    if d.reference_tokens:  # the references are tokens of the sequence: the model's own input layer
        if info.e2v:
            raise ConfigError(f"{where} takes {info.in_channels} input channels (noisy | mask | condition): "
                              f"reference_layout {vae.reference_layout} is for T2V models; use reference_layout "
                              "channel")
        e2v_type = vae_path_only(where, e2v_type, f"reference_layout {vae.reference_layout}", ConfigError)
    else:
        e2v_type = resolve_e2v_type(info, e2v_type, d.conditioned)  # UnsupportedModel: the model cannot take it
    expand = d.channel and not info.e2v
    image_branch = info.image_branch or (expand and e2v_type != "vae")
    try:
        return make_layout(kind, num_frames, [e.repeat for e in elements] if d.references[1] else (),
                           combine=vae.combine, frame_conditioning=vae.frame_conditioning,
                           frame_index=vae.frame_index, prefix_frames=prefix_frames, clean_frames=clean,
                           reference_timestep=vae.reference_timestep, e2v_type=e2v_type, image_branch=image_branch,
                           use_clip=d.clip and e2v_type != "vae" and image_branch, expand=expand, per_token=info.ti2v)
    except ValueError as e:
        raise ConfigError(f"--num-frames {num_frames}: {e}") from None


def check_native_flags(info, vae, elements, e2v_type: str) -> None:
    """A ConfigError naming the model dir and the fix when the flags ask a released model (info.native_kind, a
    Kind.native) for another layout than its own, or give it no references."""
    native, where = info.native_kind, f"{info.path} ({info.name})"
    if not elements:
        raise ConfigError(f"{where} takes element references in its {native} layout: give element images "
                          "(a dataset with elements); text-to-video training needs a Wan T2V model")
    asked = (f"--reference-layout {vae.reference_layout}" if vae.reference_layout != "channel"
             else f"--frame-conditioning {vae.frame_conditioning}" if vae.frame_conditioning != "full" else None)
    if asked:
        raise ConfigError(f"{where} takes its own {native} layout, not {asked}: drop {asked}")
    if vae.reference_timestep != "shared":
        raise ConfigError(f"{where}: the {native} layout gives the references the sample's timestep: drop "
                          f"--reference-timestep {vae.reference_timestep}")
    vae_path_only(where, e2v_type, f"its {native} layout", ConfigError)


def check_canvas(names: list[str]) -> None:
    """MAGREF's canvas holds at most 8 elements, else a ConfigError naming them. Whether each fits its block (a token,
    16 px, on each side once placed) depends on its image's aspect, so magref_canvas checks that as it loads them."""
    n, most = len(names), max(MAGREF_GRIDS)
    if n > most:
        raise ConfigError(f"elements {', '.join(names)}: MAGREF's canvas places at most {most} references (a 2x4 "
                          f"grid), got {n}: keep at most {most}")


def resolve_e2v_type(info: ModelInfo, e2v_type: str, conditioned: bool) -> str:
    """The reference paths of a run (TrainModelConfig.e2v_type, `auto` resolved), or a clear error when the model cannot
    take them. conditioned: the run has elements or frame conditioning (not plain T2V)."""
    where = f"{info.path} ({info.name})"
    if not conditioned:
        if info.e2v:
            raise UnsupportedModel(f"{where} takes 36 input channels (noisy | mask | condition); T2V-only training "
                                   "(no elements, no frame conditioning) needs a T2V model (e.g. tiny-t2v, "
                                   "Wan2.1-T2V); or give the data its element images (--elements, or \"elements\" "
                                   "in each dataset of a --dataset-config)")
        return "none"
    if info.ti2v:  # its first frame replaces latent frame 0; element references go in context
        return vae_path_only(where, e2v_type, "E2V there (no channel conditioning)")
    if info.e2v and not info.image_branch:  # Wan 2.2 I2V A14B
        return vae_path_only(where, e2v_type, "E2V there")
    if not info.e2v:  # a T2V base is expanded to the E2V inputs
        if info.two_experts:
            raise UnsupportedModel(f"{where}: E2V would expand the trained expert to 36 input channels while the other "
                                   "keeps 16, and the pair could not be sampled; train T2V here (a dataset config "
                                   "without elements), or E2V on Wan 2.2 I2V A14B")
        if e2v_type != "vae" and info.image_encoder_dir is None:
            raise UnsupportedModel(f"{where} is a T2V model: E2V training expands it and needs a CLIP image encoder "
                                   "(--image-encoder DIR) or --e2v-type vae")
    return "dual" if e2v_type == "auto" else e2v_type


def vae_path_only(where: str, e2v_type: str, what: str, error: type = UnsupportedModel) -> str:
    """"vae", the E2V type where nothing takes CLIP tokens (`what`: the model's E2V, a kind's layout), or the one-line
    `error` when --e2v-type asks for them."""
    if e2v_type in ("dual", "clip"):
        raise error(f"{where} has no CLIP image branch: {what} uses the VAE path only (--e2v-type vae or auto), "
                    f"not {e2v_type}")
    return "vae"


# ---------------------------------------------------------------- sampling and validation


def sampling_plan(info, elements, conditioning, num_frames: int, *, first_frame: bool = False,
                  image_branch: bool | None = None, reference_lora: bool = False, seed: int | None = None,
                  preset: str | None = None) -> Layout:
    """The Layout one sampling call takes (infer.py, and A2Pipeline.plan for library callers): `plan_layout`, the one
    train_a2.py makes, for these elements (Elements, or their frame counts in position order) and a
    ConditioningConfig, plus what only sampling has. first_frame: Wan 2.2 TI2V-5B's --image (frame conditioning
    first). image_branch: the pipeline has a CLIP image encoder (None: the model dir's, info.image_encoder_dir).
    reference_lora: a Stand-In reference LoRA is loaded, so the references take its layout unless another is asked.
    seed: MAGREF's canvas placement follows it (None: the kind's own sampler's seed, as infer.py samples with no
    --seed). Raises ConfigError naming the model and what does not fit."""
    if elements and isinstance(elements[0], int):  # frame counts alone: unnamed references, one per count
        elements = tuple(replace(RELEASED_ELEMENTS[i % len(RELEASED_ELEMENTS)], name=f"ref{i}", repeat=r, position=i)
                         for i, r in enumerate(elements))
    changes = {}
    if reference_lora and conditioning.reference_layout == "channel":
        changes["reference_layout"] = "standin"
    if first_frame:
        changes["frame_conditioning"] = "first"
    vae = replace(VaeProcessorConfig(**{f.name: getattr(conditioning, f.name) for f in fields(ConditioningConfig)}),
                  **changes)
    image_branch = info.image_encoder_dir is not None if image_branch is None else image_branch
    layout = plan_layout(info, tuple(elements), vae, num_frames, e2v_type="auto" if image_branch else "vae")
    why = element_refusal(layout, len(elements))  # any count the kind takes, and no other
    if why:
        raise ConfigError(f"{info.path} ({info.name}): {why}")
    own = kind_sampling(layout.kind, info.name, preset)
    if own.seeded_placement:  # with no seed given, the one the kind's own sampler runs with (infer.py's default)
        layout = replace(layout, placement_seed=own.seed if seed is None else seed)
    return replace(layout, reference_multiple=own.reference_multiple, reversed_references=own.reversed_references)


def validation_layout(layout: Layout, repeats=()) -> Layout:
    """The layout a run's validation video is sampled with for element images of `repeats` frames: the run's own for
    that element set (element_layout), except that an inplace run samples from its images as leading references (Wan
    I2V's first frame: one reference of one frame builds the same mask | condition) and a clean run from one first
    frame. It is sampled as infer.py samples it with no --seed: MAGREF's canvas placed by the kind's own seed, from
    which the noise is drawn."""
    layout = element_layout(layout, repeats, sampled=True)
    if layout.kind == "inplace":
        return make_layout("prefix", layout.num_frames, repeats, combine=layout.combine, e2v_type=layout.e2v_type,
                           image_branch=layout.image_branch, expand=layout.expand, per_token=layout.per_token)
    if layout.kind == "clean":
        return replace(layout, clean_frames=1)
    own = KIND_DEFS[layout.kind].sampling
    return replace(layout, placement_seed=own.seed) if own.seeded_placement else layout


def validation_inputs(val_elements: tuple[str, ...], size: tuple[int, int], clip_size: int, layout: Layout, elements,
                      model_name: str) -> tuple:
    """What validation samples from --val-elements: (the (Element, path) pairs, the layout of their element set (any
    the kind takes), VAE-path references, CLIP-path images, MAGREF's region, TI2V-5B's first frame), read by plan_run
    before any weights load too, so that a bad image fails then and not after training."""
    h, w = size
    items, refs, clips, region, first_frame = [], None, None, None, None
    if layout.images == "first_frame":  # TI2V-5B image-to-video: the one image is the first frame
        if len(val_elements) != 1:
            raise ValueError(f"{model_name} image-to-video takes one image (the first frame), not "
                             f"{len(val_elements)}")
        first_frame = load_first_frame(val_elements[0], (h, w))
    elif val_elements:
        items = pair_elements(val_elements, elements)
    layout = validation_layout(layout, tuple(e.repeat for e, _ in items))
    if items:
        refs, clips, _, region = load_references(items, (h, w), (clip_size, clip_size), layout)
    return items, layout, refs, clips, region, first_frame


# ---------------------------------------------------------------- a training run


def kind_datasets(cfgs: list[DatasetConfig], info, given: bool) -> tuple[list[DatasetConfig], tuple[Element, ...]]:
    """The datasets as the model's kind (element_kind; info: its ModelInfo) reads them, and the element
    set a run plans for. With no elements given (--elements or a dataset config), each dataset of element images
    takes the specs its kind takes when sampling too (a2.kinds.kinds.kind_elements: SkyReels-A2's roles, a released
    model's references framed as its lab's; on a public-dataset index a kind without roles takes every kept mask of a
    clip, largest first, up to its maximum, and the background png where it uses one: index_elements), and the run
    plans the largest set one sample holds (largest_element_set). Given elements: `cfgs` and theirs unchanged."""
    if given:
        return cfgs, cfgs[0].elements
    kind = element_kind(info, cfgs[0].vae)
    cfgs = [replace(c, elements=kind_elements(kind, c.dataset_type in PUBLIC_TYPES)) if c.elements else c
            for c in cfgs]
    return cfgs, largest_element_set(kind, cfgs[0].elements)


def model_layout(model, data, cfgs: list[DatasetConfig]):
    """The model of a run's model section (`model`: TrainModelConfig) and the layout it trains the data section's
    datasets in (plan_training and training_layout alike): (info, cfgs as its kind reads them (kind_datasets), the
    element set planned, the Layout), the size checked against the model's patch multiple (TI2V-5B: 32)."""
    info = detect_model(model_path(model.model), model.image_encoder and model_path(model.image_encoder),
                        model.components)
    check_size(*data.resolution, data.num_frames, info.spatial_multiple)
    cfgs, elements = kind_datasets(cfgs, info, bool(data.elements or data.dataset_config))
    return info, cfgs, elements, plan_layout(info, elements, cfgs[0].vae, data.num_frames, model.e2v_type)


def training_layout(model, data, cfgs):
    """The datasets, the Layout and the aspect buckets' size multiple train_a2.py plans with these flags (clip length,
    the element specs the model's kind takes, how element images become references; TI2V-5B's buckets are multiples
    of 32). They depend on the model (Phantom-Wan, SkyReels-V3, RefAlign and MAGREF weights take their own layouts and
    references), so when --model is on this machine (a built-in model, a dir or a file) they are planned as training
    plans them; a Hub id is not downloaded for this: the datasets as the flags give them, no layout (None), the clip
    length by the elements' rule (said), and multiples of 16 (the Wan 2.1 VAE's stride 8 x patch 2)."""
    m = model
    if m.model in TINY_MODELS or not is_hub_id(m.model):  # a Hub id is not downloaded for this: said
        info, cfgs, _, layout = model_layout(m, data, cfgs)
        return cfgs, layout, info.spatial_multiple
    print(f"clip length by the elements' rule (--model {m.model} is not on this machine; a released model's own "
          "layout can read longer clips)")
    return cfgs, None, 16


def plan_training(model, data, rundir, optim, memory, lora, parallel, references, objective, validation, world: int,
                  datasets, device) -> Run:
    """A training run of these config sections (train_a2.py plan_run gives them) on `world` data-parallel ranks:
    all derived settings and every check that needs no data or weights, so that a bad config fails here, before any
    loading. The precompute cache, which hashes the data, is added by with_cache once the dataset is scanned."""
    if optim.micro_batch < 1 or optim.grad_accum < 1:
        raise ConfigError("micro_batch and grad_accum must be >= 1")
    check_dir_to_write("--output-dir", rundir.output_dir)
    vae_cfg = datasets[0].vae  # every dataset's (a2/config/dataset_config.py load_dataset_config): its conditioning
    # the kind, checked; none given: the element specs its kind samples with too
    info, datasets, elements, layout = model_layout(model, data, datasets)
    # (VACE: what reaches its context blocks)
    check_flags(memory, lora.training_type, parallel.fsdp, device, layout.context_blocks)
    if data.cache_dir and not layout.cacheable:
        raise ConfigError(f"--cache-dir: the {layout.kind} kind (frame conditioning {layout.frame_conditioning}) "
                          "builds its condition from pixels each step (random frames): train it without a cache")
    if data.precompute and not data.cache_dir:
        raise ConfigError("--precompute needs --cache-dir")
    check_reference_options(references, lora, parallel, data, layout)
    check_extra_options(optim, validation, objective)
    if validation.val_elements:  # read now, not after training and export
        if layout.images == "none":
            raise ConfigError("--val-elements: this run trains without elements (text only); drop them")
        if layout.images == "elements" and not elements:  # Wan I2V's frames of the clip: no sampler takes them yet
            raise ConfigError(f"--val-elements: the {layout.kind} kind conditions on frames of the clip "
                              f"(--frame-conditioning {layout.frame_conditioning}), which neither validation nor "
                              "infer.py samples yet; drop them (--eval-split N measures a held-out loss)")
        try:
            validation_inputs(validation.val_elements, data.resolution, model.clip_size, layout, elements, info.name)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"--val-elements: {e}") from e
    if (validation.val_elements or validation.val_every) and not validation.val_prompt.strip():
        raise ConfigError("--val-prompt is empty: validation videos need a prompt")
    dtype = torch.bfloat16 if device.type == "cuda" and parallel.mixed_precision == "bf16" else torch.float32
    return Run(world, optim.micro_batch * optim.grad_accum * world, layout, elements, info,
               info.subfolder(model.expert), dtype, expert_sigma_range(model.expert, info.boundary_ratio), None,
               resolve_compile(memory.compile, device.type),
               bool(validation.val_elements) or layout.images == "none" and validation.val_every > 0,
               vae_cfg.vae_sample_mode or kind_sampling(layout.kind, info.name).encode_mode, tuple(datasets))


def check_reference_options(references, lora, parallel, data, layout: Layout) -> None:
    """--align-loss, --reference-augment and the dropouts against the run's kind, before any loading."""
    r = references
    if not all(0.0 <= p <= 1.0 for p in (r.text_dropout, r.reference_dropout, r.joint_dropout)) or \
            r.joint_dropout and r.text_dropout + r.reference_dropout + r.joint_dropout > 1.0:
        raise ConfigError(f"--text-dropout {r.text_dropout}, --reference-dropout {r.reference_dropout}, "
                          f"--joint-dropout {r.joint_dropout}: probabilities in [0, 1], summing to at most 1 with "
                          "--joint-dropout (exclusive cases of one draw)")
    if lora.vace_lora_target and not layout.context_blocks:
        raise ConfigError(f"--vace-lora-target {lora.vace_lora_target}: the {layout.kind} kind's model has no VACE "
                          "context blocks; drop it")
    if r.reference_dropout and layout.context_blocks:
        raise ConfigError("--reference-dropout: VACE samples with its references in both guidance branches (it drops "
                          "the text alone), so no sample trains without them; drop it")
    if r.reference_augment and not layout.takes_references:
        raise ConfigError(f"--reference-augment: the {layout.kind} kind takes no reference images")
    if r.reference_augment and data.cache_dir:
        raise ConfigError("--reference-augment augments the reference pixels each step; the precompute cache holds "
                          "latents of the images as read: drop --cache-dir (or the augmentation)")
    if not r.align_loss:
        return
    if not layout.reference_tokens:
        raise ConfigError(f"--align-loss aligns reference tokens of the sequence (kinds "
                          f"{', '.join(align.aligned_kinds())}); the {layout.kind} kind has none (its references, if "
                          "any, are channels of video tokens)")
    if not r.align_model:
        raise ConfigError("--align-loss needs --align-model, a local DINOv3 dir (transformers' DINOv3ViTModel)")
    if parallel.fsdp:
        raise ConfigError("--align-loss is not tried with --fsdp (its projectors are not sharded): use DDP")
    try:
        align.target_dim(r.align_model)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_extra_options(optim, validation, objective) -> None:
    """--ema-decay, the eval loss and --timestep-buckets, checked before any data or weights load."""
    if not 0.0 <= optim.ema_decay < 1.0:
        raise ConfigError(f"--ema-decay {optim.ema_decay}: a decay in [0, 1) (0: no EMA), e.g. 0.999")
    v, buckets = validation, objective.timestep_buckets
    if v.eval_split < 0 or v.eval_every < 0 or v.eval_quantiles < 1 or buckets < 0:
        raise ConfigError(f"--eval-split {v.eval_split}, --eval-every {v.eval_every}, --timestep-buckets "
                          f"{buckets} must be >= 0 and --eval-quantiles {v.eval_quantiles} >= 1")


def with_cache(data, references, run: Run, dataset) -> Run:
    """The run with its precompute cache subdir (data.cache_dir): a hash of everything the encodings depend on
    (cache_key)."""
    if not data.cache_dir:
        return run
    encoders = run.info.image_encoder_dir if run.layout.use_clip else None
    r = references
    cache = Path(data.cache_dir) / cache_key(run.info.parts_dir, encoders, dataset, run.layout.clip_frames,
                                             str(run.compute_dtype), run.layout.e2v_type, run.layout.prefix_frames,
                                             run.layout.kind, Path(r.align_model) if r.align_loss else None)
    if not data.precompute and not (cache / "done").exists():
        raise FileNotFoundError(f"{cache}: no precompute cache for this config; run the same command with "
                                "--precompute first")
    return replace(run, cache=cache)


def cache_key(model_dir: Path, image_src: Path | None, dataset, clip_frames: int, dtype: str,
              e2v_type: str, prefix_frames: int, kind: str | None = None, align_model: Path | None = None) -> str:
    """Name of the precompute cache: a hash of everything the encodings depend on (encoder files, every data
    file, captions, the dataset/processor configs, clip length, layout kind, dtype). Any change -> a new dir (the
    kind too: Phantom-Wan shares Wan2.1-T2V-1.3B's encoders, and encodes a reference as one frame where the incontext
    kind on that T2V model encodes `repeat` frames into the same one latent). dataset: data.py's E2VDataset."""
    def stat(p: Path):
        st = p.stat()
        return [str(p.resolve()), st.st_size, st.st_mtime_ns]

    dirs = [model_dir / d for d in ("vae", "text_encoder", "tokenizer")]
    dirs += [image_src / d for d in ("image_encoder", "image_processor")] if image_src else []
    dirs += [align_model] if align_model else []  # --align-loss: the DINOv3 targets are cached too
    key = dict(**dict(KIND_DEFS[kind].cache_fields if kind else (("version", 2),)),  # the kind's own fields
               encoders=[stat(f) for d in dirs for f in sorted(d.rglob("*")) if f.is_file()],
               datasets=[{k: v for k, v in asdict(c).items() if k != "source"} for c in dataset.cfgs],
               clip_frames=clip_frames, dtype=dtype,
               frame_sampling=dataset.frame_sampling, e2v_type=e2v_type, prefix_frames=prefix_frames, kind=kind,
               samples=[[stat(s.video), s.prompt, {k: stat(Path(v)) for k, v in s.elements.items()}]
                        + ([stat(s.mask)] if s.mask else [])
                        + ([s.start, s.crop, s.refs] if s.refs else []) + ([list(s.windows[0])] if s.windows else [])
                        for s in dataset.samples])
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- bench.py


def preset_info(preset: str, cfg: dict, native_kind: str | None = None) -> ModelInfo:
    """The ModelInfo of a random model of `preset` (its transformer config `cfg`, a2.model.transformer.preset_config),
    as detect_model would read its dir: no image encoder, one expert; Wan 2.2's 48-channel VAE (5B) compresses 16x."""
    ti2v = cfg["out_channels"] == TI2V_Z_DIM
    return ModelInfo(Path(f"random-{preset}"), f"random {preset}", cfg["in_channels"], cfg["image_dim"] is not None,
                     None, cfg["image_dim"], None, z_dim=cfg["out_channels"], vae_scale=16 if ti2v else 8,
                     patch_size=tuple(cfg["patch_size"]), expand_timesteps=ti2v, native_kind=native_kind)


def bench_plan(b) -> tuple[Run, tuple, dict]:
    """The run bench.py's step trains (b: config.BenchConfig): the kind --layout names (default: A2's prefix kind with
    --refs elements, T2V with none; --align-refs N: Phantom's N appended references), planned by plan_layout as a
    training run is, from the flags that ask for the kind (its reference layout, its first --frame-conditioning mode,
    the released model's own layout) on a random model of the preset shaped for it (36 channels where the kind
    conditions on channels; preset_info). Returns (Run, the sections of a training config its step reads, in
    train_a2.step_sections' order: memory, parallel, LoRA, optim, objective, references; the transformer config). The
    learning rate and sigma's distribution are any valid values: a step costs the same whatever they are. A shape or
    count the kind cannot take is a ConfigError (one line, exit 2 under run_cli)."""
    kind = b.layout if b.layout != "default" else "phantom" if b.align_refs else "prefix" if b.refs else "t2v"
    d = KIND_DEFS[kind]
    lo, hi = d.references
    n = min(max(b.align_refs or b.refs, lo), hi)  # --refs within what one sample of the kind holds
    if b.align_refs and (n != b.align_refs or not d.reference_tokens):
        raise ConfigError(f"bench.py --align-refs {b.align_refs}: the {kind} kind holds {lo} to {hi} references"
                          + ("" if d.reference_tokens else ", none of them tokens of the sequence")
                          + f"; aligned kinds: {', '.join(align.aligned_kinds())}")
    try:
        cfg = preset_config(b.preset, e2v=d.channel, vace=d.context)
    except ValueError as e:
        raise ConfigError(f"bench.py --preset {b.preset} --layout {kind}: {e}") from None
    info = preset_info(b.preset, cfg, kind if d.native else None)
    layouts = CONDITIONING_CHOICES["reference_layout"]
    vae = VaeProcessorConfig(resolution=b.size, reference_layout=kind if kind in layouts else "channel",
                             frame_conditioning=d.frame_conditioning[0])
    elements = tuple(Element(f"ref{i}", (f"_ref{i}.png",)) for i in range(n if hi else 0))
    try:
        layout = plan_layout(info, elements, vae, b.frames)
    except ValueError as e:
        raise ConfigError(f"bench.py --layout {kind} --frames {b.frames}: {e}") from None
    run = Run(1, b.batch, layout, elements, info, "transformer", torch.float32, (0.0, 1.0), None, False,
              encode_mode=kind_sampling(kind).encode_mode)
    sections = (b.memory, ParallelConfig(fsdp=b.fsdp, context_parallel=b.context_parallel),
                LoraSection(training_type=b.mode, lora_rank=b.lora_rank, lora_alpha=b.lora_rank),
                OptimConfig(lr=1e-4, micro_batch=b.batch, ema_decay=b.ema_decay, **ADAMW),
                ObjectiveConfig(sigma_sampling="logit_normal"),
                ReferencesConfig(align_loss=b.align_loss and b.align_refs > 0))
    return run, sections, cfg


def bench_datasets(b, manifest: str | None = None, dataset_type: str = "e2v") -> tuple[list[DatasetConfig], int]:
    """bench.py's loader data (--data-root, or a public dataset's index `manifest`) as training reads it from these
    data flags (dataset_configs: A2's elements, --frames x --height x --width), and the clip length it reads: a
    public dataset's is what A2's reference latents leave of --frames (81 -> 69)."""
    data = DataConfig(data_root=b.data_root, manifest=manifest, dataset_type=dataset_type, resolution=b.size,
                      num_frames=b.frames)
    cfgs = dataset_configs(data, ConditioningConfig(), clip_size=512)
    return cfgs, clip_frames(b.frames, cfgs[0].elements, cfgs[0].vae) if manifest else b.frames
