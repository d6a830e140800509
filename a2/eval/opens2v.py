"""OpenS2V-Eval v1.1: the field's subject-to-video benchmark, scored as its own scripts score it.

    python3 -m a2.eval.opens2v --videos outputs/opens2v --eval-set OpenS2V-Eval/Open-Domain_Eval.json \
        --eval.aes-clip /models/clip-vit-large-patch14 --eval.aes-mlp /models/OpenS2V-Weight/aesthetic-model.pth

OpenS2V-Eval (OpenS2V-Nexus, Apache-2.0) has 180 subject-text pairs in three sets (Open-, Human-, Single-Domain), a
video per sample id (`<id>.mp4`), a script per metric writing one JSON file of per-video scores, and a merge
(`eval/merge_result.py`) that averages each metric over the videos, clips and normalises it and weights it into a
TotalScore. This module is a second implementation of that definition, read from their v1.1 code (the fork
franciszzj/OpenS2V-Nexus, eval/), never copied:

- the metrics a2 computes itself, under their JSON file and key names so their merge (and ours) reads them, each
  defined where it is computed: `aesthetic_score.json` aes_score (Aesthetics), `motion_amplitude.json` motion_fb
  (motion_fb), `facesim.json` cur_score / arc_score (FaceSim), `gmescore.json` gme_score (Gme);
- a proxy that is *not* NexusScore (their detector is YOLO-World, GPL-3.0): `a2_subject_proxy.json`
  subject_clip_i_proxy (subject_clip_i_proxy), printed beside the table and never in a TotalScore;
- MotionSmoothness (Q-Align) and NaturalScore (a hosted judge) and NexusScore come from their own scripts run on the
  same video dir (`motion_smoothness.json`, `naturalscore_{1,2,3}.json`, `nexusscore.json`): merged when present;
- the merge and the TotalScore of merge_result.py, ranked among the published leaderboard rows when it covers every
  metric of the domain on every video of the set; otherwise a partial TotalScore (score_label), never placed among
  them.

Encoders load from local dirs only; a metric whose encoder is not given is skipped with one message.
"""

from __future__ import annotations

if __name__ == "__main__":  # --help, a flag typo or a config error answer before torch loads
    from a2.cli import parse_cli
    from a2.config.sections import OpenS2VConfig

    CLI_CONFIG = parse_cli(OpenS2VConfig, prog="python3 -m a2.eval.opens2v")

import csv
import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from a2.cli import InputError, MissingInput, run_cli

DOMAINS = ("Open-Domain", "Human-Domain", "Single-Domain")

# merge_result.py v1.1: the weights of the normalised metrics; Human-Domain has no NexusScore
WEIGHTS = {
    "Open-Domain": dict(aes_score=0.16, motion_smoothness=0.06, motion_amplitude=0.02, facesim_cur=0.20,
                        gme_score=0.12, nexus_score=0.20, natural_score=0.24),
    "Human-Domain": dict(aes_score=0.18, motion_smoothness=0.09, motion_amplitude=0.03, facesim_cur=0.25,
                         gme_score=0.15, natural_score=0.30),
}
WEIGHTS["Single-Domain"] = WEIGHTS["Open-Domain"]

# (low, high, clip below low too): each per-video value is clipped to high (and to low where marked), averaged over
# the videos that have it, then mapped (avg - low) / (high - low)
RANGES = dict(aes_score=(4.0, 7.0, True), motion_amplitude=(0.0, 1.0, False), motion_smoothness=(0.0, 1.0, False),
              facesim_cur=(0.0, 1.0, False), gme_score=(0.0, 1.0, False), nexus_score=(0.0, 0.05, False),
              natural_score=(1.0, 5.0, True))

PROXY_FILE, PROXY_KEY = "a2_subject_proxy", "subject_clip_i_proxy"
# their per-metric files, and a2's proxy's: file stem -> (key inside a video's record, merged metric name)
FILES = {"aesthetic_score": ("aes_score", "aes_score"), "motion_amplitude": ("motion_fb", "motion_amplitude"),
         "motion_smoothness": ("motion_smoothness", "motion_smoothness"), "facesim": ("cur_score", "facesim_cur"),
         "gmescore": ("gme_score", "gme_score"), "nexusscore": ("nexus_score", "nexus_score"),
         PROXY_FILE: (PROXY_KEY, PROXY_KEY)}
NATURAL_FILES = ("naturalscore_1", "naturalscore_2", "naturalscore_3")

# the leaderboard CSVs' columns (percent) for each merged metric, in their order
COLUMNS = dict(aes_score="Aesthetics↑", motion_smoothness="MotionSmoothness↑", motion_amplitude="MotionAmplitude↑",
               facesim_cur="FaceSim↑", gme_score="GmeScore↑", nexus_score="NexusScore↑",
               natural_score="NaturalScore↑")
TOTAL_COLUMN = "TotalScore↑"
# the published v1.1 tables (leaderboard/file_v1.1/results_<domain>.csv, Apache-2.0; README.md there)
LEADERBOARDS = Path(__file__).resolve().parent / "opens2v_leaderboard"

FACE_IDS = ("singlehuman", "singleface", "faceobj", "humanobj")  # the sample ids get_facesim.py scores
FACE_DIRS = ("/man/", "/woman/", "/crop_woman/", "/crop_man/")  # its reference: the first image in one of these
GME_QUERY = "Find an image that matches the given text."
GME_SYSTEM = "You are a helpful assistant."
GME_MIN_PIXELS, GME_MAX_PIXELS = 4 * 28 * 28, 16384 * 28 * 28  # gme_model.py's bounds on a frame's area (Qwen2-VL's
# size rule, sides multiples of 28) before the processor applies its own
METRIC_FRAMES = 32  # aes, facesim and gme score this many evenly spaced frames; motion_fb all of them


# ---------------------------------------------------------------- sets and videos


def domain_of(path) -> str:
    """`Open-Domain_Eval.json` -> Open-Domain (the merge's eval_type)."""
    name = Path(path).name
    for domain in DOMAINS:
        if name.startswith(domain):
            return domain
    raise InputError(f"{path}: not an OpenS2V-Eval set name (expected one of "
                     f"{', '.join(d + '_Eval.json' for d in DOMAINS)})")


def read_eval_set(path) -> dict[str, dict]:
    """An OpenS2V-Eval set as downloaded: {sample id: {prompt, img_paths (relative to the set's dir, which holds
    Images/), class_label}}. Returns {id: dict(prompt, images (absolute Paths), class_label)}; errors name the
    sample."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"{path}: no such OpenS2V-Eval set (e.g. OpenS2V-Eval/Open-Domain_Eval.json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise InputError(f"{path}: cannot read an OpenS2V-Eval set ({e})") from e
    if not isinstance(data, dict) or not data:
        raise InputError(f"{path}: expected {{sample id: {{prompt, img_paths, ...}}}}, got {type(data).__name__}")
    samples = {}
    for sid, row in data.items():
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise InputError(f"{path}: sample {sid}: no 'prompt'")
        paths = row.get("img_paths")
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise InputError(f"{path}: sample {sid}: 'img_paths' must be a list of paths, got {paths!r}")
        samples[sid] = dict(prompt=row["prompt"].strip(), images=[path.parent / p for p in paths],
                            img_paths=paths, class_label=row.get("class_label", []))
    return samples


def read_video(path) -> np.ndarray:
    """All frames (F, H, W, 3) uint8 RGB, decoded as their scripts decode them (imageio's ffmpeg reader)."""
    import imageio  # its ffmpeg reader, their decoder: loaded when a video is read

    try:
        with imageio.get_reader(str(path), "ffmpeg") as reader:
            frames = [reader.get_data(i) for i in range(reader.count_frames())]
    except Exception as e:  # imageio raises OSError / RuntimeError / IndexError by backend, with ffmpeg's log
        last = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        raise InputError(f"{path}: cannot decode the video ({last[-1].strip()})") from e
    if not frames:
        raise InputError(f"{path}: no frames")
    return np.stack(frames)


def sample_frames(frames: np.ndarray, num_frames: int) -> np.ndarray:
    """Their sample_video_frames: the frames at np.linspace(0, total - 1, num_frames) truncated to int."""
    return frames[np.linspace(0, len(frames) - 1, num_frames, dtype=int)]


# ---------------------------------------------------------------- MotionAmplitude (motion_fb)


def flows(frames: np.ndarray) -> list[np.ndarray]:
    """a2's one motion measure: get_motion_amplitude.py's Farneback flow (pyr_scale 0.5, 3 levels, window 15, 3
    iterations, poly_n 5, sigma 1.2) between consecutive frames (F, H, W, 3) uint8, (H, W, 2) px each. Their frames
    are RGB but converted with COLOR_BGR2GRAY (swapped luma weights): kept, it is the metric's definition."""
    grey = [cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_BGR2GRAY) for frame in frames]
    return [cv2.calcOpticalFlowFarneback(a, b, None, 0.5, 3, 15, 3, 5, 1.2, 0) for a, b in zip(grey, grey[1:])]


def motion_fb(frames: np.ndarray, flow: list[np.ndarray] | None = None) -> float:
    """get_motion_amplitude.py's motion_fb over the whole video: each flow map (`flows`, computed unless given)
    resized (INTER_AREA) to 16 px wide, the signed mean over maps, pixels and both components, its absolute value."""
    flow = flows(frames) if flow is None else flow
    maps = [cv2.resize(f, (16, int(f.shape[0] * (16 / f.shape[1]))), interpolation=cv2.INTER_AREA) for f in flow]
    return abs(float(np.mean(np.mean(np.array(maps), axis=0)))) if maps else 0.0


# ---------------------------------------------------------------- Aesthetics (aes_score)


class AestheticMLP(nn.Module):
    """The LAION aesthetic predictor head on a CLIP ViT-L/14 image embedding (768): its state dict
    (`layers.{0,2,4,6,7}`, OpenS2V-Weight/aesthetic-model.pth) loads unchanged. Dropouts are inert at eval."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)  # (N, 1)


def pil_image_processor(module: str, name: str):
    """The PIL-backed image processor class: their scripts ran on transformers 4.x, whose default CLIP / Qwen2-VL
    processors resize with PIL; transformers 5's default (torchvision) one differs by up to 0.015 in the normalised
    pixels of the demo frames, so v5's `<Name>Pil` is used where it exists."""
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}"),
                       name + "Pil")
    except (ImportError, AttributeError):
        return getattr(importlib.import_module("transformers"), name)


class Embedder:
    """Images (N, H, W, 3) uint8 -> L2-normalised embeddings (N, D) float32 on the CPU.

    A transformers model with its image processor: CLIPModel / CLIPVisionModelWithProjection (projected
    embedding), CLIPVisionModel / Dinov2Model (pooler output: the final-layernormed CLS token). Or, processor None,
    an exported (torch.export / TorchScript) face model taking (B, 3, H, W) RGB in [0, 1], which finds and aligns
    the face itself; its non-finite rows mean "no face found"."""

    def __init__(self, model, processor=None, device="cpu", dtype=torch.float32, batch: int = 16):
        self.model, self.processor, self.device, self.dtype, self.batch = model, processor, device, dtype, batch

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> torch.Tensor:
        out = []
        for i in range(0, len(images), self.batch):
            chunk = images[i:i + self.batch]
            if self.processor is None:
                x = torch.from_numpy(np.ascontiguousarray(chunk)).permute(0, 3, 1, 2).float() / 255
                e = self.model(x.to(self.device))
            else:
                x = self.processor(images=list(chunk), return_tensors="pt").pixel_values
                e = image_features(self.model, x.to(self.device, self.dtype))
            out.append(F.normalize(e.float(), dim=-1).cpu())
        return torch.cat(out)


def pooled(out) -> torch.Tensor:
    """transformers < 5 returns the features as a tensor, >= 5 as an output whose pooler_output holds them."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def image_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "get_image_features"):  # CLIPModel: the projected embedding shared with the text tower
        return pooled(model.get_image_features(pixel_values=pixel_values))
    out = model(pixel_values=pixel_values)
    return out.image_embeds if getattr(out, "image_embeds", None) is not None else out.pooler_output


class Aesthetics:
    """aes_score of frames: their CLIP's unit image embeddings (CLIPVisionModelWithProjection image_embeds, fp32, the
    32 frames in one batch as theirs) through the MLP, mean over the frames (get_aesscore.py)."""

    def __init__(self, clip, processor, mlp: AestheticMLP, device="cpu"):
        self.embed, self.mlp = Embedder(clip.eval(), processor, device, batch=METRIC_FRAMES), mlp.eval()

    @classmethod
    def load(cls, clip_dir, mlp_path, device="cpu") -> Aesthetics:
        from transformers import CLIPVisionModelWithProjection  # heavy: loaded with the encoder

        clip = CLIPVisionModelWithProjection.from_pretrained(clip_dir, torch_dtype=torch.float32).to(device)
        mlp = AestheticMLP(clip.config.projection_dim)
        mlp.load_state_dict(torch.load(mlp_path, map_location="cpu", weights_only=True))
        return cls(clip, pil_image_processor("clip", "CLIPImageProcessor").from_pretrained(clip_dir), mlp, device)

    @torch.no_grad()
    def __call__(self, frames: np.ndarray) -> float:
        return self.mlp(self.embed(frames)).squeeze(1).mean().item()


# ---------------------------------------------------------------- FaceSim-Cur (cur_score)


class IRUnit(nn.Module):
    """TFace's IR basic block (BN-conv-BN-PReLU-conv(stride)-BN plus a shortcut), named as their checkpoints."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.shortcut_layer = (nn.MaxPool2d(1, stride) if cin == cout else
                               nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))
        self.res_layer = nn.Sequential(nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, 1, 1, bias=False),
                                       nn.BatchNorm2d(cout), nn.PReLU(cout), nn.Conv2d(cout, cout, 3, stride, 1,
                                                                                      bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x):
        return self.res_layer(x) + self.shortcut_layer(x)


class IRBackbone(nn.Module):
    """CurricularFace's IR-101 backbone on 112x112 faces -> 512-d embedding (glint360k_curricular_face_r101_backbone
    .bin loads unchanged). `units` / `widths` make the tiny stand-ins of the tests; the defaults are IR-101."""

    def __init__(self, units=(3, 13, 30, 3), widths=(64, 128, 256, 512), dim: int = 512):
        super().__init__()
        self.dim = dim
        self.input_layer = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.PReLU(64))
        body, cin = [], 64
        for n, cout in zip(units, widths):
            body += [IRUnit(cin, cout, 2)] + [IRUnit(cout, cout, 1) for _ in range(n - 1)]
            cin = cout
        self.body = nn.Sequential(*body)
        self.output_layer = nn.Sequential(nn.BatchNorm2d(cin), nn.Dropout(0.4), nn.Flatten(),
                                          nn.Linear(cin * 7 * 7, dim), nn.BatchNorm1d(dim, affine=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 112, 112) in [-1, 1] -> (B, dim)
        return self.output_layer(self.body(self.input_layer(x)))


class FaceSim:
    """get_facesim.py's face model: the largest face insightface finds (det_size 320; retried on a 1.25x grey-padded
    image when none), aligned with insightface's norm_crop to 224, resized to 112, embedded by CurricularFace. Called
    on images it is a face model of the one face-similarity path (below; --eval.face takes its dir too); `faces` adds
    insightface's own recognition embedding, arc_score's.

    `detect(image_bgr) -> (kps (5, 2), embedding) | None` and `align(image_bgr, kps) -> (224, 224, 3) BGR` default to
    insightface; the tests give stand-ins."""

    def __init__(self, cur: nn.Module, detect, align, device="cpu"):
        self.cur, self.detect, self.align, self.device = cur.eval(), detect, align, device

    @classmethod
    def load(cls, model_dir, device="cpu") -> FaceSim:
        """`model_dir` as OpenS2V-Weight lays it out: face_extractor/ (insightface's antelopev2 models, loaded by
        insightface.app.FaceAnalysis) and glint360k_curricular_face_r101_backbone.bin."""
        try:
            from insightface.app import FaceAnalysis
            from insightface.utils import face_align
        except ImportError as e:
            raise InputError(f"cur_score needs insightface and onnxruntime (pip install insightface onnxruntime): "
                             f"{e}") from e
        model_dir = Path(model_dir)
        weights = model_dir / "glint360k_curricular_face_r101_backbone.bin"
        if not weights.is_file() or not (model_dir / "face_extractor").is_dir():
            raise InputError(f"{model_dir}: expected face_extractor/ and {weights.name} (OpenS2V-Weight's layout)")
        providers = ["CUDAExecutionProvider"] if str(device).startswith("cuda") else ["CPUExecutionProvider"]
        app = FaceAnalysis(root=str(model_dir / "face_extractor"), providers=providers)
        app.prepare(ctx_id=0, det_size=(320, 320))

        def detect(image_bgr):
            faces = app.get(image_bgr)
            if not faces:
                return None
            face = max(faces, key=lambda f: (f["bbox"][2] - f["bbox"][0]) * (f["bbox"][3] - f["bbox"][1]))
            return face["kps"], face["embedding"]

        cur = IRBackbone()
        cur.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        return cls(cur.to(device), detect, lambda img, kps: face_align.norm_crop(img, landmark=kps, image_size=224),
                   device)

    def face(self, rgb: np.ndarray):
        """(aligned 224x224 RGB face, recognition embedding) of the largest face, or (None, None)."""
        bgr = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2BGR)
        found = self.detect(bgr)
        if found is None:
            h, w = bgr.shape[:2]
            top, left = int(h * 0.25), int(w * 0.25)
            padded = cv2.copyMakeBorder(bgr, top, top, left, left, cv2.BORDER_CONSTANT, value=(128, 128, 128))
            found = self.detect(padded)
            if found is None:
                return None, None
            found = (np.asarray(found[0]) - np.array([left, top]), found[1])
        return cv2.cvtColor(self.align(bgr, found[0]), cv2.COLOR_BGR2RGB), found[1]

    @torch.no_grad()
    def embed(self, face_rgb: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(cv2.resize(face_rgb, (112, 112)).transpose(2, 0, 1).copy()).float()[None]  # (1,3,112,112)
        e = self.cur(x.div(255).sub(0.5).div(0.5).to(self.device))[0].float().cpu()
        return e / e.norm()

    def faces(self, images: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The unit CurricularFace (N, 512) and insightface (N, D) embeddings of each image's face, NaN rows where
        none is found."""
        found = [self.face(image) for image in images]
        arc_dim = next((len(a) for _, a in found if a is not None), 1)
        return (nan_rows([None if f is None else self.embed(f) for f, _ in found], self.cur.dim),
                nan_rows([None if a is None else F.normalize(torch.as_tensor(a).float(), dim=0) for _, a in found],
                         arc_dim))

    def __call__(self, images: np.ndarray) -> torch.Tensor:
        return self.faces(images)[0]


def nan_rows(rows: list, dim: int) -> torch.Tensor:
    """Vectors stacked (N, dim), a NaN row for each None (no face found)."""
    return torch.stack([torch.full((dim,), np.nan) if r is None else r for r in rows])


# Face similarity, one path: a face model maps images (N, H, W, 3) uint8 RGB to unit embeddings, NaN rows where it
# finds no face (FaceSim, or an exported model through Embedder), and a score reads the cosines (N,) of a
# reference's face to each frame's, NaN where either has none. Two scores read them, and differ by definition:
# - a2's face_sim (--eval.face): face_frames, the share of frames with a face; face_sim_mean / face_sim_max, the mean
#   / max cosine over them;
# - OpenS2V's cur_score (get_facesim.py, --eval.facesim on FaceSim): each cosine clipped at 0, the mean over the
#   frames with a face leaving the zeros out, as their loop does (0 when none); no score when the reference has none.


def face_sim(cos: torch.Tensor) -> dict[str, float]:
    found = cos[torch.isfinite(cos)]
    more = dict(face_sim_mean=found.mean().item(), face_sim_max=found.max().item()) if len(found) else {}
    return dict(face_frames=len(found) / len(cos), **more)


def cur_score(cos: torch.Tensor) -> float:
    kept = cos[torch.isfinite(cos)].clamp(min=0)
    kept = kept[kept != 0]
    return kept.mean().item() if len(kept) else 0.0


def facesim_record(sim: FaceSim, reference: np.ndarray, frames: np.ndarray) -> dict | None:
    """get_facesim.py's record of a video: cur_score, and arc_score, the same on insightface's embedding but with the
    zeros kept (their check of a zero tests the list, not the score); None when the reference has no face."""
    (ref_cur, ref_arc), (cur, arc) = sim.faces(reference[None]), sim.faces(frames)
    if not torch.isfinite(ref_cur).all():
        return None
    arc_cos = (arc * ref_arc).sum(-1).clamp(min=0)  # (N, 1) NaN when no frame has a face
    arc_cos = arc_cos[torch.isfinite(arc_cos)]
    return dict(cur_score=cur_score(cur @ ref_cur[0]), arc_score=arc_cos.mean().item() if len(arc_cos) else 0.0)


def face_reference(sample: dict) -> Path | None:
    """get_facesim.py's reference: the first image under a man / woman folder."""
    for rel, path in zip(sample["img_paths"], sample["images"]):
        if any(d in rel for d in FACE_DIRS):
            return path
    return None


# ---------------------------------------------------------------- GmeScore (gme_score)


class Gme:
    """gme-Qwen2-VL embeddings through transformers (gme_model.py's GmeQwen2VL): a chat-formatted input, the image's
    tokens replaced by the vision tower's merged patches, the language model run with plain 1-D positions (as their
    forward, which bypasses Qwen2-VL's M-RoPE index), the last real token's hidden state, L2-normalised.
    gme_score = mean over 32 frames of the prompt's (query instruction) embedding dotted with each frame's."""

    def __init__(self, model, processor, device="cpu", batch: int = 32):
        self.model, self.processor, self.device, self.batch = model.eval(), processor, device, batch
        if processor is not None:
            processor.tokenizer.padding_side = "right"

    @classmethod
    def load(cls, model_dir, device="cpu", dtype=torch.float16) -> Gme:
        from transformers import AutoModelForImageTextToText, AutoProcessor  # heavy: loaded with the encoder

        model = AutoModelForImageTextToText.from_pretrained(model_dir, torch_dtype=dtype, attn_implementation="sdpa")
        pixels = dict(min_pixels=256 * 28 * 28, max_pixels=1280 * 28 * 28)
        processor = AutoProcessor.from_pretrained(model_dir, **pixels)
        processor.image_processor = pil_image_processor("qwen2_vl", "Qwen2VLImageProcessor").from_pretrained(
            model_dir, **pixels)
        return cls(model.to(device), processor, device)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask, pixel_values=None, image_grid_thw=None) -> torch.Tensor:
        core = self.model.model  # Qwen2VLModel: visual + language_model
        embeds = core.get_input_embeddings()(input_ids)  # (B, L, D)
        if pixel_values is not None:
            image = core.get_image_features(pixel_values, image_grid_thw)  # transformers 4 returns the per-image
            image = torch.cat(getattr(image, "pooler_output", image)).to(embeds.dtype)  # tensors, 5 an output
            embeds[input_ids == self.model.config.image_token_id] = image
        hidden = core.language_model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
        pooled = hidden[torch.arange(len(hidden)), attention_mask.sum(1) - 1]  # the last real token (right padding)
        return F.normalize(pooled.float(), dim=-1)  # (B, D)

    def messages(self, texts, with_image: bool, instruction: str) -> list[str]:
        image = "<|vision_start|><|image_pad|><|vision_end|>" if with_image else ""
        return [f"<|im_start|>system\n{instruction}<|im_end|>\n<|im_start|>user\n{image}{t or ''}<|im_end|>\n"
                "<|im_start|>assistant\n<|endoftext|>" for t in texts]

    def embed(self, texts=None, images=None, instruction: str = GME_SYSTEM) -> torch.Tensor:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # transformers: heavy

        n = len(texts) if texts is not None else len(images)
        out = []
        for i in range(0, n, self.batch):
            t = texts[i:i + self.batch] if texts is not None else [None] * len(images[i:i + self.batch])
            imgs = None
            if images is not None:
                imgs = [Image.fromarray(a) for a in images[i:i + self.batch]]
                imgs = [im.resize(smart_resize(im.height, im.width, 28, GME_MIN_PIXELS, GME_MAX_PIXELS)[::-1])
                        for im in imgs]
            inputs = self.processor(text=self.messages(t, imgs is not None, instruction), images=imgs, padding=True,
                                    truncation=True, max_length=1800, return_tensors="pt").to(self.device)
            out.append(self.forward(inputs["input_ids"], inputs["attention_mask"], inputs.get("pixel_values"),
                                    inputs.get("image_grid_thw")).cpu())
        return torch.cat(out)

    def __call__(self, prompt: str, frames: np.ndarray) -> float:
        # get_gmescore.py embeds the prompt once per frame: the same text, so one embedding serves them all
        query = self.embed(texts=[prompt], instruction=GME_QUERY)  # (1, D)
        corpus = self.embed(images=frames)  # (N, D)
        return (query * corpus).sum(-1).mean().item()


# ---------------------------------------------------------------- the a2 proxy (not NexusScore)


def subject_clip_i_proxy(aes: Aesthetics, references: list[np.ndarray], frames: np.ndarray) -> float:
    """NOT NexusScore (which detects each subject with YOLO-World and compares crops): the CLIP ViT-L/14 cosine of
    each whole reference image and each whole frame, max over frames, mean over references. A cheap trend signal for
    subject fidelity on the aesthetic model's CLIP; it never enters a TotalScore."""
    f = aes.embed(frames)  # (N, 768), unit
    return float(np.mean([(aes.embed(ref[None]) @ f.T).max().item() for ref in references]))


# ---------------------------------------------------------------- merge and TotalScore


def read_scores(path: Path) -> dict:
    """One per-metric JSON file: {video id: record}."""
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected {{video id: score}}, got {type(data).__name__}")
    return data


def merge_dir(json_dir, ids=None) -> dict[str, dict]:
    """merge_result.py's merge_scores_files: every per-metric JSON file of the dir, {video id: {merged metric:
    value}} (natural_score the mean of the naturalscore_* judges present); `ids`: only these videos (None: all).
    Files that are no metric of theirs or ours are ignored."""
    merged: dict[str, dict] = {}
    json_dir = Path(json_dir)
    for stem in (*FILES, *NATURAL_FILES):
        path = json_dir / f"{stem}.json"
        if not path.is_file():
            continue
        for vid, record in read_scores(path).items():
            if ids is not None and vid not in ids:
                continue
            row = merged.setdefault(vid, {})
            if stem in NATURAL_FILES:
                row.setdefault("_natural", []).append(float(record))
            elif isinstance(record, dict) and FILES[stem][0] in record:
                row[FILES[stem][1]] = record[FILES[stem][0]]
    for row in merged.values():
        if "_natural" in row:
            row["natural_score"] = sum(row["_natural"]) / len(row.pop("_natural"))
    return merged


def normalised_metrics(merged: dict[str, dict]) -> dict[str, float]:
    """process_scores: per metric, each video's value clipped (|.| first for the motion metrics; nexus_score 0 means
    'not detected' and is left out), the mean over the videos that have it, mapped to [0, 1] by the metric's range.
    Metrics no video has are absent (their script would map an empty mean to (0 - low) / (high - low))."""
    out = {}
    for metric, (low, high, clip_low) in RANGES.items():
        values = []
        for row in merged.values():
            if metric not in row or (metric == "nexus_score" and row[metric] == 0):
                continue
            v = abs(row[metric]) if metric.startswith("motion") else row[metric]
            v = min(v, high)
            values.append(max(v, low) if clip_low else v)
        if values:
            out[metric] = (sum(values) / len(values) - low) / (high - low)
    return out


def total_score(metrics: dict[str, float], domain: str) -> tuple[float, list[str]]:
    """The TotalScore of merge_result.py v1.1 when every metric of the domain is present; otherwise the partial
    TotalScore: the weights of the metrics present renormalised to sum to 1. Returns (score, missing metrics)."""
    weights = WEIGHTS[domain]
    present = {m: w for m, w in weights.items() if m in metrics}
    missing = [m for m in weights if m not in metrics]
    if not present:
        return float("nan"), missing
    norm = sum(present.values())
    return sum(w * metrics[m] for m, w in present.items()) / norm, missing


def score_label(domain: str, missing: list[str], videos: dict[str, int] | None = None,
                set_size: int | None = None) -> str:
    """What a TotalScore covers: "TotalScore" (every metric of the domain on every video of the set), else a
    partial TotalScore saying how many metrics (their weights renormalised) and videos it covers: no leaderboard
    row. videos: {metric: the videos that have it}; set_size: the set's videos (None: not known)."""
    weights = WEIGHTS[domain]
    counts = sorted(set((videos or {}).values()))
    if not missing and (set_size is None or counts == [set_size]):
        return "TotalScore"
    kept = sum(w for m, w in weights.items() if m not in missing)
    covers = f"{len(weights) - len(missing)} of {len(weights)} metrics"
    if missing:
        covers += (f" (missing {', '.join(COLUMNS[m].rstrip('↑') for m in missing)}; the other weights renormalised "
                   f"from {kept:.2f} to 1)")
    if counts and set_size is not None:  # per metric: one count, or the fewest to the most
        covers += f", {counts[0]}{'' if len(counts) == 1 else f' to {counts[-1]}'} of {set_size} videos"
    return f"partial TotalScore over {covers}: not comparable with the leaderboard's"


def merge_result(json_dir, domain: str, ids=None, set_size: int | None = None) -> dict:
    """merge_result.py's output ({total_score, <normalised metrics>}) over the videos `ids` (None: every video the
    files score) plus `videos` ({metric: the videos that have it}) and, when it covers fewer metrics than the domain
    weighs or fewer videos than the set's `set_size`, `partial` True and `missing` (metrics); `label` says which
    TotalScore it is (score_label)."""
    merged = merge_dir(json_dir, ids)
    metrics = normalised_metrics(merged)
    if not metrics:
        raise InputError(f"{json_dir}: no metric of any video (no encoder given, motion off, none of their JSON files)")
    total, missing = total_score(metrics, domain)
    videos = {m: sum(m in row for row in merged.values()) for m in WEIGHTS[domain] if m in metrics}
    out = dict(total_score=total, **{m: metrics[m] for m in WEIGHTS[domain] if m in metrics}, videos=videos)
    out["label"] = score_label(domain, missing, videos, set_size)
    if out["label"] != "TotalScore":
        out.update(partial=True, missing=missing)
    return out


# ---------------------------------------------------------------- the leaderboard


def read_leaderboard(path) -> list[dict]:
    """A published results_<domain>.csv: [{model, venue, total (percent), metrics {merged metric: fraction}}]."""
    if not Path(path).is_file():
        raise MissingInput(f"--leaderboard {path}: no such file")
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for n, r in enumerate(csv.DictReader(f), 2):
            try:
                metrics = {m: float(r[c].rstrip("%")) / 100 for m, c in COLUMNS.items() if c in r}
                total = float(r[TOTAL_COLUMN].rstrip("%"))
            except (KeyError, ValueError) as e:
                raise InputError(f"{path}:{n}: not a leaderboard row ({e})") from e
            name = r["Model"].split("](")[0].lstrip("[")
            rows.append(dict(model=name, venue=r.get("Venue", ""), total=total, metrics=metrics))
    return rows


def format_table(run: dict, domain: str, published: list[dict], name: str = "this run") -> str:
    """A complete run's TotalScore and metrics (percent, 2 decimals) ranked among the published rows; a partial run's
    own line alone under its label (a partial TotalScore is no leaderboard row)."""
    metrics = list(WEIGHTS[domain])
    head = f"{'model':<28} {'TotalScore':>10} " + " ".join(f"{COLUMNS[m].rstrip('↑')[:12]:>12}" for m in metrics)

    def line(model, total, values, extra=""):
        cells = " ".join(f"{'-' if m not in values else f'{100 * values[m]:.2f}':>12}" for m in metrics)
        return f"{model[:28]:<28} {total:>10.2f} {cells}{extra}"

    rows = [(run["total_score"] * 100, line(name, run["total_score"] * 100, run, "  <-"))]
    if not run.get("partial"):
        rows += [(p["total"], line(p["model"], p["total"], p["metrics"])) for p in published]
    return "\n".join([run["label"], head, "-" * len(head)] + [r for _, r in sorted(rows, key=lambda x: -x[0])])


# ---------------------------------------------------------------- scoring a directory


TINY_LAYERS = 6  # a metric's encoder of fewer transformer layers is a2's tiny random one: no real one is this small


def tiny_encoder_note(model, metrics: str, where) -> str | None:
    """A line saying that `metrics` come from a tiny random encoder (fewer than TINY_LAYERS transformer layers in
    every tower of the transformers `model`: a built-in tiny model's, a test's), so their values are noise (pure
    noise scores a CLIP-I of 0.97 on the tiny model's); None for a real-size model, or one that is no transformers
    model (a face model's export)."""
    config = getattr(model, "config", None)
    towers = (config, getattr(config, "vision_config", None), getattr(config, "text_config", None))
    layers = [n for n in (getattr(c, "num_hidden_layers", None) for c in towers) if isinstance(n, int)]
    if not layers or max(layers) >= TINY_LAYERS:
        return None
    return (f"note: {metrics} come from a {max(layers)}-layer encoder ({where}), a tiny random one (a built-in "
            f"model's or a test's): their values are noise, not {metrics}; give a real encoder's dir for them")


@dataclass
class Scorers:
    """The encoders given (None: that metric is skipped). motion_fb needs none. notes: tiny_encoder_note's lines."""

    aes: Aesthetics | None = None
    face: FaceSim | None = None
    gme: Gme | None = None
    motion: bool = True
    notes: list[str] = field(default_factory=list)


def load_scorers(cfg, device="cpu", gme_dtype=torch.float16) -> Scorers:
    """The encoders of the dirs a config.EvalConfig `cfg` gives (--eval.aes-clip / --eval.aes-mlp, --eval.facesim,
    --eval.gme; --eval.motion-fb); gme in gme_dtype (theirs: float16); notes: which of them are tiny random ones
    (said beside their scores)."""
    if bool(cfg.aes_clip) != bool(cfg.aes_mlp):
        raise InputError("aes_score needs both --eval.aes-clip (CLIP ViT-L/14 dir) and --eval.aes-mlp "
                         "(aesthetic-model.pth)")
    s = Scorers(motion=cfg.motion_fb)
    if cfg.aes_clip:
        s.aes = Aesthetics.load(cfg.aes_clip, cfg.aes_mlp, device)
    if cfg.facesim:
        s.face = FaceSim.load(cfg.facesim, device)
    if cfg.gme:
        s.gme = Gme.load(cfg.gme, device, gme_dtype)
    skipped = [n for n, v in (("aes_score and the subject proxy (no CLIP ViT-L/14 + aesthetic MLP)", s.aes),
                              ("cur_score (no face models dir)", s.face), ("gme_score (no gme-Qwen2-VL dir)", s.gme))
               if v is None]
    if skipped:
        print("not computed (encoder not given): " + "; ".join(skipped))
    s.notes = [n for n in (s.aes and tiny_encoder_note(s.aes.embed.model, "aes_score and the subject proxy",
                                                       cfg.aes_clip),
                           s.gme and tiny_encoder_note(s.gme.model, "gme_score", cfg.gme)) if n]
    return s


def video_metrics(frames: np.ndarray, prompt: str, scorers: Scorers, face_refs=(), flow=None) -> dict[str, float]:
    """The metrics a2 computes of one video's frames (F, H, W, 3) uint8, by their JSON names: motion_fb over every
    frame, aes_score / gme_score / cur_score over 32 evenly spaced ones (cur_score: the mean over the face
    references in which a face is found; flow: the frames' `flows` when already computed). Training validation scores
    the decoded tensor, not an mp4."""
    out = {}
    some = sample_frames(frames, METRIC_FRAMES)
    if scorers.motion:
        out["motion_fb"] = motion_fb(frames, flow)
    if scorers.aes is not None:
        out["aes_score"] = scorers.aes(some)
    if scorers.gme is not None:
        out["gme_score"] = scorers.gme(prompt, some)
    if scorers.face is not None:
        found = [r["cur_score"] for r in (facesim_record(scorers.face, ref, some) for ref in face_refs) if r]
        if found:
            out["cur_score"] = float(np.mean(found))
    return out


def load_image(path) -> np.ndarray:
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    except OSError as e:
        raise InputError(f"{path}: cannot read the reference image ({e})") from e


def score_videos(video_dir, samples: dict[str, dict], json_dir, scorers: Scorers, redo: bool = False) -> set[str]:
    """Each metric a2 computes, over the `<id>.mp4` of `video_dir` that are samples of the set, into json_dir in
    their file format. A metric file already there keeps its videos' scores and gets those of the videos it does not
    hold yet (a render resumed since); redo=True recomputes every video. A face sample in which no face is found has
    no cur_score (their format) and is tried again the next time. Returns the sample ids of the videos there."""
    video_dir, json_dir = Path(video_dir), Path(json_dir)
    json_dir.mkdir(parents=True, exist_ok=True)
    videos = sorted(p for p in video_dir.glob("*.mp4") if p.stem in samples)
    if not videos:
        raise InputError(f"{video_dir}: no <sample id>.mp4 of the set (e.g. {next(iter(samples))}.mp4)")
    on = [stem for stem, enabled in (("motion_amplitude", scorers.motion), ("aesthetic_score", scorers.aes),
                                     (PROXY_FILE, scorers.aes), ("facesim", scorers.face), ("gmescore", scorers.gme))
          if enabled]
    results = {stem: {} if redo or not (json_dir / f"{stem}.json").is_file() else read_scores(json_dir / f"{stem}.json")
               for stem in on}
    kept = {stem: len(r) for stem, r in results.items() if r}
    changed = set()
    for i, path in enumerate(videos, 1):
        sid, sample = path.stem, samples[path.stem]
        face = sid.startswith(FACE_IDS) and face_reference(sample)
        todo = [stem for stem in on if sid not in results[stem] and (stem != "facesim" or face)]
        if not todo:
            continue
        frames = read_video(path)
        some = sample_frames(frames, METRIC_FRAMES)
        if "motion_amplitude" in todo:
            results["motion_amplitude"][sid] = dict(motion_fb=motion_fb(frames))
        if "aesthetic_score" in todo:
            results["aesthetic_score"][sid] = dict(aes_score=scorers.aes(some))
        if PROXY_FILE in todo:
            refs = [load_image(p) for p in sample["images"]]
            results[PROXY_FILE][sid] = {PROXY_KEY: subject_clip_i_proxy(scorers.aes, refs, some)}
        if "facesim" in todo and (found := facesim_record(scorers.face, load_image(face), some)):
            results["facesim"][sid] = found
        if "gmescore" in todo:
            results["gmescore"][sid] = dict(gme_score=scorers.gme(sample["prompt"], some))
        changed.update(todo)
        print(f"[{i}/{len(videos)}] {sid}: " + ", ".join(f"{k}={v:.4f}" for stem in todo
                                                          for k, v in results[stem].get(sid, {}).items()), flush=True)
    if kept:
        print(f"kept the scores already in {json_dir} (" + ", ".join(f"{stem}.json: {n} video(s)" for stem, n in
                                                                    kept.items()) + "; --redo recomputes them)")
    for stem in sorted(changed):
        out = json_dir / f"{stem}.json"
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results[stem], indent=4))
        tmp.replace(out)
    return {path.stem for path in videos}


THEIR_SCRIPTS = """\
MotionSmoothness, NexusScore and NaturalScore come from OpenS2V-Nexus's own scripts (eval/, each in the environment
its README gives), run on the same dirs; their JSON files land next to a2's and are merged by this command:
  python get_motion_smoothness.py --input_video_folder {videos} --output_json_folder {json_dir}
  python get_nexusscore.py --input_video_folder {videos} --input_image_folder {root} \\
      --input_json_file {set} --output_json_folder {json_dir} --yolo_model_path <OpenS2V-Weight>/yolo_world_v2_l_...pth
  python get_naturalscore.py --input_video_folder {videos} --output_json_folder {json_dir} --api_key <key>"""


def main(cfg) -> int:
    """`python3 -m a2.eval.opens2v` on an OpenS2VConfig (a2/config/sections.py): score, merge, print the table. An
    input mistake is an InputError (one line, exit 2 under run_cli)."""
    domain = domain_of(cfg.eval_set)
    samples = read_eval_set(cfg.eval_set)
    videos = Path(cfg.videos)
    if not videos.is_dir():
        raise MissingInput(f"--videos {cfg.videos}: not a directory")
    board = Path(cfg.leaderboard) if cfg.leaderboard else LEADERBOARDS / f"results_{domain}.csv"
    published = read_leaderboard(board)
    json_dir = Path(cfg.json_dir or videos / "opens2v_json")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    scorers = load_scorers(cfg.eval, device, getattr(torch, cfg.gme_dtype))
    ids = score_videos(videos, samples, json_dir, scorers, cfg.redo)  # the means cover the videos there
    result = merge_result(json_dir, domain, ids, len(samples))
    out = videos / f"opens2v_{domain}.json"
    out.write_text(json.dumps(result, indent=4))
    print(f"wrote {out}\n" + format_table(result, domain, published) + "".join(f"\n{n}" for n in scorers.notes))
    proxy = [r[PROXY_KEY] for r in merge_dir(json_dir, ids).values() if PROXY_KEY in r]
    if proxy:
        print(f"{PROXY_KEY} (a2's proxy, not NexusScore; not in any TotalScore): {np.mean(proxy):.4f}")
    if result.get("missing"):
        print(THEIR_SCRIPTS.format(videos=cfg.videos, json_dir=json_dir, set=cfg.eval_set,
                                   root=Path(cfg.eval_set).parent))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, CLI_CONFIG))  # bad input: its one line, exit 2
