"""The A2 transformer: diffusers' WanTransformer3DModel, unchanged.

SkyReels-A2 checkpoints load into it as they are (their extra `norm_added_q` is ignored by
diffusers' `_keys_to_ignore_on_load_unexpected`). This file holds the size presets, loading from a
diffusers-format model dir, and the expansion of a T2V model (16 input channels, no image branch)
to the E2V inputs (36 channels, CLIP image tokens) that leaves its output unchanged at init.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from a2 import kaleido
from a2.cli import InputError
from a2.fake import fake_mode_active

Z_DIM = 16  # Wan 2.1 VAE latent channels
TI2V_Z_DIM = 48  # Wan 2.2 VAE (TI2V-5B) latent channels: 16x spatial compression (patch 2 x 8)
MASK_CHANNELS = 4  # one mask value per pixel frame of a latent frame (temporal factor 4)
E2V_IN_CHANNELS = Z_DIM + MASK_CHANNELS + Z_DIM  # noisy latents | mask | condition latents
VACE_IN_CHANNELS = 96  # VACE's context: inactive (16) | reactive (16) video latents | mask (64: an 8x8 pixel block)
TEXT_TOKENS = 512  # diffusers' Wan attention splits image from text as shape[1] - 512
CLIP_TOKENS = 257  # ViT-H/14 at 224: 16*16 patches + CLS

# Plain WanTransformer3DModel configs. `1.3B` is Wan2.1-T2V-1.3B's shape, `14B` is Wan2.1-I2V-14B's
# (= SkyReels-A2's). `tiny` matches the offline tiny components of a2/model/tiny.py (T5 d_model 32, CLIP 32).
PRESETS: dict[str, dict] = {
    "tiny": dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=E2V_IN_CHANNELS,
        out_channels=Z_DIM, text_dim=32, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=32, added_kv_proj_dim=128, rope_max_seq_len=1024,
    ),
    "1.3B": dict(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=Z_DIM,
        out_channels=Z_DIM, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
        rope_max_seq_len=1024,
    ),
    "14B": dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=E2V_IN_CHANNELS,
        out_channels=Z_DIM, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280, added_kv_proj_dim=5120,
        rope_max_seq_len=1024,
    ),
    # Wan2.2-TI2V-5B: the latents alone in and out (48 channels of the Wan 2.2 VAE), no image branch
    "5B": dict(
        patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=TI2V_Z_DIM,
        out_channels=TI2V_Z_DIM, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
    ),
}


# a hint after every n-th block: Wan2.1-VACE-1.3B's vace_layers 0, 2, .., 28; 14B's (and Wan2.2-VACE-Fun-A14B's)
# 0, 5, .., 35; tiny-vace's after each of its 2
VACE_EVERY = {"tiny": 1, "1.3B": 2, "14B": 5}


def preset_config(name: str, e2v: bool | None = None, vace: bool = False) -> dict:
    """A preset's config; e2v=True/False forces the E2V (36 ch + image branch) or T2V (16 ch) inputs; vace=True: the
    T2V preset with VACE's context blocks (a WanVACETransformer3DModel), one hint every VACE_EVERY blocks as the
    released model of its size has them. `tiny-ti2v` is `tiny` shaped as TI2V-5B (48 channels in and out, no image
    branch); `tiny-vace` is tiny with vace."""
    if name == "tiny-vace" or vace:
        cfg = preset_config("tiny" if name == "tiny-vace" else name, e2v=False)
        if name not in VACE_EVERY and name != "tiny-vace":
            raise ValueError(f"preset {name} has no VACE model; VACE's presets: {', '.join(VACE_EVERY)}")
        every = VACE_EVERY.get(name, 1)
        return {**cfg, "vace_layers": list(range(0, cfg["num_layers"], every)), "vace_in_channels": VACE_IN_CHANNELS}
    if name == "tiny-ti2v":
        return {**PRESETS["tiny"], "in_channels": TI2V_Z_DIM, "out_channels": TI2V_Z_DIM, "image_dim": None,
                "added_kv_proj_dim": None}
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = dict(PRESETS[name])
    if cfg["out_channels"] == TI2V_Z_DIM:
        if e2v:
            raise ValueError(f"preset {name} (TI2V-5B) takes the latents alone: E2V goes through the in-context "
                             "layout, not the 36-channel input")
        return cfg
    if e2v is True and cfg["image_dim"] is None:
        inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        cfg.update(in_channels=E2V_IN_CHANNELS, image_dim=1280, added_kv_proj_dim=inner)
    elif e2v is False:
        cfg.update(in_channels=Z_DIM, image_dim=None, added_kv_proj_dim=None)
    return cfg


def embed(transformer, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
          encoder_hidden_states_image: torch.Tensor | None = None):
    """The start of diffusers' WanTransformer3DModel.forward, for the forwards a kind installs (a2/kinds/standin.py,
    a2/kinds/vace.py): (x (B, L, D) the patch tokens, rotary, temb, proj (B, 6, D), text (the image tokens first where
    given), grid: the (f, h, w) tokens)."""
    p_t, p_h, p_w = transformer.config.patch_size
    f, h, w = hidden_states.shape[2:]
    x = transformer.patch_embedding(hidden_states).flatten(2).transpose(1, 2)  # (B, L, D)
    temb, proj, text, image = transformer.condition_embedder(timestep, encoder_hidden_states,
                                                             encoder_hidden_states_image)
    text = text if image is None else torch.cat([image, text], 1)
    return x, transformer.rope(hidden_states), temb, proj.unflatten(1, (6, -1)), text, (f // p_t, h // p_h, w // p_w)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, L, heads, head_dim) with interleaved pairs, the arithmetic of diffusers' WanAttnProcessor."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class VideoOnlyCrossAttnProcessor(WanAttnProcessor):
    """Cross-attention (attn2) for the video tokens only (Stand-In's and RefAlign's reference tokens take no text):
    the last `num_reference` rows (reference tokens) come out zero, and the block adds them to its residual, which
    leaves the reference tokens exactly as they were."""

    num_reference = 0
    split_class = property(lambda self: UlyssesVideoOnlyCrossAttnProcessor)  # its form under context parallel

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        n = self.num_reference
        out = super().__call__(attn, hidden_states[:, :hidden_states.shape[1] - n], encoder_hidden_states,
                               attention_mask, rotary_emb)
        return torch.cat([out, out.new_zeros(out.shape[0], n, out.shape[2])], 1) if n else out


class UlyssesVideoOnlyCrossAttnProcessor(VideoOnlyCrossAttnProcessor):
    """VideoOnlyCrossAttnProcessor under context parallel (a2/model/parallel.py): every local row attends the text, the
    reference rows come out zero (rows of attention are independent: the video rows are those of the unsplit call)."""

    split = None  # a2/model/parallel.py SequenceSplit, set by context_parallel

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        out = WanAttnProcessor.__call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        s = self.split
        index = torch.arange(s.start, s.start + out.shape[1], device=out.device)
        return torch.where((index < s.length - self.num_reference)[:, None], out, out.new_zeros(()))


def unpatchify(transformer, x: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int],
               length: int | None = None) -> torch.Tensor:
    """The end of diffusers' forward: the output norm modulated by temb, the projection (where a context-parallel
    split is gathered: its output hook), its first `length` tokens back to latents (B, C, F, H, W) of the grid."""
    p_t, p_h, p_w = transformer.config.patch_size
    shift, scale = (transformer.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    x = (transformer.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
    x = transformer.proj_out(x)[:, :length]
    x = x.reshape(x.shape[0], *grid, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def is_e2v(transformer: WanTransformer3DModel) -> bool:
    """True when the model takes the 36-channel E2V/I2V input."""
    return transformer.config.in_channels == E2V_IN_CHANNELS


# ---------------------------------------------------------------- model dirs: what is in them


class UnsupportedModel(InputError):
    """A model dir this project cannot train or sample from; the message names the dir and the reason (the CLIs print
    it in one line, no traceback)."""


# transformer classes whose weights load into WanTransformer3DModel unchanged (A2's own class subclasses it)
WAN_TRANSFORMER_CLASSES = ("WanTransformer3DModel", "A2Model")
EXPERTS = {"high": "transformer", "low": "transformer_2"}  # Wan 2.2 A14B: subfolder of each noise-level expert
# the same experts in a Wan 2.2 original-key dir (Wan-AI's Wan2.2-*-A14B, alibaba-pai's Wan2.2-VACE-Fun-A14B)
ORIGINAL_EXPERTS = {"transformer": "high_noise_model", "transformer_2": "low_noise_model"}
# Wan2.2-VACE-Fun-A14B switches to its low-noise expert below timestep 875 (VideoX-Fun's config/wan2.2/
# wan_civitai_t2v.yaml `boundary: 0.875`, read by its examples/wan2.2_vace_fun/predict_*.py)
VACE_FUN_BOUNDARY = 0.875


@dataclass(frozen=True)
class ModelInfo:
    """What detect_model read from a model dir's configs."""

    path: Path
    name: str  # SkyReels-A2 | Wan2.1 I2V | Wan2.1 T2V | Wan2.2 T2V A14B | Wan2.2 I2V A14B | Wan2.1 VACE | ...
    in_channels: int  # 16 (T2V) or 36 (I2V/E2V: noisy | mask | condition)
    image_branch: bool  # the transformer takes CLIP image tokens (image_dim is set)
    image_encoder_dir: Path | None  # a dir with image_encoder/ + image_processor/ (the model's or --image-encoder)
    image_encoder_dim: int | None  # that CLIP's hidden size (ViT-H/14: 1280), the image_dim of an expansion
    boundary_ratio: float | None  # Wan 2.2 A14B: `transformer` (high) for timesteps >= ratio*1000, else `transformer_2`
    # Wan 2.2 TI2V-5B (48-channel VAE, 16x spatial, per-token timesteps)
    z_dim: int = Z_DIM  # latent channels of the VAE
    vae_scale: int = 8  # spatial compression of the VAE (Wan 2.2's: patch 2 x 8 = 16)
    patch_size: tuple[int, int, int] = (1, 2, 2)  # the transformer's (t, h, w) patch
    expand_timesteps: bool = False  # TI2V-5B: one timestep per token (0 on conditioning frames), model_index's flag
    # ---- the released subject-to-video models (Phantom-Wan, SkyReels-V3 R2V)
    native_kind: str | None = None  # the conditioning layout the weights were trained in: "phantom" | "v3" | "magref"
    # | "refalign" | "vace"
    original_weights: tuple[Path, ...] = ()  # original-Wan checkpoint files (Phantom); empty: transformer/ is diffusers
    components_dir: Path | None = None  # where vae/ text_encoder/ tokenizer/ scheduler/ are (None: `path`)

    @property
    def parts_dir(self) -> Path:
        """The dir holding vae/ text_encoder/ tokenizer/ (a Phantom-Wan checkpoint's Wan parts dir, else `path`)."""
        return self.components_dir or self.path

    @property
    def ti2v(self) -> bool:
        """Wan 2.2 TI2V-5B: T2V, and I2V by replacing the first latent frame (no channel conditioning)."""
        return self.expand_timesteps

    @property
    def spatial_multiple(self) -> int:
        """What height and width must be multiples of: the VAE's compression x the patch (Wan 2.1: 16, 5B: 32)."""
        return self.vae_scale * self.patch_size[1]

    def latent_tokens(self, num_frames: int, height: int, width: int) -> int:
        """Transformer tokens of one sample of num_frames x height x width pixels."""
        s, (pt, ph, pw) = self.vae_scale, self.patch_size
        return ((num_frames - 1) // 4 + 1) // pt * (height // s // ph) * (width // s // pw)

    @property
    def e2v(self) -> bool:
        return self.in_channels == E2V_IN_CHANNELS

    @property
    def two_experts(self) -> bool:
        return self.boundary_ratio is not None

    def subfolder(self, expert: str | None) -> str:
        """The transformer subfolder to train: `transformer`, or a Wan 2.2 expert's (`--expert high|low`)."""
        if self.two_experts and expert is None:
            raise UnsupportedModel(f"{self.path}: {self.name} has two experts (boundary_ratio {self.boundary_ratio}); "
                                   "train one at a time with --expert high or --expert low")
        if not self.two_experts and expert is not None:
            raise UnsupportedModel(f"{self.path}: {self.name} has one transformer; --expert is for Wan 2.2 A14B")
        if expert is not None and expert not in EXPERTS:
            raise ValueError(f"--expert must be one of {sorted(EXPERTS)}, got {expert!r}")
        return EXPERTS[expert] if expert else "transformer"


# ---------------------------------------------------------------- original Wan checkpoints (Phantom-Wan)

# a2's names for export only (diffusers_to_original, wan_module_name): diffusers WanTransformer3DModel name -> original
# Wan (Wan2.1 repo's WanModel, Phantom-Wan, ComfyUI) name, of a module or a parameter, inside a block, then at the top
# level; the rest of a key (.weight / .bias) is kept. Reading original names is diffusers' converter's
# (original_to_diffusers). The original block's `norm3` is the cross-attention norm (diffusers' `norm2`); its
# norm1/norm2 carry no weights.
WAN_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    "norm2": "norm3", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2", "scale_shift_table": "modulation",
    "proj_in": "before_proj", "proj_out": "after_proj",  # VACE's context blocks (vace_blocks.N) have these too
}
EMB_POS = "condition_embedder.image_embedder.pos_embed"  # FLF2V's image position embedding (img_emb.emb_pos)
WAN_TOP = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "proj_out": "head.head", "scale_shift_table": "head.modulation", EMB_POS: "img_emb.emb_pos",
    "vace_patch_embedding": "vace_patch_embedding",
}
HEAD_DIM = 128  # every released Wan 2.1 model's attention head width (1.3B: 1536 / 12, 14B: 5120 / 40)


ORIGINAL_PREFIX = re.compile(r"^(model\.)?diffusion_model\.")  # ComfyUI's whole-checkpoint / model files' keys


def original_to_diffusers(sd: dict) -> dict:
    """An original-Wan state dict (`blocks.0.self_attn.q.weight`; bare, or with ComfyUI's `model.diffusion_model.` /
    `diffusion_model.` prefix) -> diffusers names (`blocks.0.attn1.to_q.weight`), by diffusers' own converter (what
    WanTransformer3DModel / WanVACETransformer3DModel.from_single_file apply; a2 reads the config from the tensors,
    original_config, where from_single_file would fetch one from the Hub). The tensors are the same objects; a key
    it does not know keeps its name (original_config has checked the names against the model's)."""
    out = convert_wan_transformer_to_diffusers({ORIGINAL_PREFIX.sub("", k): v for k, v in sd.items()})
    if "img_emb.emb_pos" in out:  # FLF2V's image position embedding, which diffusers 0.42's converter leaves as it is
        out[EMB_POS] = out.pop("img_emb.emb_pos")
    return out


def diffusers_to_original(sd: dict) -> dict:
    """The inverse of original_to_diffusers: diffusers WanTransformer3DModel names -> original Wan names."""
    return {wan_module_name(k): v for k, v in sd.items()}


CHECKPOINT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def original_checkpoints(path: Path) -> list[list[Path]]:
    """The original-Wan checkpoints at `path`, each as its files: a file itself (a `.safetensors.index.json` stands
    for its shards), or in a dir every index (its shards), every safetensors not in an index, every .pth/.pt.
    A diffusers dir (model_index.json) or a dir without weights has none."""
    if path.is_file():
        if path.name.endswith(".safetensors.index.json"):
            return [_shards(path)]
        return [[path]] if path.name.endswith(CHECKPOINT_SUFFIXES) else []
    if not path.is_dir() or (path / "model_index.json").exists() or _diffusers_transformer_dir(path):
        return []
    indexes = sorted(path.glob("*.safetensors.index.json"))
    groups = [_shards(i) for i in indexes]
    sharded = {f for g in groups for f in g}
    groups += [[f] for f in sorted(path.iterdir()) if f.is_file() and f.name.endswith(CHECKPOINT_SUFFIXES)
               and f not in sharded and not f.name.startswith(".")]
    return groups


def dit_checkpoints(path: Path) -> list[list[Path]]:
    """original_checkpoints, less the T5 / VAE / CLIP .pth files an original Wan dir (Wan2.1-I2V-14B, MAGREF) keeps
    beside its DiT: when one is named diffusion_pytorch_model* (as ModelMixin saves the DiT), that one alone."""
    groups = original_checkpoints(path)
    dit = [g for g in groups if g[0].name.startswith("diffusion_pytorch_model")]
    return dit if dit and path.is_dir() else groups


def _diffusers_transformer_dir(path: Path) -> bool:
    """A diffusers transformer dir (its config has diffusers' argument names); the original Wan config.json, also
    written by diffusers' ConfigMixin, has `dim` and `num_heads` instead."""
    try:
        return "num_attention_heads" in json.loads((path / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def _shards(index: Path) -> list[Path]:
    weight_map = _read_json(index, index.parent).get("weight_map") or {}
    return [index.parent / f for f in sorted(set(weight_map.values()))]


def weights_in(path: Path, shapes_only: bool = False) -> dict:
    """The tensors of a weights file by name (shapes_only: their shapes, without reading them): safetensors, or a torch
    pickle, maybe under "state_dict" (weights_only: a pickle cannot run code here; a zip one memory-mapped, a legacy
    one loaded). Values that are no tensor are left out; ValueError when it holds no dict."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if path.suffix.lower() == ".safetensors":
        if not shapes_only:
            return load_file(path)
        with safe_open(path, "pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # a legacy (not zip) pickle cannot be memory-mapped
        sd = torch.load(path, map_location="cpu", weights_only=True)
    sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: holds a {type(sd).__name__}, not a state dict")
    return {k: tuple(v.shape) if shapes_only else v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _checkpoint_shapes(files: list[Path]) -> dict[str, tuple]:
    """name -> shape of every tensor of a checkpoint, without reading the tensors; a ComfyUI prefix is removed."""
    shapes = {}
    for f in files:
        if not f.exists():
            raise UnsupportedModel(f"{f}: missing (listed by the checkpoint's index)")
        try:
            shapes.update(weights_in(f, shapes_only=True))
        except ValueError as e:
            raise UnsupportedModel(str(e)) from e
    return {ORIGINAL_PREFIX.sub("", k): v for k, v in shapes.items()}


def original_wan_config(c) -> dict:
    """The Wan config.json (original names) of a T2V WanTransformer3DModel config `c`, as Wan's repos ship one: what
    original_config reads back the heads (and eps) from, the rest being in the tensors' shapes. A VACE config gets
    VaceWanModel's (Wan2.1 wan/modules/vace_model.py), whose vace_layers say which block each context block hints."""
    wan = dict(_class_name="WanModel", model_type="t2v", dim=c.num_attention_heads * c.attention_head_dim,
               ffn_dim=c.ffn_dim, freq_dim=c.freq_dim, in_dim=c.in_channels, out_dim=c.out_channels,
               num_heads=c.num_attention_heads, num_layers=c.num_layers, text_len=512, eps=c.eps)
    if "vace_layers" in c:
        wan.update(_class_name="VaceWanModel", model_type="vace", vace_layers=list(c.vace_layers),
                   vace_in_dim=c.vace_in_channels)
    return wan


def transformer_class(config) -> type:
    """The diffusers class of a transformer config: WanVACETransformer3DModel for VACE's (it has vace_layers: the
    context blocks and their hints), else WanTransformer3DModel."""
    return WanVACETransformer3DModel if "vace_layers" in config else WanTransformer3DModel


def vace_layers(shapes: dict, num_layers: int, wan: dict, where) -> list[int]:
    """The blocks VACE's context blocks hint, in order: the Wan config.json's vace_layers (VaceWanModel's), else, for
    a checkpoint without one, ComfyUI's rule (comfy/ldm/wan/model.py VaceWanModel: every num_layers // n-th block for
    n context blocks; Wan2.1-VACE-1.3B: 0, 2, .., 28; 14B: 0, 5, .., 35)."""
    n = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("vace_blocks."))
    layers = list(wan.get("vace_layers") or range(0, num_layers, num_layers // n))
    if len(layers) != n or 0 not in layers or max(layers) >= num_layers:
        raise UnsupportedModel(f"{where}: {n} VACE context blocks, but vace_layers {layers} for {num_layers} blocks "
                               "(one per context block, block 0 among them); use the config.json of this model")
    return layers


def original_config(files: list[Path], config_path: Path | None = None, shapes: dict | None = None) -> dict:
    """The diffusers WanTransformer3DModel config of an original-Wan checkpoint: the widths, depth and image branch
    read from the tensors' shapes; heads and eps from a Wan config.json beside it when there is one (Phantom's
    releases ship none; every Wan 2.1 model has 128-wide heads), checked against the shapes. Then the key names,
    read by diffusers' converter as load_original reads them, must be exactly those of that config: one line naming
    the checkpoint and what differs otherwise. `shapes`: the names and shapes once converted to original names
    (a2/kaleido.py), instead of the files'."""
    where = files[0] if len(files) == 1 else files[0].parent
    shapes = _checkpoint_shapes(files) if shapes is None else shapes
    if any(".attn1.to_q." in k for k in shapes):
        raise UnsupportedModel(f"{where}: diffusers key names (attn1.to_q); a diffusers transformer goes in "
                               "<dir>/transformer/ with its config.json, beside model_index.json and the other parts")
    if "patch_embedding.weight" not in shapes or "blocks.0.self_attn.q.weight" not in shapes:
        raise UnsupportedModel(f"{where}: not an original Wan / Phantom-Wan checkpoint (no patch_embedding.weight "
                               f"or blocks.0.self_attn.q.weight among {len(shapes)} tensors)")
    dim, in_dim = shapes["patch_embedding.weight"][:2]
    patch = tuple(shapes["patch_embedding.weight"][2:])
    wan = _read_json(config_path, config_path.parent) if config_path and config_path.exists() else {}
    heads = wan.get("num_heads", dim // HEAD_DIM)
    image = "img_emb.proj.0.weight" in shapes
    num_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
    cfg = dict(
        patch_size=patch, num_attention_heads=heads, attention_head_dim=dim // heads, in_channels=in_dim,
        out_channels=shapes["head.head.weight"][0] // math.prod(patch), text_dim=shapes["text_embedding.0.weight"][1],
        freq_dim=shapes["time_embedding.0.weight"][1], ffn_dim=shapes["blocks.0.ffn.0.weight"][0],
        num_layers=num_layers, cross_attn_norm="blocks.0.norm3.weight" in shapes, qk_norm="rms_norm_across_heads",
        eps=wan.get("eps", 1e-6),
        image_dim=shapes["img_emb.proj.0.weight"][0] if image else None, added_kv_proj_dim=dim if image else None,
        rope_max_seq_len=1024,
    )
    if "vace_patch_embedding.weight" in shapes:  # Wan's VACE (VaceWanModel): context blocks beside the blocks
        cfg.update(vace_layers=vace_layers(shapes, num_layers, wan, where),
                   vace_in_channels=shapes["vace_patch_embedding.weight"][1])
    said = {"dim": dim, "in_dim": in_dim, "out_dim": cfg["out_channels"], "ffn_dim": cfg["ffn_dim"],
            "freq_dim": cfg["freq_dim"], "num_layers": cfg["num_layers"], "vace_in_dim": cfg.get("vace_in_channels")}
    wrong = {k: (wan[k], v) for k, v in said.items() if k in wan and wan[k] != v}
    if wrong or dim % heads:
        raise UnsupportedModel(f"{where}: {config_path} does not describe these weights (config vs tensors: "
                               f"{wrong or {'num_heads': heads, 'dim': dim}}); use the config.json of this model")
    with torch.device("meta"):
        expected = transformer_class(cfg)(**cfg).state_dict()
    try:  # as load_original will name them: diffusers name -> own
        names = original_to_diffusers({k: k for k in shapes})
    except Exception as e:  # keys the converter reshapes too (Wan-Animate's motion encoder, face adapter)
        raise UnsupportedModel(f"{where}: not a Wan / VACE checkpoint a2 reads ({type(e).__name__}: {e})") from e
    missing = sorted(wan_module_name(k) for k in set(expected) - set(names))
    extra = sorted(names[k] for k in set(names) - set(expected))
    bad = [names[k] for k in set(expected) & set(names) if tuple(expected[k].shape) != shapes[names[k]]]
    if missing or extra or bad:
        raise UnsupportedModel(f"{where}: not a complete original-Wan checkpoint of a {cfg['num_layers']}-block "
                               f"{dim}-wide model: {len(missing)} missing {missing[:3]}, {len(extra)} unexpected "
                               f"{extra[:3]}, {len(bad)} of another shape {sorted(bad)[:3]}; pass the Phantom-Wan "
                               "checkpoint as released (Phantom-Wan-1.3B.pth, or the 14B's .safetensors.index.json)")
    return cfg


@torch.no_grad()
def load_original(files: list[Path], config: dict, dtype: torch.dtype = torch.float32,
                  sd: dict | None = None) -> WanTransformer3DModel:
    """WanTransformer3DModel of `config` (original_config) with an original-Wan checkpoint's weights, every
    parameter assigned (strict); `sd`: those weights already read, in diffusers names (a2/kaleido.py)."""
    if sd is None:
        sd = original_to_diffusers({k: v for f in files for k, v in weights_in(f).items()})
    model = transformer_class(config)(**config)
    keep = set(model._keep_in_fp32_modules)
    model.load_state_dict(sd, strict=True)
    for name, p in model.named_parameters():  # as from_pretrained(torch_dtype=...) keeps them
        p.data = p.data.to(torch.float32 if keep & set(name.split(".")) else dtype)
    return model.eval()


def _read_json(path: Path, model_dir: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UnsupportedModel(f"{model_dir}: {path.relative_to(model_dir)} is missing") from None
    except json.JSONDecodeError as e:
        raise UnsupportedModel(f"{model_dir}: {path.relative_to(model_dir)} is not valid JSON ({e})") from None


def _listed(index: dict, name: str) -> bool:
    """model_index.json lists a component as [library, class]; [null, null] (or absent) means none."""
    v = index.get(name)
    return isinstance(v, list) and len(v) == 2 and v[0] is not None


# diffusers-format Wan T2V whose VAE, UMT5 and tokenizer Phantom-Wan uses (its README: Wan2.1-T2V-1.3B's, for both
# sizes); a Phantom dir without its own vae/ text_encoder/ tokenizer/ takes them from here
PHANTOM_COMPONENTS = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
# MAGREF (MAGREF-Video/MAGREF) is a Wan2.1 I2V-14B fine-tune: that model's VAE, UMT5, CLIP in diffusers format
MAGREF_COMPONENTS = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
# SkyReels-V3 R2V's transformer classes: its code's class, and the name its released config.json carries
V3_CLASSES = ("SkyReelsA2WanI2v3DModel", "SkyReelsC1WanI2v3DModel")
KALEIDO_COMPONENTS = "Wan-AI/Wan2.1-T2V-14B-Diffusers"  # Kaleido is a Wan2.1-T2V-14B fine-tune
COMPONENTS = ("vae", "text_encoder", "tokenizer")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name; a path that exists locally wins


def hub_snapshot(repo_id: str, parts: tuple[str, ...] = (), what: str | None = None) -> Path:
    """The dir of `repo_id` in the Hub cache, downloaded there on first use (parts: only these subdirs, as
    huggingface_hub's allow_patterns: a model's VAE and text encoder without the transformer it never reads).
    HF_HUB_OFFLINE / HF_HUB_CACHE are read when called (huggingface_hub reads them once, at import); offline and not
    cached is one line saying what to do, after `what` (default: the id is no local dir either)."""
    from huggingface_hub import constants, snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    patterns = [f"{p}/*" for p in parts] or None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=offline, allow_patterns=patterns))
    except Exception as e:  # offline and absent, no network, no such repo, gated: one line, with the way out
        first = (str(e).splitlines() or [""])[0]
        get = f"hf download {repo_id}" + "".join(f" --include '{p}'" for p in patterns or ())
        why = (f"is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: download it once with network "
               f"(`{get}`, or unset HF_HUB_OFFLINE)" if offline else
               f"could not be downloaded ({type(e).__name__}: {first}); check the id and the network (gated repos "
               "need `hf auth login`)")
        raise UnsupportedModel(f"{what or f'{repo_id}: no such local dir, and the Hugging Face Hub model'} {why}"
                               + ("" if what else ", or pass a local model dir")) from None


def not_a_model(name, built_in=()) -> str:
    """The line for a --model that is no file or dir (built_in: the built-in names a2.model.tiny.model_path offers)."""
    return (f"{name}: not a directory (expected a diffusers-format Wan model dir, a Phantom-Wan checkpoint, a Hugging "
            "Face Hub id (org/name), or the name of a built-in model" + (": " + ", ".join(built_in) if built_in else "")
            + ")")


def is_hub_id(name) -> bool:
    """`name` is read from the Hugging Face Hub: an org/name that is no local path (a local one wins)."""
    return not Path(name).exists() and bool(HUB_ID.fullmatch(str(name)))


def local_or_hub(name) -> Path:
    """A local path as it is, else a Hugging Face Hub id (org/name) resolved through the Hub cache (hub_snapshot)."""
    return hub_snapshot(str(name)) if is_hub_id(name) else Path(name)


def detect_phantom(path: Path, components=None) -> ModelInfo:
    """A Phantom-Wan model: an original-Wan checkpoint (a file: .pth, .safetensors, or a shards' .safetensors.index
    .json; or a dir holding exactly one, optionally with a Wan config.json) and the Wan T2V parts it runs with
    (vae/, text_encoder/, tokenizer/, scheduler/ in diffusers format: `components`, else the dir's own, else
    PHANTOM_COMPONENTS from the Hub). Keys and shapes are checked here, before any weights load."""
    d = path.parent if path.is_file() else path
    found = dit_checkpoints(path)
    if len(found) != 1:
        names = [g[0].name if len(g) == 1 else f"{g[0].parent.name}/*.safetensors.index.json" for g in found]
        raise UnsupportedModel(f"{path}: {'no' if not found else len(found)} original-Wan checkpoints {names}; pass "
                               "one checkpoint file (e.g. <dir>/Phantom-Wan-1.3B.pth or the 14B's .safetensors"
                               ".index.json)" if found else f"{path}: no model_index.json and no original-Wan "
                               "checkpoint (.safetensors/.pth); expected a diffusers-format model dir or a "
                               "Phantom-Wan checkpoint")
    files = found[0]
    cfg = original_config(files, d / "config.json")
    if (cfg["in_channels"], cfg["out_channels"]) == (E2V_IN_CHANNELS, Z_DIM) and cfg["image_dim"] is not None:
        return detect_magref(path, files, components)
    if cfg["in_channels"] != Z_DIM or cfg["out_channels"] != Z_DIM or cfg["image_dim"] is not None:
        raise UnsupportedModel(f"{path}: an original-Wan checkpoint with in/out channels {cfg['in_channels']}/"
                               f"{cfg['out_channels']}{' and an image branch' if cfg['image_dim'] else ''}; Phantom-"
                               "Wan is a T2V model (16 in, 16 out, no image branch); convert other Wan models with "
                               "diffusers' scripts/convert_wan_to_diffusers.py")
    comp = parts_dir(path, d, components)
    # Wan2.1-VACE 1.3B / 14B as Wan-AI ships them (VaceWanModel's keys and config.json); RefAlign by its name
    name, native = (("Wan2.1 VACE", "vace") if "vace_layers" in cfg else ("RefAlign", "refalign")
                    if is_refalign(files[0]) else ("Phantom-Wan", "phantom"))
    return ModelInfo(path, name, Z_DIM, False, None, None, None, native_kind=native, original_weights=tuple(files),
                     components_dir=comp)


def parts_dir(path: Path, d: Path, components=None, parts=COMPONENTS, default: str = PHANTOM_COMPONENTS,
              family: str = "T2V") -> Path:
    """The diffusers Wan parts dir (`parts`: vae/, text_encoder/, tokenizer/, ...) an original-key checkpoint at
    `path` (dir `d`) runs with: `components`, else `d` when it holds them, else `default` from the Hub (T2V: Wan 2.1's
    VAE and UMT5, those of Phantom-Wan, RefAlign, Wan2.1-VACE and Wan2.2-VACE-Fun alike; MAGREF: Wan2.1 I2V's)."""
    listed = ", ".join(f"{c}/" for c in parts)
    if components:
        comp = local_or_hub(components)
    elif all((d / c).is_dir() for c in parts):
        comp = d
    else:  # the parts alone (and the scheduler config the shift is read from): not the transformer it never reads
        comp = hub_snapshot(default, parts + ("scheduler",), what=(
            f"{path}: its Wan {family} parts ({listed} in diffusers format) are not beside it: --components DIR names "
            f"a dir holding them; else they come from {default} on the Hugging Face Hub, which"))
    missing = [c for c in parts if not (comp / c).is_dir()]
    if missing:
        raise UnsupportedModel(f"{path}: the Wan {family} parts dir {comp} has no {', '.join(missing)}/; this "
                               f"checkpoint runs with {default}'s ({listed}): give them with --components DIR, or put "
                               "them beside it")
    return comp


def detect_vace_fun(d: Path, components=None) -> ModelInfo:
    """Wan2.2-VACE-Fun-A14B as alibaba-pai ships it: high_noise_model/ and low_noise_model/ (ORIGINAL_EXPERTS), each
    VaceWanModel's original keys and config.json, a Wan2.2-T2V-A14B pair with VACE context blocks; the Wan 2.1 VAE and
    UMT5 beside them (Wan2.1_VAE.pth, models_t5_umt5-xxl-enc-bf16.pth: a2 takes their diffusers form, parts_dir)."""
    configs, files = [], []
    for sub in ORIGINAL_EXPERTS.values():
        found = dit_checkpoints(d / sub)
        if len(found) != 1:
            raise UnsupportedModel(f"{d / sub}: {len(found)} original-Wan checkpoints; expected the expert's "
                                   "diffusion_pytorch_model*.safetensors (with its index when sharded)")
        configs.append(original_config(found[0], d / sub / "config.json"))
        files += found[0]
    if any("vace_layers" not in c for c in configs):
        raise UnsupportedModel(f"{d}: a Wan 2.2 original-key expert pair without VACE's context blocks (vace_blocks);"
                               " a2 reads Wan 2.2 A14B T2V / I2V in diffusers format (the -Diffusers repos)")
    if configs[0] != configs[1]:
        differ = {k: (v, configs[1].get(k)) for k, v in configs[0].items() if v != configs[1].get(k)}
        raise UnsupportedModel(f"{d}: high_noise_model and low_noise_model have other shapes (high, low: {differ})")
    return ModelInfo(d, "Wan2.2 VACE-Fun A14B", Z_DIM, False, None, None, VACE_FUN_BOUNDARY, native_kind="vace",
                     original_weights=tuple(files), components_dir=parts_dir(d, d, components))



def is_refalign(checkpoint: Path) -> bool:
    """RefAlign's weights are a plain Wan2.1 T2V DiT in original keys (its model.safetensors), as Phantom-Wan's are:
    the tensors cannot tell them apart, so the name does: a checkpoint file or its dir named RefAlign, or a Hub cache
    repo of that name (gudaochangsheng/RefAlign-1.3B / -14B, or downloaded into a dir so named; a2's export
    transformer_original/refalign_model.safetensors) is RefAlign's, any other original-Wan T2V checkpoint
    Phantom-Wan's."""
    path = Path(checkpoint).absolute()
    names = [path.name, path.parent.name] + [p for p in path.parts if p.startswith("models--")]
    return any("refalign" in name.lower() for name in names)


def detect_magref(path: Path, files: list[Path], components=None) -> ModelInfo:
    """MAGREF: an original-Wan I2V checkpoint (MAGREF-Video/MAGREF: the DiT as diffusion_pytorch_model*.safetensors
    with Wan's config.json, beside T5 / VAE / CLIP .pth files a2 does not read) and the diffusers Wan 2.1 I2V parts
    it runs with (vae/, text_encoder/, tokenizer/, image_encoder/, image_processor/, scheduler/: `components`, else
    the dir's own, else MAGREF_COMPONENTS from the Hub; MAGREF's own T5, VAE and CLIP are Wan 2.1 I2V's). An original
    Wan2.1 I2V checkpoint has the same architecture and reads the same way."""
    comp = parts_dir(path, path.parent if path.is_file() else path, components,
                     COMPONENTS + ("image_encoder", "image_processor"), MAGREF_COMPONENTS, "I2V")
    enc_dim = _read_json(comp / "image_encoder" / "config.json", comp).get("hidden_size")
    return ModelInfo(path, "MAGREF", E2V_IN_CHANNELS, True, comp, enc_dim, None, native_kind="magref",
                     original_weights=tuple(files), components_dir=comp)


def kaleido_config(file: Path, sd: dict) -> dict:
    """The diffusers config of Kaleido's SAT checkpoint `file`, its weights `sd` converted to original names
    (a2/kaleido.py read): original_config of their shapes, heads 128 wide as every Wan 2.1 model's unless a Wan
    config.json sits beside the `latest` tracker (a2's tiny-kaleido)."""
    return original_config([file], file.parent.parent / "config.json", {k: tuple(v.shape) for k, v in sd.items()})


def detect_kaleido(path: Path, components=None) -> ModelInfo:
    """A Kaleido release (a2/kaleido.py checkpoint: SAT's `latest` and its mp_rank_00 file): a Wan2.1 T2V DiT,
    checked from its converted names and shapes, and the Wan T2V parts it runs with in diffusers format
    (`components`, else beside it, else KALEIDO_COMPONENTS': its Wan2.1_VAE.pth and umt5-xxl are those models')."""
    file = kaleido.checkpoint(path)
    if not file.is_file():
        raise UnsupportedModel(f"{path}: its `latest` names {file.parent.name}, but {file} is missing; pass the "
                               "Kaleido-14B-S2V dir as merge_kaleido.py leaves it")
    cfg = kaleido_config(file, kaleido.read(file))
    if (cfg["in_channels"], cfg["out_channels"], cfg["image_dim"]) != (Z_DIM, Z_DIM, None):
        raise UnsupportedModel(f"{file}: a SAT checkpoint with in/out channels {cfg['in_channels']}/"
                               f"{cfg['out_channels']}; Kaleido is a Wan2.1 T2V model (16 in, 16 out, no image branch)")
    d = path.parent if path.is_file() else path
    return ModelInfo(path, "Kaleido", Z_DIM, False, None, None, None, native_kind="kaleido", original_weights=(file,),
                     components_dir=parts_dir(path, d, components, default=KALEIDO_COMPONENTS))


def detect_model(model_dir, image_encoder=None, components=None) -> ModelInfo:
    """Read a diffusers-format model dir's configs and say which supported model it is, or raise UnsupportedModel.

    Supported: Wan 2.2 TI2V-5B (model_index `expand_timesteps`, a 48-channel Wan 2.2 VAE with 16x spatial
    compression, 48 channels in and out), SkyReels-A2 and Wan2.1 I2V 14B 480P/720P (36 input channels, CLIP
    image branch), Wan2.1 T2V 1.3B/14B (16 channels), Wan 2.2 A14B T2V/I2V (two experts `transformer` /
    `transformer_2` switched at `boundary_ratio`; the I2V pair has 36 channels but no image branch).
    `image_encoder` is a dir with image_encoder/ + image_processor/ that overrides the model's own (for a T2V
    model expanded to E2V).
    Phantom-Wan: an original-Wan checkpoint (detect_phantom; `components`: the dir of its Wan T2V parts).
    SkyReels-V3 R2V: a diffusers dir whose transformer is their class (V3_CLASSES), the modules of
    WanTransformer3DModel under another name (16 channels: the references are appended on the time axis).
    Names (built-in tiny models, Hub ids) are resolved to dirs by a2.model.tiny.model_path before this, for both."""
    d = Path(model_dir)
    if kaleido.checkpoint(d) is not None:
        return detect_kaleido(d, components)
    if d.is_dir() and not (d / "model_index.json").exists() and all((d / s).is_dir() for s in
                                                                     ORIGINAL_EXPERTS.values()):
        return detect_vace_fun(d, components)
    if d.is_file() or (d.is_dir() and not (d / "model_index.json").exists() and dit_checkpoints(d)):
        return detect_phantom(d, components)
    if not d.is_dir():
        raise UnsupportedModel(not_a_model(d))
    if not (d / "model_index.json").exists():
        raise UnsupportedModel(f"{d}: no model_index.json; expected a diffusers-format model dir (SkyReels-A2, "
                               "Wan2.1 I2V/T2V, Wan 2.2 A14B T2V/I2V, SkyReels-V3 R2V) or a Phantom-Wan checkpoint")
    index = _read_json(d / "model_index.json", d)
    ti2v = bool(index.get("expand_timesteps"))  # Wan 2.2 TI2V-5B
    for part in ("transformer", "vae", "text_encoder", "tokenizer"):
        if not _listed(index, part) or not (d / part).is_dir():
            raise UnsupportedModel(f"{d}: component {part!r} is missing (model_index.json lists "
                                   f"{index.get(part)!r}; dir {'present' if (d / part).is_dir() else 'absent'})")
    vae = _read_json(d / "vae" / "config.json", d)
    z_dim = TI2V_Z_DIM if ti2v else Z_DIM
    if vae.get("_class_name") != "AutoencoderKLWan" or vae.get("z_dim") != z_dim:
        raise UnsupportedModel(f"{d}: vae is {vae.get('_class_name')} with z_dim {vae.get('z_dim')}; need "
                               + ("Wan 2.2's AutoencoderKLWan, z_dim 48 (expand_timesteps is set: TI2V-5B)" if ti2v
                                  else f"the Wan 2.1 AutoencoderKLWan, z_dim {Z_DIM}"))
    vae_scale = vae.get("scale_factor_spatial") or 8

    experts = ["transformer"]
    ratio = index.get("boundary_ratio")
    if _listed(index, "transformer_2"):
        if not isinstance(ratio, int | float) or not 0 < ratio < 1:
            raise UnsupportedModel(f"{d}: transformer_2 is listed but boundary_ratio is {ratio!r}; a Wan 2.2 A14B "
                                   "dir switches experts at a boundary_ratio in (0, 1)")
        experts.append("transformer_2")
    elif ratio is not None:
        raise UnsupportedModel(f"{d}: boundary_ratio {ratio} is set but there is no transformer_2")
    configs = []
    for sub in experts:
        cfg = _read_json(d / sub / "config.json", d)
        cls = cfg.get("_class_name")
        if cls == "WanVACETransformer3DModel":  # Wan2.1-VACE-*-diffusers; a pair: Wan2.2-VACE-Fun-A14B
            if (cfg.get("in_channels"), cfg.get("out_channels"), cfg.get("image_dim"), cfg.get("vace_in_channels"),
                    ti2v) != (Z_DIM, Z_DIM, None, VACE_IN_CHANNELS, False):
                raise UnsupportedModel(f"{d}: {sub} is a VACE transformer with in/out_channels {cfg.get('in_channels')}"
                                       f"/{cfg.get('out_channels')}, image_dim {cfg.get('image_dim')}, "
                                       f"vace_in_channels {cfg.get('vace_in_channels')}; Wan's VACE models take "
                                       f"16/16, none, {VACE_IN_CHANNELS}")
            configs.append((Z_DIM, False, "vace"))
            continue
        if cls in V3_CLASSES:
            if (cfg.get("in_channels"), cfg.get("out_channels"), cfg.get("image_dim")) != (Z_DIM, Z_DIM, None) or ti2v:
                raise UnsupportedModel(f"{d}: {sub} is SkyReels-V3's {cls} with in/out_channels "
                                       f"{cfg.get('in_channels')}/{cfg.get('out_channels')}, image_dim "
                                       f"{cfg.get('image_dim')}; its R2V model takes 16/16 and no image branch")
            configs.append((Z_DIM, False, "v3"))
            continue
        if cls not in WAN_TRANSFORMER_CLASSES:
            raise UnsupportedModel(f"{d}: {sub} is a {cls}, not a Wan transformer "
                                   f"({' / '.join(WAN_TRANSFORMER_CLASSES)})")
        cin, cout, image_dim = cfg.get("in_channels"), cfg.get("out_channels"), cfg.get("image_dim")
        if ti2v:  # the 5B's input is the latents alone: the first frame conditions by replacing latent frame 0
            if (cin, cout, image_dim) != (TI2V_Z_DIM, TI2V_Z_DIM, None) or len(experts) > 1:
                raise UnsupportedModel(f"{d}: expand_timesteps (TI2V-5B) needs one transformer with in/out_channels "
                                       f"48 and no image branch; {sub} has in {cin}, out {cout}, image_dim {image_dim}")
            configs.append((cin, False, None))
            patch = tuple(cfg.get("patch_size") or (1, 2, 2))
            continue
        if cin not in (Z_DIM, E2V_IN_CHANNELS) or cout != Z_DIM:
            raise UnsupportedModel(f"{d}: {sub} has in_channels {cin}, out_channels {cout}; supported: in 16 (T2V) "
                                   f"or 36 (I2V/E2V), out 16")
        if image_dim is not None and cin != E2V_IN_CHANNELS:
            raise UnsupportedModel(f"{d}: {sub} has an image branch but {cin} input channels (I2V needs 36)")
        configs.append((cin, image_dim is not None, None))
    if len(set(configs)) > 1:
        raise UnsupportedModel(f"{d}: transformer and transformer_2 take different inputs "
                               f"(in_channels, image branch, native layout) {configs[0]} vs {configs[1]}")
    in_channels, image_branch, native = configs[0]

    enc = Path(image_encoder) if image_encoder else d
    if not ((enc / "image_encoder" / "config.json").exists() and (enc / "image_processor").is_dir()):
        if image_encoder:
            raise UnsupportedModel(f"{enc}: --image-encoder needs image_encoder/ (CLIPVisionModel) and "
                                   "image_processor/ subfolders")
        enc = None
    if image_branch and enc is None:
        raise UnsupportedModel(f"{d}: the transformer has a CLIP image branch (image_dim) but there is no "
                               "image_encoder/ + image_processor/; pass --image-encoder DIR")
    enc_dim = _read_json(enc / "image_encoder" / "config.json", enc).get("hidden_size") if enc else None

    two = len(experts) == 2
    if native:  # a released model's own layout, told by its transformer class
        name = {"vace": "Wan2.2 VACE-Fun A14B" if two else "Wan2.1 VACE", "v3": "SkyReels-V3 R2V"}[native]
        return ModelInfo(d, name, in_channels, False, enc, enc_dim, float(ratio) if two else None, native_kind=native)
    if ti2v:
        return ModelInfo(d, "Wan2.2 TI2V 5B", in_channels, False, enc, enc_dim, None, z_dim, vae_scale, patch, True)
    if two:
        name = "Wan2.2 I2V A14B" if in_channels == E2V_IN_CHANNELS else "Wan2.2 T2V A14B"
        if image_branch:
            raise UnsupportedModel(f"{d}: a two-expert model with a CLIP image branch is not a known Wan 2.2 model")
    elif in_channels == Z_DIM:
        name = "Wan2.1 T2V"
    elif not image_branch:
        raise UnsupportedModel(f"{d}: 36 input channels without an image branch and one transformer: not a known "
                               "Wan model (Wan 2.2 I2V A14B has transformer_2 and boundary_ratio)")
    else:  # A2 ships the same architecture as Wan2.1 I2V; its own classes name it
        a2 = index.get("_class_name") == "A2Pipeline" or _read_json(d / "transformer" / "config.json", d).get(
            "_class_name") == "A2Model"
        name = "SkyReels-A2" if a2 else "Wan2.1 I2V"
    return ModelInfo(d, name, in_channels, image_branch, enc, enc_dim, float(ratio) if two else None)


def expert_for_timestep(t, boundary_ratio: float | None, num_train_timesteps: int = 1000) -> str | None:
    """Which Wan 2.2 expert denoises at timestep t, as diffusers' Wan pipelines decide: high when
    t >= boundary_ratio * num_train_timesteps, else low (None for a one-transformer model)."""
    if boundary_ratio is None:
        return None
    return "high" if t >= boundary_ratio * num_train_timesteps else "low"


def expert_sigma_range(expert: str | None, boundary_ratio: float | None) -> tuple[float, float]:
    """[lo, hi) of the sigmas an expert is trained on (timestep = 1000·sigma); high includes sigma = 1."""
    if expert is None:
        return 0.0, 1.0
    return (boundary_ratio, 1.0) if expert == "high" else (0.0, boundary_ratio)


# marker file of a transformer dir that holds a config and no weights (a2/model/tiny.py)
RANDOM_WEIGHTS = "RANDOM_WEIGHTS"


def load_transformer(model_dir: str | Path, dtype: torch.dtype = torch.float32, subfolder: str = "transformer"):
    """WanTransformer3DModel (WanVACETransformer3DModel for VACE: transformer_class) from a diffusers-format model dir
    (`<dir>/transformer`), a transformer dir, or an original-Wan checkpoint (a Phantom-Wan file or dir, a Wan 2.2
    original expert pair's `subfolder` expert: converted by original_to_diffusers).
    A `random-*` model dir (a2/model/tiny.py) has a config and no weights: random ones are built, on the GPU when there
    is one (a 14B model in bf16 is 28 GB: built where it runs, not on the host)."""
    model_dir = Path(model_dir)
    if (model_dir / ORIGINAL_EXPERTS.get(subfolder, subfolder)).is_dir() and not (model_dir / subfolder).is_dir():
        model_dir = model_dir / ORIGINAL_EXPERTS[subfolder]  # Wan2.2-VACE-Fun: the expert's original-key dir
    if (model_dir / subfolder / "config.json").exists():
        config = WanTransformer3DModel.load_config(model_dir / subfolder)
        # a dry run (a2/train/trace.py): the architecture at real size on fake tensors, no weights
        if fake_mode_active():
            return random_transformer(config, dtype, "cpu")
        if (model_dir / subfolder / RANDOM_WEIGHTS).exists():
            return random_transformer(config, dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return transformer_class(config).from_pretrained(model_dir, subfolder=subfolder, torch_dtype=dtype)
    if (sat := kaleido.checkpoint(model_dir)) is not None:  # Kaleido's SAT checkpoint
        with unset_fake_temporarily():
            sd = kaleido.read(sat)
            config = kaleido_config(sat, sd)
        if fake_mode_active():
            return random_transformer(config, dtype, "cpu")
        return load_original([sat], config, dtype, original_to_diffusers(sd))
    checkpoints = dit_checkpoints(model_dir)
    if len(checkpoints) == 1:  # Phantom-Wan, MAGREF: an original-Wan checkpoint (detect_phantom checked it)
        d = model_dir.parent if model_dir.is_file() else model_dir
        if fake_mode_active():  # a dry run: the architecture its files say, on fake tensors, no weights read
            with unset_fake_temporarily():
                config = original_config(checkpoints[0], d / "config.json")
            return random_transformer(config, dtype, "cpu")
        return load_original(checkpoints[0], original_config(checkpoints[0], d / "config.json"), dtype)
    if (model_dir / "config.json").exists():
        return transformer_class(WanTransformer3DModel.load_config(model_dir)).from_pretrained(model_dir,
                                                                                              torch_dtype=dtype)
    raise FileNotFoundError(f"{model_dir}: no {subfolder}/config.json or config.json (not a diffusers model dir)")


@torch.no_grad()
def random_transformer(config: dict, dtype: torch.dtype, device, seed: int = 0) -> WanTransformer3DModel:
    """A transformer of `config` with random weights, allocated on `device` in `dtype` (no fp32 copy first) and
    filled in place: matrices N(0, 0.02), norm scales 1, the rest 0 (fast on any size; real-size runs measure
    speed and memory, not quality). As from_pretrained(torch_dtype=bf16) loads real weights, the modules diffusers
    keeps in fp32 (norms, time embedding, scale-shift tables) are fp32."""
    if fake_mode_active():  # a dry run (a2/train/trace.py): fake tensors take no memory and no time to fill
        with torch.device(device):
            model = transformer_class(config).from_config(config)
    else:
        with torch.device("meta"):
            model = transformer_class(config).from_config(config)
        model.to_empty(device=device)
    keep = set(model._keep_in_fp32_modules)
    g = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if keep & set(name.split(".")) else dtype)
        if p.dim() >= 2:
            p.normal_(0.0, 0.02, generator=g)
        else:
            p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
    model.rope = type(model.rope)(config["attention_head_dim"], config["patch_size"], config["rope_max_seq_len"])
    return model.to(device).eval()


# the weights expand_to_e2v creates (the widened patch embedding, the image branch): a LoRA on an expanded T2V base
# trains them in full and ships them beside the adapter (a2/train/lora.py)
EXPANSION_WEIGHTS = ("patch_embedding.weight", "condition_embedder.image_embedder", "attn2.add_k_proj",
                     "attn2.add_v_proj", "attn2.norm_added_k")


def is_expansion_weight(name: str) -> bool:
    return any(name == w or name.startswith(w + ".") or f".{w}." in f".{name}" for w in EXPANSION_WEIGHTS)


@torch.no_grad()
def expand_to_e2v(base: WanTransformer3DModel, image_dim: int | None = 1280, seed: int = 0) -> WanTransformer3DModel:
    """A T2V transformer -> the E2V architecture with the same output at init.

    The patch embedding is widened from 16 to 36 input channels with the new (mask, condition)
    channels zero, so they contribute nothing. The image branch (image embedder, add_k_proj,
    add_v_proj, norm_added_k) is added with add_v_proj zero: the image attention then returns 0
    and is added to the text attention, so the block output is unchanged, while add_k_proj and the
    embedder are random so that gradients reach them as soon as add_v_proj moves. image_dim=None:
    no image branch (E2V through the VAE path only)."""
    if is_e2v(base) or base.config.image_dim is not None:
        raise ValueError("expand_to_e2v expects a T2V transformer (in_channels 16, no image branch)")
    cfg = {k: v for k, v in base.config.items() if not k.startswith("_")}
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    cfg.update(in_channels=E2V_IN_CHANNELS, image_dim=image_dim, added_kv_proj_dim=inner if image_dim else None)
    torch.manual_seed(seed)
    e2v = WanTransformer3DModel(**cfg).to(base.dtype)
    missing, unexpected = e2v.load_state_dict(
        {k: v for k, v in base.state_dict().items() if k != "patch_embedding.weight"}, strict=False
    )
    assert not unexpected, unexpected
    assert all(is_expansion_weight(k) for k in missing), missing
    w = base.patch_embedding.weight  # (inner, 16, 1, 2, 2)
    e2v.patch_embedding.weight.zero_()
    e2v.patch_embedding.weight[:, : w.shape[1]] = w
    for block in e2v.blocks if image_dim else ():
        block.attn2.add_v_proj.weight.zero_()
        block.attn2.add_v_proj.bias.zero_()
    return e2v


def _is_self_attention(func, args) -> bool:
    """An attention-core op (PyTorch SDPA, any backend, or the flash-attn package) whose keys are as many as its
    queries: self-attention. Cross-attention (512 text / 257-per-reference image keys) is cheap to recompute."""
    name = str(func)
    return (("scaled_dot_product" in name or "flash_attn" in name) and "backward" not in name
            and len(args) > 1 and args[0].numel() == args[1].numel())


def _save_self_attention(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if _is_self_attention(func, args) else CheckpointPolicy.PREFER_RECOMPUTE


def configure_blocks(model: WanTransformer3DModel, checkpoint_fraction: float = 0.0, save_attention: bool = False,
                     compile: bool = False) -> None:
    """How the transformer blocks run in training: recomputation (gradient checkpointing) and compilation.

    checkpoint_fraction: the first round(fraction·n) blocks store only their inputs and recompute the forward in
      backward (one extra forward of each); 1.0 recomputes every block, 0 none.
    save_attention: in those blocks, keep the self-attention outputs (and log-sum-exp) instead of recomputing them
      (selective checkpointing): the attention core is about half the forward FLOPs at 81x480x832, the
      projections around it are cheap to redo. Memory: tokens x dim bf16 per block (A2-14B: 0.34 GB, 1.3B: 0.1 GB).
    compile: torch.compile each block's forward (one graph shared by all blocks).

    The checkpoint goes *inside* each block's forward (block.forward = checkpoint(original forward)), not around
    the block call as diffusers' enable_gradient_checkpointing puts it. Then whatever wraps the block call, FSDP2's
    hooks (all-gather, mixed-precision input casts, reshard) or nothing, runs once, outside the checkpoint: the
    recomputation sees exactly the inputs the forward saw. (Around the call, the recompute re-enters FSDP2's
    pre-forward hook, which skips its input cast in backward: bf16 in the forward, fp32 in the recompute, and
    torch.utils.checkpoint fails its metadata check.) A compiled block is compiled together with its checkpoint,
    so the selective policy applies inside the graph and backward replays the compiled recomputation."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    # no context_fn at all for plain recomputation: dynamo cannot trace checkpoint's default one
    policy = {}
    if save_attention:
        policy["context_fn"] = partial(create_selective_checkpoint_contexts, _save_self_attention)
        if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:  # torch 2.11 lacks it
            # the kept attention goes to host memory too (a2/memory/offload.py)
            policy["respect_saved_tensors_hooks"] = True
    # VACE's context blocks (vace_blocks, a WanVACETransformer3DModel's) are blocks of the same size: the same share
    # of them recompute
    vace = list(getattr(model, "vace_blocks", ()))
    for i, block in [*enumerate(model.blocks), *enumerate(vace)]:
        forward = type(block).forward.__get__(block)  # the class's forward, also when configured before
        block.recomputed = i < round(checkpoint_fraction * len(vace if block in vace else model.blocks))
        if block.recomputed:  # (offload_activations moves what these keep to host memory)
            forward = partial(checkpoint, forward, use_reentrant=False, **policy)
        block.forward = torch.compile(forward, fullgraph=True) if compile else forward


def allow_recompiles(shapes: int) -> None:
    """Let compiled blocks recompile for each of a run's `shapes` input shapes (buckets), with and without grad
    (validation, eval loss), before torch._dynamo's recompile limit (8), past which it runs the block eager,
    silently, in a memory plan made for compiled blocks. A limit rather than dynamic shapes: the static graphs are
    what was measured (speed and memory, README), and automatic dynamic shapes already fold some shape changes.

    The limit counts every entry a code object holds in this process, also those of earlier runs' models that are
    gone (invalidated, still counted), and all compiled blocks share code objects (torch.compile's wrapper of a
    recomputed block, the block class's forward): a second run in one process (a test session, a notebook) would
    start with the first's entries and fail past the limit (fullgraph=True makes that an error). So the compiled
    code of this process is dropped first: the run compiles its blocks from an empty cache."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * shapes + 8)


def wan_module_name(name: str) -> str:
    """diffusers WanTransformer3DModel module name -> the original Wan one (KeyError when Wan has no such module)."""
    m = re.fullmatch(r"((?:vace_)?blocks\.\d+\.)(.+)", name)  # a transformer block or a VACE context block
    prefix, rest, table = (m[1], m[2], WAN_BLOCK) if m else ("", name, WAN_TOP)
    for src, dst in table.items():
        if rest == src or rest.startswith(src + "."):
            return prefix + dst + rest[len(src):]
    raise KeyError(name)


def save_wan_checkpoint(state_dict: dict[str, torch.Tensor], path: Path) -> Path:
    """A transformer as one bf16 safetensors file in original Wan names (diffusers_to_original): what ComfyUI's
    UNETLoader (models/diffusion_models/) detects as Wan by `head.modulation` and sizes from `patch_embedding`,
    `blocks.*` and `img_emb` (I2V), and what Wan's own WanModel.load_state_dict takes."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in diffusers_to_original(state_dict).items()}
    save_file(sd, path, metadata={"format": "pt", "a2_format": "wan", "a2_loader": "ComfyUI Load Diffusion Model "
                                  "(UNETLoader) / Wan's WanModel; diffusers: the transformer dir beside it"})
    return Path(path)
