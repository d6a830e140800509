"""The A2 transformer: diffusers' WanTransformer3DModel, unchanged.

SkyReels-A2 checkpoints load into it as they are (their extra `norm_added_q` is ignored by
diffusers' `_keys_to_ignore_on_load_unexpected`). This file holds the size presets, loading from a
diffusers-format model dir, and the expansion of a T2V model (16 input channels, no image branch)
to the E2V inputs (36 channels, CLIP image tokens) that leaves its output unchanged at init.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from a2.trace import fake_mode_active

Z_DIM = 16  # Wan 2.1 VAE latent channels
TI2V_Z_DIM = 48  # Wan 2.2 VAE (TI2V-5B) latent channels: 16x spatial compression (patch 2 x 8)
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
    # Wan2.2-TI2V-5B: the latents alone in and out (48 channels of the Wan 2.2 VAE), no image branch
    "5B": dict(
        patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=TI2V_Z_DIM,
        out_channels=TI2V_Z_DIM, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
    ),
}


def preset_config(name: str, e2v: bool | None = None) -> dict:
    """A preset's config; e2v=True/False forces the E2V (36 ch + image branch) or T2V (16 ch) inputs.
    `tiny-ti2v` is `tiny` shaped as TI2V-5B (48 channels in and out, no image branch)."""
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


def is_e2v(transformer: WanTransformer3DModel) -> bool:
    """True when the model takes the 36-channel E2V/I2V input."""
    return transformer.config.in_channels == E2V_IN_CHANNELS


def has_image_branch(transformer: WanTransformer3DModel) -> bool:
    return transformer.config.image_dim is not None


# ---------------------------------------------------------------- model dirs: what is in them


class UnsupportedModel(ValueError):
    """A model dir this project cannot train or sample from; the message names the dir and the reason."""


# transformer classes whose weights load into WanTransformer3DModel unchanged (A2's own class subclasses it)
WAN_TRANSFORMER_CLASSES = ("WanTransformer3DModel", "A2Model")
EXPERTS = {"high": "transformer", "low": "transformer_2"}  # Wan 2.2 A14B: subfolder of each noise-level expert


@dataclass(frozen=True)
class ModelInfo:
    """What detect_model read from a model dir's configs."""

    path: Path
    name: str  # SkyReels-A2 | Wan2.1 I2V | Wan2.1 T2V | Wan2.2 T2V A14B | Wan2.2 I2V A14B
    in_channels: int  # 16 (T2V) or 36 (I2V/E2V: noisy | mask | condition)
    image_branch: bool  # the transformer takes CLIP image tokens (image_dim is set)
    image_encoder_dir: Path | None  # a dir with image_encoder/ + image_processor/ (the model's or --image-encoder)
    image_encoder_dim: int | None  # that CLIP's hidden size (ViT-H/14: 1280), the image_dim of an expansion
    boundary_ratio: float | None  # Wan 2.2 A14B: `transformer` (high) for timesteps >= ratio*1000, else `transformer_2`
    # ---- issue 14: Wan 2.2 TI2V-5B (48-channel VAE, 16x spatial, per-token timesteps)
    z_dim: int = Z_DIM  # latent channels of the VAE
    vae_scale: int = 8  # spatial compression of the VAE (Wan 2.2's: patch 2 x 8 = 16)
    patch_size: tuple[int, int, int] = (1, 2, 2)  # the transformer's (t, h, w) patch
    expand_timesteps: bool = False  # TI2V-5B: one timestep per token (0 on conditioning frames), model_index's flag

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


def detect_model(model_dir, image_encoder=None) -> ModelInfo:
    """Read a diffusers-format model dir's configs and say which supported model it is, or raise UnsupportedModel.

    Supported: Wan 2.2 TI2V-5B (model_index `expand_timesteps`, a 48-channel Wan 2.2 VAE with 16x spatial
    compression, 48 channels in and out), SkyReels-A2 and Wan2.1 I2V 14B 480P/720P (36 input channels, CLIP
    image branch), Wan2.1 T2V 1.3B/14B (16 channels), Wan 2.2 A14B T2V/I2V (two experts `transformer` /
    `transformer_2` switched at `boundary_ratio`; the I2V pair has 36 channels but no image branch).
    `image_encoder` is a dir with image_encoder/ + image_processor/ that overrides the model's own (for a T2V
    model expanded to E2V).
    The built-in tiny models' names are resolved to their dirs by a2.tiny.model_path, before this."""
    d = Path(model_dir)
    if not d.is_dir():
        raise UnsupportedModel(f"{d}: not a directory (expected a diffusers-format Wan model dir, or the name of a "
                               "built-in tiny model: tiny, tiny-t2v, tiny-wan22-t2v, tiny-wan22-i2v, tiny-ti2v)")
    if not (d / "model_index.json").exists():
        raise UnsupportedModel(f"{d}: no model_index.json; expected a diffusers-format model dir (SkyReels-A2, "
                               "Wan2.1 I2V/T2V, Wan 2.2 A14B T2V/I2V); original Wan checkpoints need converting")
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
        if cls not in WAN_TRANSFORMER_CLASSES:
            raise UnsupportedModel(f"{d}: {sub} is a {cls}, not a Wan transformer "
                                   f"({' / '.join(WAN_TRANSFORMER_CLASSES)})")
        cin, cout, image_dim = cfg.get("in_channels"), cfg.get("out_channels"), cfg.get("image_dim")
        if ti2v:  # the 5B's input is the latents alone: the first frame conditions by replacing latent frame 0
            if (cin, cout, image_dim) != (TI2V_Z_DIM, TI2V_Z_DIM, None) or len(experts) > 1:
                raise UnsupportedModel(f"{d}: expand_timesteps (TI2V-5B) needs one transformer with in/out_channels "
                                       f"48 and no image branch; {sub} has in {cin}, out {cout}, image_dim {image_dim}")
            configs.append((cin, False))
            patch = tuple(cfg.get("patch_size") or (1, 2, 2))
            continue
        if cin not in (Z_DIM, E2V_IN_CHANNELS) or cout != Z_DIM:
            raise UnsupportedModel(f"{d}: {sub} has in_channels {cin}, out_channels {cout}; supported: in 16 (T2V) "
                                   f"or 36 (I2V/E2V), out 16")
        if image_dim is not None and cin != E2V_IN_CHANNELS:
            raise UnsupportedModel(f"{d}: {sub} has an image branch but {cin} input channels (I2V needs 36)")
        configs.append((cin, image_dim is not None))
    if len(set(configs)) > 1:
        raise UnsupportedModel(f"{d}: transformer and transformer_2 take different inputs "
                               f"(in_channels, image branch) {configs[0]} vs {configs[1]}")
    in_channels, image_branch = configs[0]

    if image_encoder:
        from a2.tiny import model_path  # a Hub id, like --model

        image_encoder = model_path(image_encoder)
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


RANDOM_WEIGHTS = "RANDOM_WEIGHTS"  # marker file of a transformer dir that holds a config and no weights (a2/tiny.py)


def load_transformer(model_dir: str | Path, dtype: torch.dtype = torch.float32, subfolder: str = "transformer"):
    """WanTransformer3DModel from a diffusers-format model dir (`<dir>/transformer`) or a transformer dir.
    A `random-*` model dir (a2/tiny.py) has a config and no weights: random ones are built, on the GPU when there
    is one (a 14B model in bf16 is 28 GB: built where it runs, not on the host)."""
    model_dir = Path(model_dir)
    if fake_mode_active():  # a dry run (a2/trace.py): the architecture at real size on fake tensors, no weights read
        config_dir = model_dir / subfolder if (model_dir / subfolder / "config.json").exists() else model_dir
        return random_transformer(WanTransformer3DModel.load_config(config_dir), dtype, "cpu")
    if (model_dir / subfolder / RANDOM_WEIGHTS).exists():
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return random_transformer(WanTransformer3DModel.load_config(model_dir / subfolder), dtype, device)
    if (model_dir / subfolder / "config.json").exists():
        return WanTransformer3DModel.from_pretrained(model_dir, subfolder=subfolder, torch_dtype=dtype)
    if (model_dir / "config.json").exists():
        return WanTransformer3DModel.from_pretrained(model_dir, torch_dtype=dtype)
    raise FileNotFoundError(f"{model_dir}: no {subfolder}/config.json or config.json (not a diffusers model dir)")


@torch.no_grad()
def random_transformer(config: dict, dtype: torch.dtype, device, seed: int = 0) -> WanTransformer3DModel:
    """A transformer of `config` with random weights, allocated on `device` in `dtype` (no fp32 copy first) and
    filled in place: matrices N(0, 0.02), norm scales 1, the rest 0 (fast on any size; real-size runs measure
    speed and memory, not quality). As from_pretrained(torch_dtype=bf16) loads real weights, the modules diffusers
    keeps in fp32 (norms, time embedding, scale-shift tables) are fp32."""
    if fake_mode_active():  # a dry run (a2/trace.py): fake tensors take no memory and no time to fill
        with torch.device(device):
            model = WanTransformer3DModel.from_config(config)
    else:
        with torch.device("meta"):
            model = WanTransformer3DModel.from_config(config)
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
# trains them in full and ships them beside the adapter (a2/lora.py)
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
    if is_e2v(base) or has_image_branch(base):
        raise ValueError("expand_to_e2v expects a T2V transformer (in_channels 16, no image branch)")
    cfg = dict(base.config)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
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
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    n = round(checkpoint_fraction * len(model.blocks))
    # no context_fn at all for plain recomputation: dynamo cannot trace checkpoint's default one
    policy = {}
    if save_attention:
        policy["context_fn"] = partial(create_selective_checkpoint_contexts, _save_self_attention)
        policy["respect_saved_tensors_hooks"] = True  # the kept attention goes to host memory too (a2/offload.py)
    for i, block in enumerate(model.blocks):
        forward = type(block).forward.__get__(block)  # the class's forward, also when configured before
        block.recomputed = i < n  # (offload_activations moves what these keep to host memory)
        if i < n:
            forward = partial(checkpoint, forward, use_reentrant=False, **policy)
        block.forward = torch.compile(forward, fullgraph=True) if compile else forward


def resolve_e2v_type(info: ModelInfo, e2v_type: str, conditioned: bool) -> str:
    """The reference paths of a run (TrainConfig.e2v_type, `auto` resolved), or a clear error when the model cannot
    take them. conditioned: the run has elements or frame conditioning (not plain T2V)."""
    where = f"{info.path} ({info.name})"
    if not conditioned:
        if info.e2v:
            raise UnsupportedModel(f"{where} takes 36 input channels (noisy | mask | condition); T2V-only training "
                                   "(no elements, no frame conditioning) needs a T2V model")
        return "none"
    if info.ti2v:  # issue 14: its first frame replaces latent frame 0; element references go in context
        if e2v_type in ("dual", "clip"):
            raise UnsupportedModel(f"{where} has no CLIP image branch and no channel conditioning: --e2v-type vae "
                                   f"or auto, not {e2v_type}")
        return "vae"
    if info.e2v and not info.image_branch:  # Wan 2.2 I2V A14B
        if e2v_type in ("dual", "clip"):
            raise UnsupportedModel(f"{where} has no CLIP image branch: E2V there uses the VAE path only "
                                   f"(--e2v-type vae or auto), not {e2v_type}")
        return "vae"
    if not info.e2v:  # a T2V base is expanded to the E2V inputs
        if info.two_experts:
            raise UnsupportedModel(f"{where}: E2V would expand the trained expert to 36 input channels while the other "
                                   "keeps 16, and the pair could not be sampled; train T2V here (a dataset config "
                                   "without elements), or E2V on Wan 2.2 I2V A14B")
        if e2v_type != "vae" and info.image_encoder_dir is None:
            raise UnsupportedModel(f"{where} is a T2V model: E2V training expands it and needs a CLIP image encoder "
                                   "(--image-encoder DIR) or --e2v-type vae")
    return "dual" if e2v_type == "auto" else e2v_type
