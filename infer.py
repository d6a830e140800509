"""Generate a video from element images + a prompt (or a prompt alone on a T2V model), check parity between runs,
and compare a LoRA with its base model over a prompt list.

    python infer.py --model tiny --elements subject=human.png object=thing.png background=env.png \
        --prompt "A man is holding a teddy bear in the forest." --out out.mp4
    python infer.py ... --save-latents run_a.pt          # keep the final latents and the condition
    python infer.py ... --compare run_a.pt               # max |Δ| and PSNR per tensor; exit 1 above tolerance
    python infer.py --model tiny-t2v --prompt "a person clapping" --lora runs/t2v/pytorch_lora_weights.safetensors
    python infer.py --model tiny-t2v --prompts-file prompts.txt --lora runs/t2v --out-dir eval/   # base | LoRA
    python infer.py --model tiny-t2v --reference-layout incontext --elements me.png bear.png --num-frames 17 \
        --lora runs/incontext/pytorch_lora_weights.safetensors    # references in context (Phantom / V3 style)
    python infer.py --model /models/SkyReels-A2 --eval-set eval.jsonl --lora runs/a2 --out-dir eval/ \
        --eval.dino /models/dinov2-base --eval.clip-text /models/CLIP-ViT-H-14   # + metrics.csv, base vs LoRA
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a flag typo or a config error answer before the heavy imports below (torch...)
    from a2.cli import exit_on_signal, parse_cli
    from config import InferConfig

    exit_on_signal("the videos written so far are kept; the same command renders again")
    CLI_CONFIG = parse_cli(InferConfig)

import csv
import json
import math
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from a2.cli import ConfigError, InputError, MissingInput, as_input_error, check_dir_to_write, left_as_found, run_cli
from a2.config.dataset_config import check_size, element_kind, height_width
from a2.data.media import read_clip
from a2.elements import A2_ELEMENTS, pair_elements, parse_elements
from a2.eval.evaluate import evaluate_video, format_table, load_evaluators, mean_rows, metric_rows, named_references
from a2.eval.opens2v import read_eval_set
from a2.images import IMAGE_EXTS, load_first_frame, load_references, read_image, resize_frames
from a2.kinds import standin
from a2.kinds.kinds import KIND_DEFS, kind_elements, kind_sampling
from a2.model.parallel import context_parallel, sampling_group
from a2.model.tiny import TINY_MODELS, model_path
from a2.model.transformer import detect_model, load_transformer
from a2.pipeline import A2Pipeline, save_video
from a2.plan import sampling_plan
from a2.train.lora import (
    LORA_FILES,
    base_mismatch,
    expansion_file,
    load_expanded,
    load_lora,
    lora_file_problem,
    read_base_metadata,
)
from config import RECIPES, InferConfig, is_tiny


def resolve(cfg: InferConfig) -> tuple[InferConfig, dict[str, str]]:
    """A copy of cfg with the defaults that depend on the model and the preset filled in: the size, the frames and
    (a built-in tiny model) the steps; --device auto. Returns it and, for the banner, where each of size / frames /
    steps came from when the flags left it out. The sampler's other defaults are the kind's, which A2Pipeline fills."""
    tiny = is_tiny(cfg.model)  # a smoke test: at a real model's 480x832, 81 frames, 50 steps ~30 min on a CPU
    recipe = RECIPES["tiny" if tiny else "model"]  # the size and frames training takes on the model (config.py)
    mode = next((s for k in KIND_DEFS.values() for n, s in k.modes if n == cfg.sampling.preset), None)
    given_size = cfg.resolution is not None or (cfg.height is not None and cfg.width is not None)
    size = recipe["resolution"]
    height, width = height_width(cfg.height, cfg.width, cfg.resolution, size)
    source = {}
    if not given_size:
        source["size"] = "tiny model's default" if tiny else "default"
    num_frames, steps = cfg.num_frames, cfg.sampling.steps
    if num_frames is None:
        num_frames, source["frames"] = ((mode.num_frames, f"--preset {cfg.sampling.preset}")
                                        if mode and mode.num_frames else
                                        (recipe["num_frames"], "tiny model's default") if tiny else
                                        (recipe["num_frames"], "default"))
    if steps is None and tiny and mode is None:  # a preset's steps are its own (A2Pipeline fills them)
        steps, source["steps"] = recipe["val_steps"], "tiny model's default"
    elif steps is None and mode is not None:
        source["steps"] = f"--preset {cfg.sampling.preset}"
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: PyTorch sees no CUDA GPU here (--device cpu, or auto)")
    return replace(cfg, height=height, width=width, resolution=(height, width), num_frames=num_frames,
                   sampling=replace(cfg.sampling, steps=steps), device=device), source


def own_frames(cfg: InferConfig, source: dict[str, str], info) -> tuple[InferConfig, dict[str, str]]:
    """--num-frames left out (and no --preset's) on a real model whose lab's entry point renders its own length
    (Sampling.num_frames: SkyReels-V3's generate_video.py, 5 s at 24 fps): that length. A built-in tiny model keeps
    its smoke-test frames, as it keeps its steps."""
    if "frames" not in source or source["frames"].startswith("--preset") or is_tiny(cfg.model):
        return cfg, source
    kind = element_kind(info, cfg.conditioning)
    frames = kind_sampling(kind, info.name).num_frames
    if frames is None:
        return cfg, source
    return replace(cfg, num_frames=frames), {**source, "frames": f"the {kind} kind's own"}


def size_banner(cfg: InferConfig, steps: int | None, source: dict[str, str]) -> str:
    """What a built-in model renders and, for each of size / frames / steps the flags left out, where it came from."""
    said = [(f"{cfg.height}x{cfg.width}", "size"), (f"{cfg.num_frames} frames", "frames"), (f"{steps} steps", "steps")]
    return (f"--model {cfg.model}: a built-in model, sampled at "
            + ", ".join(text + (f" ({source[key]})" if key in source else "") for text, key in said)
            + "; --resolution, --num-frames and --steps set them")


VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov")  # the containers save_video's H.264 goes in


def read_saved(path: str) -> dict:
    """A --save-latents file (its latents and condition), read before anything renders; a mistake is one line."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zipfile and torch raise many types for a file that is not torch's
        raise InputError(f"--compare {path}: not a --save-latents file ({type(e).__name__}): give the file an "
                         "earlier `infer.py --save-latents FILE` wrote") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("latents"), torch.Tensor):
        raise InputError(f"--compare {path}: a torch file without the latents a --save-latents file holds: give the "
                         "file an earlier `infer.py --save-latents FILE` wrote")
    return saved


def compare_runs(current: dict, saved: dict, tolerance: float) -> bool:
    """Print max |Δ| and PSNR (over the saved tensor's range) per tensor against a --save-latents file's (read_saved);
    True when all are within tolerance."""
    ok = True
    for key in ("latents", "condition"):
        a, b = current.get(key), saved.get(key)
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape:
            shapes = [None if x is None else tuple(x.shape) for x in (a, b)]
            print(f"{key}: shape mismatch {shapes[0]} vs {shapes[1]}")
            ok = False
            continue
        diff = (a.float().cpu() - b.float()).abs()
        mse = diff.pow(2).mean().item()
        peak = (b.max() - b.min()).item() or 1.0
        psnr = math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)
        print(f"{key}: max|Δ|={diff.max().item():.3e} PSNR={psnr:.1f} dB")
        ok &= diff.max().item() <= tolerance
    print("parity: PASS" if ok else f"parity: FAIL (tolerance {tolerance:g})")
    return ok


def read_rows(path: str) -> list[dict]:
    """A prompt list or eval set: one prompt per line, or (.jsonl) a JSON object per line with `prompt` (or
    `caption` / `text`) and optionally `elements`, `seed`, `faces` (--eval-set); blank lines skipped. Returns dicts
    with `prompt`, `line`, the seed and faces found and `images` (element images as --elements takes them, paths
    resolved against the file's dir). A mistake is an InputError naming the line."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"{path}: no such file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line) if path.suffix == ".jsonl" else {"prompt": line}
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected a JSON object, got {line.strip()[:60]}")
        prompt = row.get("prompt") or row.get("caption") or row.get("text")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f"{where}: no 'prompt' (or 'caption' / 'text') text")
        if not isinstance(row.get("seed", 0), int) or isinstance(row.get("seed"), bool):
            raise InputError(f"{where}: 'seed' must be an integer, got {row['seed']!r}")
        faces = row.get("faces", [])
        if not isinstance(faces, list) or not all(isinstance(f, str) for f in faces):
            raise InputError(f"{where}: 'faces' must be a list of element names, got {faces!r}")
        out = dict(prompt=prompt.strip(), line=where, **{k: row[k] for k in ("seed", "faces") if k in row})
        elements = row.get("elements")
        if isinstance(elements, dict) and all(isinstance(p, str) for p in elements.values()):
            out["images"] = [f"{name}={path.parent / p}" for name, p in elements.items()]
        elif isinstance(elements, list) and all(isinstance(p, str) for p in elements):
            out["images"] = [str(path.parent / p) for p in elements]
        elif elements is not None:
            raise InputError(f"{where}: 'elements' must be {{name: path}} or [path, ...], got {elements!r}")
        rows.append(out)
    if not rows:
        raise InputError(f"{path}: no prompts")
    return rows


def read_references(cfg: InferConfig, images, info=None, first_frame: bool = False, seed: int | None = None) -> dict:
    """Element images (`path` or `name=path`) paired with the element specs, the layout they are sampled in
    (check_layout) and the images loaded as it takes them (errors name the file): dict(refs, clip_refs, repeats,
    region, elements (name -> CLIP-path image, for evaluate_video), specs, layout). Without `info` no layout: each
    element framed as A2's specs frame it."""
    items = paired(cfg, info, images, "--elements", first_frame)
    layout = None if info is None else check_layout(cfg, info, tuple(e for e, _ in items), first_frame, seed)
    if not items:
        return dict(refs=None, clip_refs=None, repeats=(), region=None, elements={}, specs=(), layout=layout)
    refs, clip_refs, repeats, region = load_references(items, (cfg.height, cfg.width), (cfg.clip_size,) * 2, layout)
    return dict(refs=refs, clip_refs=clip_refs, repeats=repeats, region=region, layout=layout,
                elements=named_references(items, clip_refs), specs=tuple(e for e, _ in items))


def paired(cfg: InferConfig, info, images, flag: str, first_frame: bool = False) -> list:
    """The element images paired with the specs (element_specs), or one line in the user's terms: a model that
    samples from references given none (ask for them), more images than its kind takes (the model, the kind, its
    most and the fix). flag: where the images came from (--elements, an eval set's sample)."""
    specs = element_specs(cfg, info)
    kind = None if info is None else element_kind(info, cfg.conditioning)
    if (kind is not None and not images and not first_frame and (info.e2v or info.native_kind)
            and cfg.conditioning.frame_conditioning == "full"):
        raise InputError(f"--model {cfg.model} ({info.name}) makes a video of reference images: give --elements "
                         f"IMAGE [IMAGE ...] (1 to {min(KIND_DEFS[kind].references[1], len(specs))})")
    if len(images) > len(specs):
        if cfg.controls.element_specs:
            raise InputError(f"{flag}: {len(images)} images but --element-specs names {len(specs)} elements: give "
                             "one spec per image, or fewer images")
        most = KIND_DEFS[kind].references[1] if kind else len(specs)
        where = f"--model {cfg.model} ({info.name}) samples as the {kind} kind, which" if kind else "A2's layout"
        raise InputError(f"{flag}: {len(images)} images, but {where} takes at most {min(most, len(specs))} "
                         f"references: give at most {min(most, len(specs))}"
                         + (f" (or --element-specs with up to {most} elements)" if most > len(specs) else ""))
    return pair_elements(images, specs)


def element_specs(cfg: InferConfig, info) -> tuple:
    """--element-specs, else the specs the model's kind takes, as training takes them (a2.kinds.conditioning:
    kind_elements)."""
    if cfg.controls.element_specs:
        return parse_elements(cfg.controls.element_specs)
    return A2_ELEMENTS if info is None else kind_elements(element_kind(info, cfg.conditioning))


def lora_paths(cfg: InferConfig) -> list[str]:
    return [p for p in (*cfg.lora, cfg.lora_high, cfg.lora_low) if p]


def check_layout(cfg: InferConfig, info, specs, first_frame: bool, seed: int | None = None):
    """The conditioning plan of a2/plan.py, the one train_a2.py makes (sampling_plan): a model that cannot
    take these inputs (or flags) fails here, in one line, before any weights load. seed: the row's (else --seed)."""
    c = cfg.conditioning
    if c.frame_conditioning not in ("full", "first") or c.frame_conditioning == "first" and not first_frame:
        raise ConfigError(f"--frame-conditioning {c.frame_conditioning}: infer.py conditions on element images "
                          "(full), or on a first frame given with --image (first, Wan 2.2 TI2V-5B)")
    return sampling_plan(info, specs, c, cfg.num_frames, first_frame=first_frame, preset=cfg.sampling.preset,
                         reference_lora=any(map(standin.is_lora_file, lora_paths(cfg))),
                         seed=cfg.sampling.seed if seed is None else seed)


def read_control(cfg: InferConfig, layout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """--control-video (1, 3, F, H, W) in [-1, 1] and --mask (1, F, H, W) in [0, 1] (its first channel, as Wan's
    prepare_source reads it) as a VACE layout takes them: the first F = clip_frames frames of each (a mask may be one
    image, for every frame), centre-cropped to the size and resized (a2.images.resize_frames). (None, None) without
    them; a mistake is a ValueError naming the flag and file."""
    if cfg.controls.control_video is None and cfg.controls.mask is None:
        return None, None
    if layout is None or not layout.context_blocks:
        raise ValueError(f"--control-video / --mask condition a VACE model; the {layout and layout.kind} kind takes "
                         "none: drop them")
    if cfg.controls.control_video is None:
        raise ValueError(f"--mask {cfg.controls.mask}: it says where in --control-video VACE generates: give the video "
                         "too")
    frames, size = layout.clip_frames, (cfg.height, cfg.width)

    def read(flag, path):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
        if flag == "--mask" and path.suffix.lower() in IMAGE_EXTS:
            return np.repeat(np.asarray(read_image(path))[None], frames, axis=0)
        try:
            return read_clip(path, list(range(frames)))
        except Exception as e:  # PyAV, numpy and zip raise many types
            raise ValueError(f"{flag} {path}: its first {frames} frames are not readable ({e})") from e

    video = resize_frames(read("--control-video", cfg.controls.control_video), "center_crop", size)[None]
    mask = (None if cfg.controls.mask is None
            else resize_frames(read("--mask", cfg.controls.mask), "center_crop", size)[:1] * 0.5 + 0.5)
    return video, mask


def generate(cfg: InferConfig, pipe: A2Pipeline, prompt: str, refs, clip_refs, layout, seed=None,
             first_frame=None, region=None, control=(None, None)) -> dict:
    """One video in `layout` (check_layout's, the one plan) with the sampling flags the user set: A2Pipeline fills
    every one left out (None) with the kind's own. seed: the row's (else --seed). control: VACE's (control video,
    mask) (read_control)."""
    sampling = cfg.sampling
    return pipe(prompt, refs, clip_refs, layout=layout, first_frame=first_frame,
                negative_prompt=sampling.negative_prompt, height=cfg.height, width=cfg.width,
                num_inference_steps=sampling.steps, guidance_scale=sampling.guidance_scale,
                guidance_scale_2=sampling.guidance_scale_2, guidance_scale_img=sampling.guidance_scale_img,
                scheduler=sampling.scheduler, schedule=None if sampling.schedule == "model" else sampling.schedule,
                flow_shift=sampling.flow_shift, sample_mode=cfg.conditioning.vae_sample_mode,
                seed=sampling.seed if seed is None else seed, fps=sampling.fps, preset=sampling.preset,
                decode=sampling.decode, region=region, control_video=control[0], mask=control[1])


def set_lora(pipe: A2Pipeline, on: bool) -> None:
    """Switch the loaded LoRA(s) on or off, on whichever transformers carry one (Wan 2.2: either expert): peft
    adapters and a Stand-In file's reference LoRA alike."""
    for model in (pipe.transformer, pipe.transformer_2):
        if getattr(model, "peft_config", None):
            model.enable_lora() if on else model.disable_lora()
        if model is not None and standin.installed(model):
            standin.enable_lora(model, on)


def evaluate(cfg: InferConfig, pipe: A2Pipeline, rows: list[dict], evaluators=None) -> list[dict]:
    """Each row without and (a LoRA loaded) with the LoRA, from the row's seed, side by side in one mp4 per row;
    with `evaluators`, each render scored (a2/eval/evaluate.py). Returns the metric rows
    (a2.eval.evaluate.metric_rows)."""
    out_dir = Path(cfg.out_dir)
    models = ("base", "lora") if lora_paths(cfg) else ("base",)
    paths, index, scores = [], [], []
    for i, row in enumerate(rows):
        refs, seed = row["refs"], row.get("seed", cfg.sampling.seed)
        name = f"{i:03d}_{re.sub(r'[^a-z0-9]+', '-', row['prompt'].lower()).strip('-')[:48]}.mp4"
        halves = []
        for model in models:
            set_lora(pipe, model == "lora")
            out = generate(cfg, pipe, row["prompt"], refs, row["clip_refs"], row["layout"], seed, region=row["region"])
            video, seed = out["video"][0], out["sampling"].seed  # the seed it sampled with (the kind's: none given)
            halves.append(video)
            if evaluators is not None:
                result = evaluate_video(video, row["elements"], row["prompt"], evaluators,
                                        row.get("faces", cfg.eval.faces), cfg.eval.max_frames)
                scores += metric_rows(result, index=i, file=name, prompt=row["prompt"], seed=seed, model=model)
        side = refs[0] if (cfg.side_by_side and refs is not None) else None
        video = torch.cat(halves, dim=-1)  # (3, F, H, W * models)
        paths.append(save_video(out_dir / name, video, out["sampling"].fps, side))
        lora = None if not cfg.lora else cfg.lora[0] if len(cfg.lora) == 1 else list(cfg.lora)
        index.append(dict(file=name, prompt=row["prompt"], seed=seed, lora=lora, lora_scale=cfg.lora_scale))
        print(f"wrote {paths[-1]}" + (" (left: base, right: LoRA)" if len(models) == 2 else ""))
    (out_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))
    return scores


def opens2v_set(cfg: InferConfig) -> bool:
    """--eval-set names an OpenS2V-Eval set (`<Domain>_Eval.json`, a JSON object of samples), not a2's .jsonl."""
    return bool(cfg.eval_set) and Path(cfg.eval_set).suffix == ".json"


def read_opens2v_set(cfg: InferConfig, info) -> list[dict]:
    """An OpenS2V-Eval set as downloaded (`Open-Domain_Eval.json` beside its Images/): a row per sample id with its
    prompt and reference images (by position onto the model's elements). Every image is opened and every sample's
    layout planned here, before any weights load (errors name the sample); the images load when rendered."""
    rows = []
    for sid, sample in read_eval_set(cfg.eval_set).items():
        where = f"{cfg.eval_set}: sample {sid}"
        images = [str(p) for p in sample["images"]]
        for path in images:
            if not Path(path).is_file():
                raise MissingInput(f"{where}: {path}: reference image not found")
            try:
                with Image.open(path) as im:
                    im.verify()
            except Exception as e:  # PIL raises OSError, SyntaxError, ValueError... for damaged files
                raise InputError(f"{where}: {path}: not a readable image ({type(e).__name__}: {e})") from e
        try:
            items = paired(cfg, info, images, "its img_paths")
            layout = check_layout(cfg, info, tuple(e for e, _ in items), False)
        except ValueError as e:
            raise InputError(f"{where}: {e}") from e
        rows.append(dict(id=sid, prompt=sample["prompt"], line=where, images=images, layout=layout,
                         elements={e.name: None for e, _ in items}))
    return rows


def render_opens2v_set(cfg: InferConfig, pipe: A2Pipeline, rows: list[dict], info) -> None:
    """One `<sample id>.mp4` per sample in --out-dir, OpenS2V-Eval's layout (the model as loaded: with its LoRA
    when one is given; no references beside the frames). Resumable: a video already there is kept; a video is
    written into out_dir/.partial/ and moved in when complete, so an interrupted one is redone."""
    out_dir = Path(cfg.out_dir)
    partial = out_dir / ".partial"
    for i, row in enumerate(rows, 1):
        path = out_dir / f"{row['id']}.mp4"
        if path.is_file():
            print(f"[{i}/{len(rows)}] {row['id']}: kept (done before)")
            continue
        try:
            refs = read_references(cfg, row["images"], info)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{row['line']}: {e}") from e
        out = generate(cfg, pipe, row["prompt"], refs["refs"], refs["clip_refs"], refs["layout"],
                       region=refs["region"])
        save_video(partial / path.name, out["video"][0], out["sampling"].fps).replace(path)
        print(f"[{i}/{len(rows)}] {row['id']}: wrote {path}", flush=True)
    if partial.is_dir() and not any(partial.iterdir()):
        partial.rmdir()
    print(f"score them: python3 -m a2.eval.opens2v --videos {out_dir} --eval-set {cfg.eval_set} (encoder flags: "
          "--eval.aes-clip/--eval.aes-mlp, --eval.facesim, --eval.gme; docs/evaluation.md)")


def write_metrics(out_dir: Path, scores: list[dict]) -> list[dict]:
    """metrics.jsonl and metrics.csv: the rows per video and element, then their means per model and element
    (index "mean"). Returns the mean rows."""
    means = mean_rows(scores, label=dict(index="mean"))
    rows = scores + means
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    return means


def read_first_frame(cfg: InferConfig, info) -> torch.Tensor | None:
    """--image as the (1, 3, H, W) first frame of TI2V-5B's image-to-video; errors name the file."""
    if cfg.controls.image is None:
        return None
    if not info.ti2v:
        raise ValueError(f"--image is Wan 2.2 TI2V-5B's image-to-video; {info.path} is {info.name} (I2V / E2V "
                         "models take their images as --elements)")
    return load_first_frame(cfg.controls.image, (cfg.height, cfg.width))


def check_inputs(cfg: InferConfig):
    """The flags resolved and every input mistake (a missing or unreadable file, a size or LoRA the model cannot
    take) said in one line before any weights load. Returns (cfg, source, info, first_frame)."""
    cfg, source = resolve(cfg)
    check_size(cfg.height, cfg.width, cfg.num_frames)
    for flag, path in (*(("--lora", p) for p in cfg.lora), ("--lora-high", cfg.lora_high), ("--lora-low", cfg.lora_low),
                       ("--transformer", cfg.weights.transformer), ("--transformer-2", cfg.weights.transformer_2),
                       ("--compare", cfg.parity.compare)):
        if path and not Path(path).exists():
            raise MissingInput(f"{flag} {path}: no such file or dir")
        if path and flag.startswith("--lora") and (why := lora_file_problem(path)):
            raise InputError(f"{flag} {path}: this {'dir' if Path(path).is_dir() else 'file'} is not a LoRA ({why}): "
                             f"give {LORA_FILES}")
    if cfg.parity.compare:
        read_saved(cfg.parity.compare)
    if cfg.out and Path(cfg.out).suffix.lower() not in VIDEO_SUFFIXES:  # found now, not once the video is rendered
        raise InputError(f"--out {cfg.out}: writes an H.264 video: name it {' / '.join(VIDEO_SUFFIXES)} (e.g. "
                         f"{Path(cfg.out).with_suffix('.mp4')})")
    for flag, path in (("--out", cfg.out), ("--save-latents", cfg.parity.save_latents), ("--out-dir", cfg.out_dir)):
        if path:  # found now, not once the video is rendered
            check_dir_to_write(flag, path, itself=flag == "--out-dir")
    info = as_input_error(lambda: detect_model(model_path(cfg.model), cfg.image_encoder
                                               and model_path(cfg.image_encoder), cfg.components))
    cfg, source = own_frames(cfg, source, info)
    check_size(cfg.height, cfg.width, cfg.num_frames, info.spatial_multiple)
    first_frame = as_input_error(read_first_frame, cfg, info)
    if first_frame is not None and (cfg.prompts_file or cfg.eval_set):
        raise InputError("--image renders one video; it takes no --prompts-file / --eval-set")
    if info.two_experts and cfg.lora:
        raise InputError(f"{info.path} is a {info.name} expert pair: give --lora-high and/or --lora-low, not --lora")
    if not info.two_experts and (cfg.lora_high or cfg.lora_low):
        raise InputError(f"{info.path} ({info.name}) has one transformer: --lora-high/--lora-low are for Wan 2.2 "
                         "A14B; use --lora")
    for path in lora_paths(cfg):  # before the layout check, which would name the model
        if (info.e2v or info.ti2v or info.native_kind) and standin.is_lora_file(path):
            raise InputError(f"{path}: a Stand-In LoRA on {info.path} ({info.name}); Stand-In is a LoRA on Wan T2V: "
                             f"load it on its base ({standin.BASES}) with --reference-layout standin")
    if cfg.prompts_file or cfg.eval_set:
        if cfg.prompts_file and cfg.eval_set:
            raise InputError("give --prompts-file (videos) or --eval-set (videos and metrics), not both")
        if cfg.prompts_file and not lora_paths(cfg):
            raise InputError("--prompts-file renders each prompt without and with a LoRA: give --lora (a Wan 2.2 pair: "
                             "--lora-high / --lora-low)")
        if (cfg.parity.save_latents or cfg.parity.compare or cfg.sampling.decode == "none"
                or cfg.controls.control_video or cfg.controls.mask):
            raise InputError("--prompts-file / --eval-set write videos from their rows' elements: they take no "
                             "--save-latents / --compare / --decode none / --control-video / --mask")
    return cfg, source, info, first_frame


def load_pipeline(cfg: InferConfig, info, source, rows: list[dict], repeats=None) -> tuple[A2Pipeline, int]:
    """(The pipeline of --model with --transformer(s) and every LoRA loaded, this process's rank), after the checks
    that need the videos' planned `rows` (each its layout and element names); prints what was loaded and what is
    rendered. repeats: one video's element frames (said beside them), None for several videos."""
    layouts, items = [row["layout"] for row in rows], [n for row in rows for n in row["elements"]]
    expanded = bool(cfg.lora) and not info.e2v and expansion_file(cfg.lora[0]).is_file()
    if any(lay.expand for lay in layouts) and not (expanded or cfg.weights.transformer):
        raise InputError(f"{cfg.model} is a T2V model (in_channels {info.in_channels}): it takes a prompt only, "
                         "or --elements with --reference-layout incontext, or a LoRA / --transformer trained on it "
                         "expanded to the E2V inputs")
    dtype = getattr(torch, cfg.weights.dtype)
    # torchrun: every rank samples the same video, its tokens split (a2/model/parallel.py)
    rank = sampling_group(cfg.device)
    # Stand-In's packed reference tokens (its K/V cache) are not split: one process
    if dist.is_initialized() and (repeats is None or any(lay.reference_grid is not None for lay in layouts)):
        raise ValueError("infer.py under torchrun samples one video of a kind other than standin (context parallel); "
                         "run --prompts-file / --eval-set / Stand-In in one process")
    transformers = [None if d is None else load_transformer(d, dtype)
                    for d in (cfg.weights.transformer, cfg.weights.transformer_2)]
    if expanded and transformers[0] is None:
        # a LoRA trained on this T2V base expanded to the E2V inputs: expand it with the run's expansion weights
        transformers[0] = load_expanded(load_transformer(info.path, dtype), cfg.lora[0])
        print(f"expanded {info.path} to the E2V inputs with {expansion_file(cfg.lora[0])}")
    pipe = A2Pipeline.from_pretrained(cfg.model, dtype=dtype, device=cfg.device, transformer=transformers[0],
                                      transformer_2=transformers[1], image_encoder_dir=cfg.image_encoder,
                                      components=cfg.components)
    params = sum(p.numel() for p in pipe.transformer.parameters()) / 1e6
    print(f"model {info.path}: {info.name}, transformer {params:.1f}M params"
          + (f" from {cfg.weights.transformer}" if cfg.weights.transformer else "")
          + (f"; two experts: transformer for sigma >= {info.boundary_ratio}, transformer_2 below"
             + (f" (from {cfg.weights.transformer_2})" if cfg.weights.transformer_2 else "")
             if pipe.transformer_2 is not None else "")
          + (f"; image encoder {info.image_encoder_dir}" if pipe.image_encoder is not None else "; no image encoder"))
    if items:  # what each element's image became: its name (and, for one video, the frames it fills)
        print("elements: " + ", ".join(dict.fromkeys(items)) + (f" (repeats {repeats})" if repeats is not None else ""))
    lay = layouts[0] if layouts else None
    if source and cfg.model in TINY_MODELS:  # what it renders, once the kind's own sampler set the steps
        steps = cfg.sampling.steps or (kind_sampling(lay.kind, info.name, cfg.sampling.preset).steps
                                       if lay is not None else None)
        print(size_banner(cfg, steps, source))
    if repeats is not None and lay is not None and cfg.num_frames > lay.video_frames:  # the references are frames
        print(f"video: {lay.video_frames} frames: --num-frames {cfg.num_frames} is the whole sequence, of which the "
              f"references take {lay.num_frames - lay.video_frames}")
    adapters, kind, family = [], lay.kind if lay else None, info.name
    for path in lora_paths(cfg):  # trained on another base or kind: one line each
        note = base_mismatch(path, read_base_metadata(path), pipe.transformer.config, family, kind)
        if note:
            print(note)
    if lay is not None and lay.reference_grid is not None and not any(map(standin.is_lora_file, lora_paths(cfg))):
        print("warning: --reference-layout standin without a Stand-In LoRA file (--lora Stand-In_wan2.1_T2V_14B.ckpt, "
              "or a2's standin_lora.ckpt): the reference image is not attended to by trained weights")
    for i, path in enumerate(cfg.lora):
        adapters.append("default" if i == 0 else f"lora{i}")
        print(as_input_error(load_lora, pipe, path, cfg.lora_scale, adapter=adapters[-1], force=cfg.force))
    adapters = [a for a in adapters if a in (getattr(pipe.transformer, "peft_config", None) or {})]  # (Stand-In: none)
    if len(adapters) > 1:  # load_lora activates its own adapter alone
        pipe.transformer.set_adapters(adapters, [cfg.lora_scale] * len(adapters))
    for path, name in ((cfg.lora_high, "high"), (cfg.lora_low, "low")):  # the experts' files hold the same keys:
        if path:  # the flag says which expert
            print(as_input_error(load_lora, pipe, path, cfg.lora_scale, adapter=name, low_expert=name == "low",
                                 force=cfg.force))
    for model in (pipe.transformer, pipe.transformer_2) if dist.is_initialized() else ():
        if model is not None:
            context_parallel(model, dist.group.WORLD)
    return pipe, rank


def read_row_references(cfg: InferConfig, info, rows: list[dict]) -> list[dict]:
    """Each row of a prompt list or a2's .jsonl eval set with its element images (its own, else --elements) read and
    its layout planned, before any model loads; a mistake names the row."""
    for row in rows:
        try:
            row.update(read_references(cfg, row.get("images", cfg.elements), info, seed=row.get("seed")))
        except FileNotFoundError as e:
            raise MissingInput(f"{row['line']}: {e}") from e
        except ValueError as e:
            raise InputError(f"{row['line']}: {e}") from e
    return rows


def one_video(cfg: InferConfig, info, source, first_frame) -> int:
    """infer.py's main job: one video of --elements (or --image, or the prompt alone) and --prompt, written to --out;
    --save-latents / --compare keep or check the latents (exit 1 when they differ past --tolerance)."""
    refs = as_input_error(read_references, cfg, cfg.elements, info, first_frame is not None)
    control = as_input_error(read_control, cfg, refs["layout"])
    pipe, rank = load_pipeline(cfg, info, source, [refs], refs["repeats"])
    out = generate(cfg, pipe, cfg.prompt, refs["refs"], refs["clip_refs"], refs["layout"], first_frame=first_frame,
                   region=refs["region"], control=control)
    if rank:  # the ranks of a split sample hold the same result: rank 0 writes it
        return 0
    if out["video"] is not None:
        side = refs["refs"][0] if (cfg.side_by_side and refs["refs"] is not None) else None
        path = save_video(cfg.out, out["video"][0], out["sampling"].fps, side)
        n = out["video"].shape[2]
        print(f"wrote {path} ({n} frames, {cfg.height}x{cfg.width}"
              + (f"; --num-frames {cfg.num_frames} less the {cfg.num_frames - n} the references take" if n <
                 cfg.num_frames else "") + ")")
    if cfg.parity.save_latents:
        Path(cfg.parity.save_latents).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"latents": out["latents"].cpu(), "condition": None if out["condition"] is None
                    else out["condition"].cpu(), "config": asdict(cfg)}, cfg.parity.save_latents)
        print(f"wrote {cfg.parity.save_latents}")
    if cfg.parity.compare and not compare_runs(out, read_saved(cfg.parity.compare), cfg.parity.tolerance):
        return 1
    return 0


def prompt_list(cfg: InferConfig, info, source) -> int:
    """--prompts-file: each prompt without and with the LoRA, same seed, side by side, into --out-dir."""
    rows = read_row_references(cfg, info, as_input_error(read_rows, cfg.prompts_file))
    evaluate(cfg, load_pipeline(cfg, info, source, rows)[0], rows)
    return 0


def eval_set(cfg: InferConfig, info, source) -> int:
    """--eval-set: an OpenS2V-Eval set rendered one video per sample (scored by a2.eval.opens2v), or a2's .jsonl
    rendered without and with the LoRA and scored by a2/eval/evaluate.py into --out-dir's metrics.csv / .jsonl."""
    if opens2v_set(cfg):
        rows = read_opens2v_set(cfg, info)
        render_opens2v_set(cfg, load_pipeline(cfg, info, source, rows)[0], rows, info)
        return 0
    rows = read_row_references(cfg, info, as_input_error(read_rows, cfg.eval_set))
    pipe = load_pipeline(cfg, info, source, rows)[0]
    evaluators = load_evaluators(cfg.eval, info.image_encoder_dir, cfg.device)
    scores = evaluate(cfg, pipe, rows, evaluators)
    means = write_metrics(Path(cfg.out_dir), scores)
    print(f"wrote {Path(cfg.out_dir) / 'metrics.csv'} and metrics.jsonl ({len(scores)} rows + means)\n"
          + format_table(means, notes=evaluators.notes))
    return 0


@left_as_found()  # under torchrun: the process group sampling_group starts is destroyed as main ends
def main(cfg: InferConfig) -> int:
    cfg, source, info, first_frame = check_inputs(cfg)
    if cfg.eval_set:
        return eval_set(cfg, info, source)
    if cfg.prompts_file:
        return prompt_list(cfg, info, source)
    return one_video(cfg, info, source, first_frame)


if __name__ == "__main__":
    sys.exit(run_cli(main, CLI_CONFIG))  # bad input: its one line, exit 2
