"""The A2 transformer: diffusers' WanTransformer3DModel, unchanged.

SkyReels-A2 checkpoints load into it as they are (their extra `norm_added_q` is ignored by
diffusers' `_keys_to_ignore_on_load_unexpected`). This file holds the size presets, loading from a
diffusers-format model dir, and the expansion of a T2V model (16 input channels, no image branch)
to the E2V inputs (36 channels, CLIP image tokens) that leaves its output unchanged at init.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

Z_DIM = 16  # Wan 2.1 VAE latent channels
MASK_CHANNELS = 4  # one mask value per pixel frame of a latent frame (temporal factor 4)
E2V_IN_CHANNELS = Z_DIM + MASK_CHANNELS + Z_DIM  # noisy latents | mask | condition latents
TEXT_TOKENS = 512  # diffusers' Wan attention splits image from text as shape[1] - 512
CLIP_TOKENS = 257  # ViT-H/14 at 224: 16*16 patches + CLS

# Plain WanTransformer3DModel configs. `1.3B` is Wan2.1-T2V-1.3B's shape, `14B` is Wan2.1-I2V-14B's
# (= SkyReels-A2's). `tiny` matches the offline tiny components of a2/tiny.py (T5 d_model 32, CLIP 32).
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
}


def preset_config(name: str, e2v: bool | None = None) -> dict:
    """A preset's config; e2v=True/False forces the E2V (36 ch + image branch) or T2V (16 ch) inputs."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = dict(PRESETS[name])
    if e2v is True and cfg["image_dim"] is None:
        inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        cfg.update(in_channels=E2V_IN_CHANNELS, image_dim=1280, added_kv_proj_dim=inner)
    elif e2v is False:
        cfg.update(in_channels=Z_DIM, image_dim=None, added_kv_proj_dim=None)
    return cfg


def is_e2v(transformer: WanTransformer3DModel) -> bool:
    """True when the model takes the 36-channel E2V/I2V input."""
    return transformer.config.in_channels == E2V_IN_CHANNELS


def has_image_branch(transformer: WanTransformer3DModel) -> bool:
    return transformer.config.image_dim is not None


def load_transformer(model_dir: str | Path, dtype: torch.dtype = torch.float32, subfolder: str = "transformer"):
    """WanTransformer3DModel from a diffusers-format model dir (`<dir>/transformer`) or a transformer dir."""
    model_dir = Path(model_dir)
    if (model_dir / subfolder / "config.json").exists():
        return WanTransformer3DModel.from_pretrained(model_dir, subfolder=subfolder, torch_dtype=dtype)
    if (model_dir / "config.json").exists():
        return WanTransformer3DModel.from_pretrained(model_dir, torch_dtype=dtype)
    raise FileNotFoundError(f"{model_dir}: no {subfolder}/config.json or config.json (not a diffusers model dir)")


@torch.no_grad()
def expand_to_e2v(base: WanTransformer3DModel, image_dim: int = 1280, seed: int = 0) -> WanTransformer3DModel:
    """A T2V transformer -> the E2V architecture with the same output at init.

    The patch embedding is widened from 16 to 36 input channels with the new (mask, condition)
    channels zero, so they contribute nothing. The image branch (image embedder, add_k_proj,
    add_v_proj, norm_added_k) is added with add_v_proj zero: the image attention then returns 0
    and is added to the text attention, so the block output is unchanged, while add_k_proj and the
    embedder are random so that gradients reach them as soon as add_v_proj moves."""
    if is_e2v(base) or has_image_branch(base):
        raise ValueError("expand_to_e2v expects a T2V transformer (in_channels 16, no image branch)")
    cfg = dict(base.config)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    cfg.update(in_channels=E2V_IN_CHANNELS, image_dim=image_dim, added_kv_proj_dim=inner)
    torch.manual_seed(seed)
    e2v = WanTransformer3DModel(**cfg).to(base.dtype)
    missing, unexpected = e2v.load_state_dict(
        {k: v for k, v in base.state_dict().items() if k != "patch_embedding.weight"}, strict=False
    )
    assert not unexpected, unexpected
    new_keys = ("patch_embedding.weight", "condition_embedder.image_embedder", "add_k_proj", "add_v_proj",
                "norm_added_k")
    assert all(any(s in k for s in new_keys) for k in missing), missing
    w = base.patch_embedding.weight  # (inner, 16, 1, 2, 2)
    e2v.patch_embedding.weight.zero_()
    e2v.patch_embedding.weight[:, : w.shape[1]] = w
    for block in e2v.blocks:
        block.attn2.add_v_proj.weight.zero_()
        block.attn2.add_v_proj.bias.zero_()
    return e2v


def enable_checkpointing(model: WanTransformer3DModel, fraction: float = 1.0) -> None:
    """Recompute the first round(fraction·n) transformer blocks in backward instead of storing their activations.

    1.0 is diffusers' gradient checkpointing; a lower fraction keeps the other blocks' activations and saves
    their recomputation (each recomputed block costs one extra forward of it), when memory allows."""
    chosen = {id(b) for b in list(model.blocks)[: round(fraction * len(model.blocks))]}

    def checkpoint_func(block, *args):
        if id(block) in chosen:
            return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    model.enable_gradient_checkpointing(checkpoint_func)
