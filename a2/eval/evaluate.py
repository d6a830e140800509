"""E2V quality metrics: do the elements survive into the video, does it follow the prompt, does it move.

    encoders = load_evaluators(EvalConfig(dino="/models/dinov2-base"), default_clip_dir="/models/SkyReels-A2")
    result = evaluate_video(video, {"subject": clip_ref, ...}, "A man ...", encoders, faces=("subject",))
    # {"video": {"clip_t", "motion", "temporal_clip", "temporal_dino", "clip_i", "dino_i", "face_sim"},
    #  "elements": {"subject": {"clip_i_mean", "clip_i_max", "dino_i_mean", "dino_i_max", "face_sim_mean", ...}}}

Per element: CLIP-I / DINO-I = cosine of the image embeddings of the element image (after its own CLIP-path
preprocessing, `a2.images.load_references`) and of each scored frame, mean and max over frames; face_sim the same
over the frames with a face, of a face model, for the elements named as faces (a2/eval/opens2v.py's face-similarity
path, which OpenS2V's cur_score shares). Per video: CLIP-T = mean cosine of the prompt's and the frames' CLIP
embeddings; temporal_* = mean cosine of adjacent frames' embeddings; motion = `motion_magnitude`.
Frames go through each encoder's own image processor (shortest-edge resize + centre crop, as DreamBooth's CLIP-I /
DINO). Encoders come from local dirs only; one whose dir is not given is skipped with one message at load time.
With the OpenS2V-Eval flags (--eval.aes-clip/--eval.aes-mlp, --eval.facesim, --eval.gme, --eval.motion-fb) the
video also gets that benchmark's metrics under their names (aes_score, cur_score, gme_score, motion_fb;
a2/eval/opens2v.py). During training (train_a2.py): the eval loss of held-out samples, the validation videos (scored as
above) and the dataset config's visualization dumps.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from PIL import Image

from a2.config.sections import (
    EvalConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    ReferencesConfig,
    ValidationConfig,
)
from a2.data.loader import collate
from a2.data.media import DatasetError
from a2.eval.opens2v import (
    Embedder,
    FaceSim,
    Scorers,
    face_sim,
    flows,
    load_scorers,
    pooled,
    sample_frames,
    tiny_encoder_note,
    video_metrics,
)
from a2.images import tensor_to_uint8
from a2.kinds.kinds import model_flow_shift
from a2.model.transformer import EXPERTS, load_transformer
from a2.pipeline import A2Pipeline, decode_vae, save_video
from a2.plan import Run, validation_inputs
from a2.train.flow import sigma_cdf, sigma_quantile
from a2.train.step import Encoders, Process, TrainState, ema_weights, forward_loss, model_inputs


@dataclass
class Evaluators:
    """The encoders of the metrics (None: that metric is skipped). clip_t
    embeds the frames with a CLIPModel whose text tower embeds the prompt (`tokenizer`)."""

    clip: Embedder | None = None
    dino: Embedder | None = None
    face: Embedder | FaceSim | None = None
    clip_t: Embedder | None = None
    tokenizer: object = None
    opens2v: Scorers | None = None  # OpenS2V-Eval's metrics under their names
    notes: list[str] = field(default_factory=list)  # the metrics that come from tiny random encoders (said with them)


def load_embedder(path, flag: str, device="cpu", dtype=torch.float32) -> Embedder:
    """A dir holding a transformers image model (config.json naming its class, preprocessor_config.json), or
    image_encoder/ + image_processor/ (a diffusers model dir, e.g. SkyReels-A2), or a face model: model.pt2
    (torch.export) or model.pt (TorchScript), (B, 3, H, W) RGB in [0, 1] -> (B, D), non-finite rows: no face; or
    OpenS2V-Weight's (a2.eval.opens2v.FaceSim)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} ({flag}): no such model dir")
    if (path / "face_extractor").is_dir():  # OpenS2V-Weight: cur_score's face model, as a face model for face_sim
        return FaceSim.load(path, device)
    if (path / "model.pt2").is_file():  # torch.export.save of a program with a dynamic batch and size
        return Embedder(torch.export.load(path / "model.pt2").module().to(device), None, device)
    if (path / "model.pt").is_file():  # TorchScript, as many face models ship
        return Embedder(torch.jit.load(path / "model.pt", map_location=device).eval(), None, device)
    sub = path / "image_encoder"
    model_dir, processor_dir = (sub, path / "image_processor") if sub.is_dir() else (path, path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} ({flag}): no config.json (need a transformers model dir, image_encoder/"
                                " + image_processor/, or a face model.pt2 / model.pt)")
    arch = (json.loads((model_dir / "config.json").read_text()).get("architectures") or ["(none)"])[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ValueError(f"{model_dir} ({flag}): config.json names architecture {arch!r}, not a transformers class")
    model = cls.from_pretrained(model_dir, torch_dtype=dtype).to(device).eval().requires_grad_(False)
    processor = transformers.AutoImageProcessor.from_pretrained(processor_dir)
    return Embedder(model, processor, device, dtype)


def load_evaluators(cfg, default_clip_dir=None, device="cpu", dtype=torch.float32, clip: Embedder | None = None):
    """Encoders of config.EvalConfig `cfg`. CLIP-I uses cfg.clip_image, else `clip` (an encoder already in memory,
    e.g. training's), else `default_clip_dir` (a model dir's image_encoder/ + image_processor/). Prints one line per
    skipped metric."""
    ev = Evaluators()
    if cfg.clip_image or (clip is None and default_clip_dir):
        clip = load_embedder(cfg.clip_image or default_clip_dir, "--eval.clip-image", device, dtype)
    ev.clip = clip
    if cfg.dino:
        ev.dino = load_embedder(cfg.dino, "--eval.dino", device, dtype)
    if cfg.clip_text:
        ev.clip_t = load_embedder(cfg.clip_text, "--eval.clip-text", device, dtype)
        if not hasattr(ev.clip_t.model, "get_text_features"):
            raise ValueError(f"{cfg.clip_text} (--eval.clip-text): needs a CLIPModel (text and vision towers), got "
                             f"{type(ev.clip_t.model).__name__}")
        ev.tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.clip_text)
    if cfg.aes_clip or cfg.aes_mlp or cfg.facesim or cfg.gme or cfg.motion_fb:
        ev.opens2v = load_scorers(cfg, device, dtype)
    if cfg.face:  # the same dir as --eval.facesim: its face model, loaded once
        ev.face = ev.opens2v.face if cfg.face == cfg.facesim else load_embedder(cfg.face, "--eval.face", device, dtype)
    clip_dir = cfg.clip_image or default_clip_dir or "the model's image encoder"
    encoders = ((ev.clip, "CLIP-I and temporal_clip", clip_dir, "no CLIP image encoder (--eval.clip-image)"),
                (ev.dino, "DINO-I and temporal_dino", cfg.dino, "no --eval.dino DINOv2 dir"),
                (ev.clip_t, "CLIP-T", cfg.clip_text, "no --eval.clip-text CLIPModel dir"),
                (ev.face, "face similarity (face_sim)", cfg.face, "no --eval.face model dir"))
    ev.notes = [n for enc, metrics, where, _ in encoders if enc is not None and (n := tiny_encoder_note(
        getattr(enc, "model", None), metrics, where))] + (ev.opens2v.notes if ev.opens2v is not None else [])
    for line in ev.notes + [f"skipping {metrics}: {why}" for enc, metrics, _, why in encoders if enc is None]:
        print(f"evaluate: {line}")
    return ev


def named_references(items, clip_refs: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`a2.images.load_references`' CLIP-path images (1, N, 3, h, w) by element name, for evaluate_video;
    `items` are the (Element, path) pairs they were loaded from (load_references orders them by position)."""
    if clip_refs is None:
        return {}
    return dict(zip([e.name for e, _ in sorted(items, key=lambda it: it[0].position)], clip_refs[0]))


def video_frames(video: torch.Tensor) -> np.ndarray:
    """(3, F, H, W) or (1, 3, F, H, W) float in [-1, 1] (A2Pipeline's video), or (F, H, W, 3) uint8 (an mp4 read
    by imageio) -> (F, H, W, 3) uint8."""
    if video.dtype == torch.uint8:
        if video.ndim != 4 or video.shape[-1] != 3:
            raise ValueError(f"uint8 frames must be (F, H, W, 3), got {tuple(video.shape)}")
        return video.cpu().numpy()
    video = video[0] if video.ndim == 5 else video
    if video.ndim != 4 or video.shape[0] != 3:
        raise ValueError(f"float video must be (3, F, H, W) in [-1, 1], got {tuple(video.shape)}")
    return tensor_to_uint8(video.transpose(0, 1))


def motion_magnitude(flow: list[np.ndarray]) -> float:
    """Mean optical-flow magnitude in pixels per frame over adjacent frame pairs and pixels, of OpenS2V's Farneback
    flow (a2.eval.opens2v.flows: the one motion measure; motion_fb is its signed mean, which opposite motions cancel).
    A 1-frame video has no pairs: 0."""
    return float(np.mean([np.hypot(f[..., 0], f[..., 1]).mean() for f in flow])) if flow else 0.0


def _adjacent(frames: torch.Tensor) -> float:
    """Mean cosine of adjacent frames' embeddings; a 1-frame video (no change) counts as fully consistent: 1."""
    return (frames[:-1] * frames[1:]).sum(-1).mean().item() if len(frames) > 1 else 1.0


def evaluate_video(video: torch.Tensor, elements: dict[str, torch.Tensor], prompt: str, ev: Evaluators,
                   faces=(), max_frames: int = 0) -> dict:
    """Score one generated video (see the module docstring); `elements`: name -> the element's CLIP-path image
    (3, h, w) in [-1, 1] as `a2.images.load_references` makes it (`named_references`);
    faces: names of the elements scored with the face model; max_frames > 0 scores that many evenly spaced frames.
    Returns {"video": {metric: float}, "elements": {name: {metric: float}}}; skipped metrics are absent."""
    frames = every_frame = video_frames(video)
    if max_frames and len(frames) > max_frames:
        frames = sample_frames(frames, max_frames)  # as OpenS2V's metrics sample theirs
    refs = tensor_to_uint8(torch.stack(list(elements.values()))) if elements else None
    flow = flows(every_frame)  # every frame, as motion_fb
    per_video = {"motion": motion_magnitude(flow)}
    if ev.opens2v is not None:  # their metrics sample the whole video themselves
        face_refs = [refs[i] for i, n in enumerate(elements) if n in faces] if elements else []
        per_video.update(video_metrics(every_frame, prompt, ev.opens2v, face_refs, flow))
    per_element = {name: {} for name in elements}
    for key, enc, names in (("clip_i", ev.clip, list(elements)), ("dino_i", ev.dino, list(elements)),
                            ("face_sim", ev.face, [n for n in elements if n in faces])):
        if enc is None:
            continue
        emb = enc(frames)
        if key != "face_sim":
            per_video["temporal_" + key.removesuffix("_i")] = _adjacent(emb)
        if not names:
            continue
        for name, ref in zip(names, enc(refs[[list(elements).index(n) for n in names]])):
            cos = emb @ ref
            per_element[name].update(face_sim(cos) if key == "face_sim" else
                                     {f"{key}_mean": cos.mean().item(), f"{key}_max": cos.max().item()})
        scored = [per_element[n][f"{key}_mean"] for n in names if f"{key}_mean" in per_element[n]]
        if scored:
            per_video[key] = float(np.mean(scored))
    if ev.clip_t is not None:
        model = ev.clip_t.model
        tokens = ev.tokenizer([prompt], padding=True, truncation=True, return_tensors="pt",
                              max_length=model.config.text_config.max_position_embeddings)
        with torch.no_grad():
            text = pooled(model.get_text_features(**tokens.to(ev.clip_t.device)))
        per_video["clip_t"] = (ev.clip_t(frames) @ F.normalize(text.float(), dim=-1).cpu()[0]).mean().item()
    return {"video": per_video, "elements": per_element}


def flat_metrics(result: dict, prefix: str = "") -> dict[str, float]:
    """evaluate_video's result as flat keys (`clip_t`, `subject/clip_i_mean`), for metrics.jsonl and tensorboard."""
    flat = {f"{prefix}{k}": v for k, v in result["video"].items()}
    for name, metrics in result["elements"].items():
        flat.update({f"{prefix}{name}/{k}": v for k, v in metrics.items()})
    return flat


def metric_rows(result: dict, **ident) -> list[dict]:
    """evaluate_video's result as table rows: the video's (element "") then one per element, each led by `ident`."""
    rows = [dict(ident, element="", **result["video"])]
    rows += [dict(ident, element=name, **metrics) for name, metrics in result["elements"].items()]
    return rows


def mean_rows(rows: list[dict], by=("model", "element"), label: dict | None = None) -> list[dict]:
    """Per group of `by` values (in first-seen order), the mean of each numeric metric over the rows that have it;
    `label` is merged into each mean row (e.g. {"index": "mean"})."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in by), []).append(row)
    out = []
    for key, members in groups.items():
        metrics = [k for r in members for k, v in r.items() if k not in by and isinstance(v, float)]
        means = {k: float(np.mean([r[k] for r in members if k in r])) for k in dict.fromkeys(metrics)}
        out.append(dict(label or {}, **dict(zip(by, key)), **means))
    return out


def format_table(means: list[dict], models=("base", "lora"), notes=()) -> str:
    """Mean rows (mean_rows by model and element) as a text table: metric, one column per model, and the delta
    of the last model over the first when there are two; then the `notes` (Evaluators.notes: the metrics of tiny
    random encoders)."""
    models = [m for m in models if any(r["model"] == m for r in means)]
    values: dict[str, dict[str, float]] = {}
    for r in means:
        for k, v in r.items():
            if isinstance(v, float):
                values.setdefault(f"{r['element']}/{k}" if r["element"] else k, {})[r["model"]] = v
    width = max([len(k) for k in values] + [6])
    cols = models + (["delta"] if len(models) == 2 else [])
    lines = [f"{'metric':<{width}}" + "".join(f"{c:>10}" for c in cols)]
    for name, by_model in values.items():
        v = [by_model.get(m, math.nan) for m in models]
        delta = f"{v[1] - v[0]:>+10.4f}" if len(models) == 2 else ""
        lines.append(f"{name:<{width}}" + "".join(f"{x:>10.4f}" for x in v) + delta)
    return "\n".join(lines + list(notes))


# ---------------------------------------------------------------- during training (train_a2.py): eval loss, videos


EVAL_KEY = 2**62  # the step key of the eval loss's draws (noise, posterior samples): no training step has it


def eval_sigmas(objective: ObjectiveConfig, n: int, run: Run) -> list[float]:
    """The eval loss's sigmas: the quantiles (i + 1) / (n + 1), i < n = --eval-quantiles, of the --sigma-sampling
    distribution, truncated to the run's sigma range (a Wan 2.2 expert's) as training draws it."""
    a, b = sigma_cdf(objective, run.sigma_range[0]), sigma_cdf(objective, run.sigma_range[1])
    return [sigma_quantile(objective, a + (b - a) * (i + 1) / (n + 1)) for i in range(n)]


@torch.no_grad()
def eval_loss(step: int, objective: ObjectiveConfig, optim: OptimConfig, validation: ValidationConfig,
              parallel: ParallelConfig, run: Run, transformer, enc: Encoders, dataset, held: list[int], proc: Process,
              prefix: str = "eval/") -> dict:
    """The loss of the held-out samples at eval_sigmas, as a metrics.jsonl record: <prefix>loss (the mean) and
    <prefix>loss@<sigma>. Each sample is the training step's model_inputs (its n-th sample of a one-sample batch at the
    fixed step key EVAL_KEY, dropout off: the same noise and posterior draws at every eval) and forward_loss with the
    sigmas replaced; the noise is shared by all sigmas. Samples n = rank, rank + world, ... per data-parallel rank
    (--fsdp: every rank runs as many forwards, the extra ones discarded); each (sample, sigma) loss is computed by one
    rank and summed with zeros from the others, so the result is the same bit for bit at any world size."""
    rank, world, device = proc.dp_rank, proc.dp_world, proc.device
    sigmas = eval_sigmas(objective, validation.eval_quantiles, run)
    # the flow loss alone: no dropout, augmentation, alignment loss or timestep buckets
    objective, refs = replace(objective, timestep_buckets=0), ReferencesConfig(text_dropout=0.0)
    optim = replace(optim, micro_batch=1, overfit_batches=0)
    one = replace(run, world=1)
    per = torch.zeros(len(held), len(sigmas), device=device)  # (N, Q)
    transformer.eval()  # (LoRA dropout)
    for n in range(rank, -(-len(held) // world) * world, world):
        if n >= len(held) and not parallel.fsdp:
            break
        k = min(n, len(held) - 1)
        batch = collate([dataset[(held[k], 0)]])
        if "failed" in batch:
            raise DatasetError(f"eval loss at step {step}: {batch['failed'][0][1]}")
        inputs = model_inputs(batch, EVAL_KEY, k, optim, objective, refs, one, enc, 0, device)
        for q, sigma in enumerate(sigmas):
            loss, _ = forward_loss(transformer, {**inputs, "sigmas": torch.full_like(inputs["sigmas"], sigma)},
                                   objective, refs, one, proc.amp, transformer.dtype)
            if n < len(held):
                per[n, q] = loss
    transformer.train()
    split = getattr(transformer, "context_parallel", None)
    if split is not None and split.rank and world > 1:
        per.zero_()  # a context-parallel group computed each of its samples on every rank: one of them counts it
    if world > 1:
        dist.all_reduce(per)
    means = per.mean(0).tolist()
    return dict(step=step, **{f"{prefix}loss": sum(means) / len(means)},
                **{f"{prefix}loss@{s:.3f}": v for s, v in zip(sigmas, means)})


def evaluate_held_out(step: int, objective: ObjectiveConfig, optim: OptimConfig, validation: ValidationConfig,
                      parallel: ParallelConfig, run: Run, state: TrainState, enc: Encoders, dataset, held: list[int],
                      proc: Process, log=print) -> dict:
    """eval_loss of the trained weights (eval/...) and, with --ema-decay, of their EMA (eval_ema/...), announced and
    timed (the progress bar stops meanwhile)."""
    log(f"step {step}: eval loss of {len(held)} held-out sample(s) ...")
    t0 = time.perf_counter()
    sections = objective, optim, validation, parallel, run
    rec = eval_loss(step, *sections, state.transformer, enc, dataset, held, proc)
    if optim.ema_decay:
        with ema_weights(state.opt, state.params):
            rec.update(eval_loss(step, *sections, state.transformer, enc, dataset, held, proc, "eval_ema/"))
    log(f"step {step}: eval loss {rec['eval/loss']:.4f} ({time.perf_counter() - t0:.1f} s)")
    return rec


def load_val_evaluators(validation: ValidationConfig, ev: EvalConfig, run: Run, enc: Encoders,
                        proc: Process) -> Evaluators | None:
    """The metric encoders of the validation videos (--val-metrics, rank 0), loaded before training so that a bad
    --eval.* dir fails first. CLIP-I uses the run's own image encoder when it has one."""
    if not validation.val_metrics or proc.rank != 0 or not run.validates:
        return None
    clip = None
    if enc.image_encoder is not None:
        clip = Embedder(enc.image_encoder, enc.image_processor, proc.device,
                        next(enc.image_encoder.parameters()).dtype)
    return load_evaluators(ev, run.info.image_encoder_dir, proc.device, run.compute_dtype, clip=clip)


def validate(step: int, validation: ValidationConfig, ev: EvalConfig, parallel: ParallelConfig,
             size: tuple[int, int], clip_size: int, expert: str | None, run: Run, transformer, enc: Encoders,
             run_dir: Path, frozen: dict, proc: Process, evaluators: Evaluators | None = None,
             log=print) -> dict | None:
    """A validation video from --val-elements and --val-prompt (text alone for T2V) into run_dir/samples/.
    Wan 2.2: the other (frozen) expert is loaded at the first validation into `frozen` and waits in host memory
    between validations (on the GPU it would add a whole model to every step). With `evaluators` (rank 0), returns
    the video's metrics as a metrics.jsonl record: step, val/<metric>."""
    if not run.validates or (proc.rank >= parallel.context_parallel and not parallel.fsdp):  # FSDP, CP: all its
        return None  # ranks forward
    h, w = size
    items, layout, refs, clips, region, first_frame = validation_inputs(validation.val_elements, size, clip_size,
                                                                        run.layout, run.elements, run.info.name)
    transformer.eval()
    experts = {}
    high = transformer
    if run.info.two_experts:
        if "other" not in frozen:
            other = "low" if expert == "high" else "high"
            frozen["other"] = load_transformer(run.info.path, run.compute_dtype, EXPERTS[other]).eval()
        frozen["other"].to(proc.device)
        high, low = (transformer, frozen["other"]) if expert == "high" else (frozen["other"], transformer)
        experts = dict(transformer_2=low, boundary_ratio=run.info.boundary_ratio)
    pipe = A2Pipeline(high, enc.vae, enc.tokenizer, enc.text_encoder, enc.image_encoder, enc.image_processor,
                      **experts, expand_timesteps=run.info.ti2v, model=run.info.name, info=run.info,
                      flow_shift=model_flow_shift(run.info.parts_dir))
    with proc.amp:  # the flags the user set; A2Pipeline fills the rest with the kind's own, as for infer.py
        out = pipe(validation.val_prompt, refs, clips, layout=layout, height=h, width=w,
                   num_inference_steps=validation.val_steps, guidance_scale=validation.val_guidance_scale,
                   flow_shift=validation.val_flow_shift, first_frame=first_frame,
                   region=region, sample_mode=run.encode_mode, progress=False)
    transformer.train()
    if "other" in frozen:
        frozen["other"].to("cpu")
    if proc.rank == 0:
        path = save_video(run_dir / "samples" / f"step-{step:07d}.mp4", out["video"][0], out["sampling"].fps,
                          None if refs is None else refs[0])
        log(f"validation video: {path}")
    if evaluators is None or proc.rank != 0:
        return None
    result = evaluate_video(out["video"][0], named_references(items, clips), validation.val_prompt, evaluators,
                            ev.faces, ev.max_frames)
    return dict(step=step, **flat_metrics(result, "val/"))


def visualize(step: int, viz: dict, vis, vae, run_dir: Path) -> None:
    """The dataset config's visualization processors: latents saved as .pt, or decoded to PNG frames."""
    if not vis.enabled or step % vis.frequency:
        return
    out = Path(vis.output_dir.format(run_id=run_dir.name))
    out = out if out.is_absolute() else run_dir / out
    out.mkdir(parents=True, exist_ok=True)
    for processor in vis.processors:
        for key in processor.get("data", []):
            x = viz.get(key)
            if x is None:
                continue
            if processor["type"] == "latent_save" or key == "reference_images":
                torch.save(x.detach().cpu(), out / f"step{step:07d}_{key}.pt")
            elif processor["type"] == "vae_decode":
                with torch.no_grad():
                    frames = decode_vae(vae, x[:, :vae.config.z_dim].detach().float())[0]  # (3, F, H, W)
                for fi in processor.get("frames", [0, -1]):
                    Image.fromarray(tensor_to_uint8(frames[:, fi])).save(out / f"step{step:07d}_{key}_f{fi}.png")
