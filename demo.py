"""What a training run did, in one picture: the element images, frames of the training clip, of the base model's video
and of the LoRA's (same prompt, seed and elements), and the loss curve; plus how far each video is from the clip.

    python3 demo.py runs/demo --elements sample_data/000_person.png sample_data/000_object.png \
        sample_data/000_background.png --clip sample_data/000.mp4 --out runs/demo/demo.png

Two measures against the clip: the distance, the mean squared pixel difference in [-1, 1] units after averaging
both videos over 8x8 pixel blocks (the latent grid: the tiny model's VAE keeps no finer detail, so finer texture is
no one's to learn); and per element image that shows one coloured shape on white (the synthetic data's square and
disc), where that colour is: the correlation of the video's and the clip's closeness-to-that-colour maps (1: the
shape is where and as large as in the clip; ~0: it is not there).
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a flag typo or a config error answer before the heavy imports below (torch...)
    from a2.cli import parse_cli
    from config import DemoConfig

    CLI_CONFIG = parse_cli(DemoConfig)

import json
import sys
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

import infer
from a2.cli import InputError, MissingInput, as_input_error, run_cli
from a2.images import read_image, tensor_to_uint8
from a2.kinds.kinds import KIND_DEFS
from a2.model.tiny import model_path
from a2.model.transformer import detect_model
from a2.pipeline import A2Pipeline
from a2.train.lora import load_lora
from config import DemoConfig


def block_distance(video: torch.Tensor, clip: torch.Tensor, block: int = 8) -> float:
    """Mean squared difference of two (3, F, H, W) videos in [-1, 1] of one shape after 8x8-pixel block averages."""
    pool = lambda x: F.avg_pool2d(x.float(), block)  # noqa: E731  (frames as the batch: (3, F, H/8, W/8))
    return float(((pool(video) - pool(clip)) ** 2).mean())


def element_colour(image) -> torch.Tensor | None:
    """The colour (3,) in [-1, 1] of the one shape an element image shows on white (the median of its non-white
    pixels), or None when the image is not such a picture (less than 2% or more than 90% of it is not white: a
    background, a photo)."""
    rgb = torch.from_numpy(np.array(image.convert("RGB"))).float() / 127.5 - 1  # (H, W, 3)
    shape = (rgb < 0.7).any(-1)  # (H, W): farther than ~40/255 from white in some channel
    if not 0.02 < shape.float().mean() < 0.9:
        return None
    return rgb[shape].median(0).values


def shape_name(image, fallback: str) -> str:
    """What the one shape of an element image is, for the picture's labels: "square" when it fills its bounding box,
    "disc" when it fills pi/4 of a square box (the synthetic data's two), else `fallback` (the file's name); an image
    that is not one shape on white (element_colour's test) keeps `fallback` too."""
    rgb = np.array(image.convert("RGB")).astype(np.float64) / 127.5 - 1
    shape = (rgb < 0.7).any(-1)  # as element_colour: farther than ~40/255 from white in some channel
    if not 0.02 < shape.mean() < 0.9:
        return fallback
    ys, xs = np.nonzero(shape)
    h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = len(ys) / (h * w)
    if abs(h - w) > 0.1 * max(h, w):
        return fallback
    return "square" if fill > 0.95 else "disc" if abs(fill - np.pi / 4) < 0.06 else fallback


def colour_match(video: torch.Tensor, clip: torch.Tensor, colour: torch.Tensor, width: float = 0.3) -> float:
    """Pearson correlation, over two (3, F, H, W) videos of one shape, of their closeness-to-`colour` maps
    exp(-|pixel - colour|^2 / (2 width^2)): ~1 when the video shows that colour where, and as much as, the clip does;
    ~0 when it shows it nowhere or elsewhere."""
    near = lambda x: torch.exp(-((x - colour.view(3, 1, 1, 1)) ** 2).sum(0) / (2 * width ** 2)).flatten()  # noqa: E731
    a, b = near(video.float()), near(clip.float())  # (F*H*W,)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-12))


def read_clip(path: str | Path) -> torch.Tensor:
    """A video file as (3, F, H, W) in [-1, 1]."""
    frames = iio.imread(path, plugin="pyav")  # (F, H, W, 3) uint8
    return torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1


def loss_curve(steps: list[int], losses: list[float], size: tuple[int, int]):
    """A PIL image of the logged losses (train_a2.py logs one every --log-every steps) and their running mean (10
    points, fewer on a short log), on axes: training step across, loss up, each with ticks at its ends and middle."""
    h, w = size
    img = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(img)
    if len(losses) < 2:
        draw.text((4, h // 2), "no loss logged", fill="black")
        return img
    x, y = np.asarray(steps, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    k = min(10, max(1, len(y) // 5))  # the running mean's window: 10 points, fewer on a short log
    smooth = np.convolve(y, np.ones(k) / k, mode="valid")
    lo, hi = float(y.min()), float(y.max())
    left, right, top, bottom = 52, 10, 16, 30  # the plot's margins: tick labels left and below, its title above
    x0, x1, y0, y1 = left, w - right, h - bottom, top  # the plot area's corners (y grows down)
    sx = lambda v: x0 + (v - x[0]) / max(x[-1] - x[0], 1e-12) * (x1 - x0)  # noqa: E731  (step -> pixel)
    sy = lambda v: y0 - (v - lo) / max(hi - lo, 1e-12) * (y0 - y1)  # noqa: E731  (loss -> pixel)
    draw.line([(x0, y1), (x0, y0), (x1, y0)], fill="black")
    for t in (x[0], (x[0] + x[-1]) / 2, x[-1]):
        draw.line([(sx(t), y0), (sx(t), y0 + 4)], fill="black")
        label = f"{t:.0f}"
        draw.text((sx(t) - 3 * len(label), y0 + 6), label, fill="black")
    for t in (lo, (lo + hi) / 2, hi):
        draw.line([(x0 - 4, sy(t)), (x0, sy(t))], fill="black")
        draw.text((2, sy(t) - 6), f"{t:.3f}", fill="black")
    draw.text(((x0 + x1) // 2 - 40, h - 12), "training step", fill="black")
    draw.text((x0, 1), f"loss ({len(y)} logged points; dark: running mean of {k})", fill="black")
    draw.line(list(zip(sx(x).tolist(), sy(y).tolist())), fill=(170, 170, 230), width=1)
    draw.line(list(zip(sx(x[len(y) - len(smooth):]).tolist(), sy(smooth).tolist())), fill=(20, 20, 160), width=2)
    return img


def compose(elements: list, rows: list[tuple[str, torch.Tensor]], steps: list[int], losses: list[float], frames: int,
            scale: int = 2):
    """The picture: a row of element images, a row of frames per (label, (3, F, H, W) video), the loss curve."""
    def tile(x: torch.Tensor):  # (3, H, W) in [-1, 1]
        im = Image.fromarray(tensor_to_uint8(x))
        return im.resize((im.width * scale, im.height * scale), Image.NEAREST)

    label_w, gap = 150, 4
    tiles = [[tile(v[:, int(i)]) for i in np.linspace(0, v.shape[1] - 1, frames).round()] for _, v in rows]
    th = tiles[0][0].height
    els = [e.convert("RGB").resize((th * e.width // e.height, th)) for e in elements]
    width = label_w + max(sum(t.width + gap for t in row) for row in tiles + [els])
    curve_h = 2 * th
    height = (len(rows) + 1) * (th + gap) + curve_h + gap
    pic = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(pic)
    for r, (label, row) in enumerate([("elements", els)] + [(label, t) for (label, _), t in zip(rows, tiles)]):
        y, x = r * (th + gap), label_w
        for k, line in enumerate(label.split("\n")):
            draw.text((4, y + th // 2 - 6 + 12 * k - 6 * label.count("\n")), line, fill="black")
        for t in row:
            pic.paste(t, (x, y))
            x += t.width + gap
    y = (len(rows) + 1) * (th + gap)
    draw.text((4, y + curve_h // 2 - 6), "training loss", fill="black")
    pic.paste(loss_curve(steps, losses, (curve_h, width - label_w)), (label_w, y))
    return pic


def read_run(run_dir: Path) -> tuple[dict, dict]:
    """A training run dir's config.json and run.json (what it derived: the kind it trained), or an InputError."""
    if not run_dir.is_dir():
        raise MissingInput(f"{run_dir}: no such run dir (train_a2.py --output-dir / --run-name)")
    out = []
    for name in ("config.json", "run.json"):
        try:
            out.append(json.loads((run_dir / name).read_text()))
        except FileNotFoundError as e:
            raise MissingInput(f"{run_dir}: no {name}; not a train_a2.py run dir") from e
        except ValueError as e:
            raise InputError(f"{run_dir / name}: not valid JSON ({e})") from e
    return out[0], out[1]


def run(cfg: DemoConfig) -> dict:
    """Render base and LoRA, write the picture; returns dict(path, base=distance, lora=distance, match={base: {element:
    colour_match}, lora: ...}) (distances None and match empty without --clip). Every input is read, and each
    mistake is an InputError, before any weights load."""
    run_dir = Path(cfg.run_dir)
    config, derived = read_run(run_dir)
    lora = run_dir / "pytorch_lora_weights.safetensors"
    if not lora.is_file():
        raise MissingInput(f"{lora}: no LoRA in the run dir (the run has not finished, or is not a LoRA run)")
    elements = cfg.elements or tuple(config.get("val_elements") or ())
    kind = derived["layout"]["kind"]
    if not elements and KIND_DEFS[kind].references[1]:
        raise InputError(f"{run_dir} trained the {kind} kind on element images and names no --val-elements: give the "
                         "images to render with, --elements IMAGE ... (e.g. a training clip's)")
    prompt = cfg.prompt
    if prompt is None and cfg.clip and Path(cfg.clip).with_suffix(".txt").is_file():
        prompt = Path(cfg.clip).with_suffix(".txt").read_text().strip()
    h, w = config["resolution"]
    icfg, _ = infer.resolve(infer.InferConfig.from_flags(model=config["model"], elements=elements, height=h, width=w,
                                                         num_frames=config["num_frames"], seed=cfg.seed, device="cpu",
                                                         steps=cfg.steps, guidance_scale=cfg.guidance_scale,
                                                         **({"prompt": prompt} if prompt else {})))
    info = as_input_error(detect_model, model_path(icfg.model))
    refs = as_input_error(infer.read_references, icfg, icfg.elements, info)
    images = [as_input_error(read_image, p) for p in elements]
    clip = None
    if cfg.clip:
        if not Path(cfg.clip).is_file():
            raise MissingInput(f"--clip {cfg.clip}: no such video")
        try:
            clip = read_clip(cfg.clip)  # (3, F, H, W)
        except Exception as e:  # PyAV and imageio raise many types for a file that is no video
            raise InputError(f"--clip {cfg.clip}: not a readable video ({type(e).__name__}: {e})") from e
    pipe = A2Pipeline.from_pretrained(icfg.model, device="cpu")
    print(load_lora(pipe, str(lora)))
    videos = {}
    for name in ("base", "lora"):
        infer.set_lora(pipe, name == "lora")
        out = infer.generate(icfg, pipe, icfg.prompt, refs["refs"], refs["clip_refs"], refs["layout"],
                             region=refs["region"])
        videos[name] = out["video"][0].float()  # (3, F, H, W) in [-1, 1]
    colours = [(Path(p).stem, c) for p, c in zip(elements, map(element_colour, images)) if c is not None]
    shapes = {Path(p).stem: shape_name(im, Path(p).stem) for p, im in zip(elements, images)}
    rows, result = [], dict(base=None, lora=None, match={})
    if clip is not None:  # compared over the frames both have, at the videos' size
        n = min(videos["base"].shape[1], clip.shape[1])
        clip = F.interpolate(clip[:, :n], size=(h, w), mode="bilinear", antialias=True)  # (3, n, h, w)
        rows.append(("training clip", clip))
        for k, v in videos.items():
            result[k] = block_distance(v[:, :n], clip)
            result["match"][k] = {name: colour_match(v[:, :n], clip, c) for name, c in colours}
    for k, v in videos.items():
        label = k if result[k] is None else (f"{k}: distance {result[k]:.3f}\ncolour match\n" + "\n".join(
            f"  {shapes[name]} {m:.2f}" for name, m in result["match"][k].items()))
        rows.append((label, v))
    steps, losses = [], []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        logged = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        steps, losses = [r["step"] for r in logged], [r["loss"] for r in logged]
    pic = compose(images, rows, steps, losses, cfg.frames)
    path = Path(cfg.out or run_dir / "demo.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    pic.save(path)
    if cfg.clip:
        print(f"distance to {cfg.clip} (mean squared difference of 8x8-pixel block means, [-1, 1] units): "
              f"base {result['base']:.4f}, LoRA {result['lora']:.4f} (lower is closer)")
        for name, _ in colours:
            which = f", the {shapes[name]}'s," if shapes[name] != name else ""
            print(f"{name}: its colour{which} where the clip has it (correlation, 1 = same place and size): "
                  f"base {result['match']['base'][name]:.2f}, LoRA {result['match']['lora'][name]:.2f}")
    print(f"wrote {path}: elements, " + ("clip, " if cfg.clip else "")
          + f"base and LoRA frames (seed {cfg.seed}), loss curve")
    return dict(path=path, **result)


if __name__ == "__main__":
    sys.exit(run_cli(lambda c: run(c) and 0, CLI_CONFIG))  # bad input: its one line, exit 2
