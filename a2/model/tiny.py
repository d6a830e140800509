"""A complete, tiny, random Wan I2V / A2 model dir, built offline and deterministically.

Same classes as the real model (WanTransformer3DModel, AutoencoderKLWan, UMT5EncoderModel, a fast
tokenizer, CLIPVisionModel giving 257 tokens like ViT-H/14, CLIPImageProcessor, UniPC), saved in
diffusers format, so every test and the demo go through the real loading code. Also shaped like
Wan2.1 T2V (--t2v), the Wan 2.2 A14B expert pairs (--wan22: T2V, or I2V with 36 input channels
and no image branch) and Wan 2.2 TI2V-5B (--ti2v: the 48-channel Wan 2.2 VAE, patch 2 and residual blocks,
16x spatial; a transformer with 48 channels in and out; `expand_timesteps`) and Wan's VACE (--vace: a
WanVACETransformer3DModel, the T2V model with VACE's context blocks; with --wan22 the Wan2.2-VACE-Fun-A14B pair).

`random-1.3B` / `random-14B` are real-size model dirs without weights, for measuring the real training loop
at real shapes with no download: the transformer dir holds Wan2.1-T2V-1.3B's / A2-14B's config and a
RANDOM_WEIGHTS marker (load_transformer builds random weights on the GPU), and the encoders are tiny ones
with the real output widths (T5 4096, CLIP 1280, 16 latent channels), so their outputs have the real shapes.

    python -m a2.model.tiny OUT_DIR [--t2v] [--wan22] [--ti2v] [--vace]
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import sys
from pathlib import Path

if __name__ == "__main__" and (len(sys.argv) < 2 or sys.argv[1].startswith("-")
                               or not set(sys.argv[2:]) <= {"--t2v", "--wan22", "--ti2v", "--vace"}):
    print(__doc__)  # --help, or arguments it does not take: before torch loads (never a dir named "--help")
    sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)

import torch

from a2.model.transformer import (
    RANDOM_WEIGHTS,
    VACE_FUN_BOUNDARY,
    UnsupportedModel,
    diffusers_to_original,
    local_or_hub,
    not_a_model,
    original_wan_config,
    preset_config,
    transformer_class,
)

TINY_CORPUS = """a hiker standing at the top of a mountain triumphantly high quality
a man is holding a teddy bear in the forest. a woman walks a dog on the beach at sunset.
a red square and a blue circle move across a green field. bright tones overexposed static blurred
details subtitles style works paintings images overall gray worst quality low quality jpeg
compression residue ugly incomplete extra fingers poorly drawn hands faces deformed disfigured
misshapen limbs fused still picture messy background three legs many people walking backwards
the video shows a cat sitting on a sofa while the camera slowly pans to the left in this video"""


def tiny_tokenizer():
    """Byte-level BPE trained on a fixed corpus: covers any text, pad=0, eos appended like UMT5's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TINY_CORPUS], trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512)


# Wan 2.2 A14B's switch points: the high-noise expert takes timesteps >= ratio*1000
WAN22_BOUNDARY = {True: 0.875, False: 0.9}  # t2v: T2V-A14B, else I2V-A14B

# what the built-in models' cache dirs are named after: a dir built by an older a2 (other weights, e.g. the random
# VAE before invertible_init) is not reused
TINY_BUILD = 3

# `--model` names of the built-in tiny models -> their save_tiny arguments
TINY_MODELS = {"tiny": {}, "tiny-t2v": dict(t2v=True), "tiny-wan22-t2v": dict(t2v=True, wan22=True),
               "tiny-wan22-i2v": dict(wan22=True), "random-1.3B": dict(t2v=True, preset="1.3B"),
               "random-14B": dict(preset="14B"), "tiny-ti2v": dict(ti2v=True),
               "random-5B": dict(preset="5B", ti2v=True), "tiny-phantom": dict(t2v=True, released="phantom"),
               "tiny-v3": dict(t2v=True, released="v3"), "tiny-magref": dict(released="magref"),
               "tiny-refalign": dict(t2v=True, released="refalign"), "tiny-vace": dict(t2v=True, vace=True),
               "tiny-vace-fun": dict(t2v=True, wan22=True, vace=True),
               "tiny-kaleido": dict(t2v=True, released="kaleido")}
VACE_FLOW_SHIFT = 3.0  # the scheduler_config.json of Wan-AI's Wan2.1-VACE-*-diffusers (Wan's own CLI samples at 16)

# Wan 2.2 TI2V-5B. Its VAE (Wan2.2-TI2V-5B-Diffusers: base_dim 160, decoder_base_dim 256,
# dim_mult 1,2,4,4, 2 res blocks) at width 8: the same patching (12 = 3x2x2 channels in and out), residual
# blocks and down/upsampling, so the same 16x spatial / 4x temporal compression and 48 latent channels.
TINY_TI2V_VAE = dict(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                     out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)
TI2V_FLOW_SHIFT = 5.0  # Wan2.2-TI2V-5B-Diffusers' scheduler


def tiny_ti2v_vae():
    """The tiny Wan 2.2 VAE; its latents' normalisation is fixed non-trivial values (mean != 0, std != 1), so a
    mistake in applying it shows."""
    from diffusers import AutoencoderKLWan

    c = torch.arange(48, dtype=torch.float64)
    return AutoencoderKLWan(**TINY_TI2V_VAE, latents_mean=(0.1 * torch.sin(c)).tolist(),
                            latents_std=(0.5 + 0.01 * c).tolist()).eval()


# invertible_init's constants: the colour channels carry an offset and a constant channel dominates each pixel's
# channel norm, so that the only non-linear parts left (the heads' RMS norm and SiLU) act as a fixed scale
_COLOUR_OFFSET, _CONSTANT, _HEAD_GAMMA = 10.0, 1000.0, 300.0


@torch.no_grad()
def invertible_init(vae):
    """Set a tiny Wan 2.1 VAE (base_dim 8, dim_mult 1,1,1,1, 1 res block) to weights whose decode of an encode
    is the clip's colours, block-averaged over 8x8 pixels and 4 frames (the latent grid) and upsampled back, so that
    what a transformer learns shows in its videos, while the model stays the real AutoencoderKLWan and code path.
    Residual and attention blocks are identities (their last convs zero); the strided convs average 2x2 pixels
    and 2 frames; the upsampling ones repeat frames, and pixels: the first (latent to 4-pixel cells) as they are, so
    that an edge between latents stays sharp, the two finer ones smoothed with a [1 2 1] kernel (a ramp of ~6
    pixels instead of the blocks' steps; smoothing all three blurs a 24-pixel square to a blob); the heads' RMS
    norm + SiLU act as a near-constant scale on channels carrying an offset beside a large constant channel. The 16
    latent channels are a fixed orthonormal mix of R, G, B (normalised latents of unit scale), with the VAE's own
    latents_mean/std; the posterior's log-variance is -30 (sample == mode up to e-7)."""
    for p in vae.parameters():
        p.zero_()
    enc, dec, cfg = vae.encoder, vae.decoder, vae.config
    z, mean, std = cfg.z_dim, torch.tensor(cfg.latents_mean), torch.tensor(cfg.latents_std)
    g = torch.Generator().manual_seed(0)
    mix = torch.linalg.qr(torch.randn(z, 3, generator=g, dtype=torch.float64))[0].float()  # [z, 3] orthonormal
    mix = mix * (z / 3) ** 0.5  # [z, 3]: normalised latents ~ the colours' scale
    rgb, const = slice(0, 3), 3
    eye3 = torch.eye(3)

    def carry(conv, n_in=None, taps=None):
        """conv passes channels 0-3 through (at the given (t, y, x) taps, weights summing to 1)."""
        w = conv.weight
        for tap, wt in taps:
            for c in range(4 if n_in is None else n_in):
                w[(c, c) + tap] = wt

    # encoder: colours + offset and the constant channel, averaged down, then the head mixes them into latents
    enc.conv_in.weight[rgb, :, 2, 1, 1] = eye3
    enc.conv_in.bias[rgb], enc.conv_in.bias[const] = _COLOUR_OFFSET, _CONSTANT
    for m in enc.modules():
        if type(m).__name__ == "WanResample":  # 2x2 average (the pad is right/bottom), 2-frame average in time
            carry(m.resample[1], taps=[((a, b), 0.25) for a in (0, 1) for b in (0, 1)])
            if hasattr(m, "time_conv"):
                carry(m.time_conv, taps=[((1, 0, 0), 0.5), ((2, 0, 0), 0.5)])
    silu0, slope = _head_response(cfg.base_dim)
    for norm in (enc.norm_out, dec.norm_out):
        norm.gamma.fill_(_HEAD_GAMMA)
    enc.conv_out.weight[:z, rgb, 2, 1, 1] = std[:, None] * mix / slope
    enc.conv_out.bias[:z] = mean - std * mix.sum(1) * silu0 / slope
    enc.conv_out.bias[z:] = -30.0  # log-variance: a deterministic encoder
    vae.quant_conv.weight[:, :, 0, 0, 0] = torch.eye(2 * z)

    # decoder: latents back to colours + offset and the constant channel, upsampled, then the head's inverse scale
    vae.post_quant_conv.weight[:, :, 0, 0, 0] = torch.eye(z)
    dec.conv_in.weight[rgb, :, 2, 1, 1] = mix.T / (z / 3) / std[None]
    dec.conv_in.bias[rgb] = _COLOUR_OFFSET - (mix.T / (z / 3)) @ (mean / std)
    dec.conv_in.bias[const] = _CONSTANT
    smooth = torch.tensor([1.0, 2.0, 1.0]) / 4
    upsamplers = [m for m in dec.modules() if type(m).__name__ == "WanResample"]  # coarse to fine
    for m in dec.modules():
        if type(m).__name__ == "WanResidualBlock" and not isinstance(m.conv_shortcut, torch.nn.Identity):
            carry(m.conv_shortcut, taps=[((0, 0, 0), 1.0)])
        if type(m).__name__ == "WanResample":
            carry(m.resample[1], taps=[((1, 1), 1.0)] if m is upsamplers[0] else
                  [((a, b), float(smooth[a] * smooth[b])) for a in range(3) for b in range(3)])
            if hasattr(m, "time_conv"):  # each latent frame -> two equal frames (channel blocks [:dim], [dim:])
                for c in range(4):
                    m.time_conv.weight[c, c, 2, 0, 0] = m.time_conv.weight[m.dim + c, c, 2, 0, 0] = 1.0
    dec.conv_out.weight[:, rgb, 2, 1, 1] = eye3 / slope
    dec.conv_out.bias[:] = -silu0 / slope
    return vae


def _head_response(dim: int) -> tuple[float, float]:
    """What a VAE head's RMS norm (x / |x| * sqrt(dim) * gamma) and SiLU make of a colour channel at its offset
    (|x| ~ the constant channel): the output there, and its slope (the gain of small changes around it)."""
    gain = dim ** 0.5 * _HEAD_GAMMA / math.hypot(_CONSTANT, 3 ** 0.5 * _COLOUR_OFFSET)
    y = _COLOUR_OFFSET * gain
    sig = 1 / (1 + math.exp(-y))
    return y * sig, gain * (sig + y * sig * (1 - sig))


def build_tiny(seed: int = 0, t2v: bool = False, wan22: bool = False, preset: str = "tiny",
               ti2v: bool = False, vace: bool = False) -> dict:
    """The pipeline parts of the tiny model each flag shapes as the module docstring says: Wan I2V (A2 architecture)
    by default; wan22 adds the low-noise expert `transformer_2` (other random weights) and `boundary_ratio`, and
    drops CLIP; vace (with t2v) makes every expert a VACE transformer. preset `1.3B` / `14B` / `5B`: encoders with
    that model's widths, and the transformer as a config dict (no weights)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    if vace:
        tcfg = preset_config("tiny-vace")
    else:
        tcfg = preset_config("tiny-ti2v" if ti2v and preset == "tiny" else preset, e2v=None if ti2v else not t2v)
    model = transformer_class(tcfg)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=tcfg["text_dim"], d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
    )).eval()
    vae = invertible_init(AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                           attn_scales=[], temperal_downsample=[False, True, True]).eval())
    if ti2v:
        vae = tiny_ti2v_vae()
    if wan22:
        tcfg.update(image_dim=None, added_kv_proj_dim=None)
    transformer = model(**tcfg).eval() if preset == "tiny" else tcfg
    shift = TI2V_FLOW_SHIFT if ti2v else VACE_FLOW_SHIFT if vace else 8.0
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=shift)
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                 scheduler=scheduler)
    if ti2v:
        parts["expand_timesteps"] = True
    elif wan22:
        parts.update(transformer_2=model(**tcfg).eval(),
                     boundary_ratio=VACE_FUN_BOUNDARY if vace else WAN22_BOUNDARY[t2v])
    elif not t2v:
        parts["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(
            **{**TINY_CLIP_VISION, "hidden_size": tcfg["image_dim"]})).eval()
        parts["image_processor"] = CLIPImageProcessor()  # its defaults: shortest edge 224, centre crop 224, CLIP's mean
    return parts


# the tiny encoders' transformer towers (CLIP's text and vision, Dinov2)
TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
# CLIP ViT-H/14's token count (257 at 224 px, patch 14) at width 32 (a real-size preset: that model's image_dim)
TINY_CLIP_VISION = dict(TINY_TOWER, image_size=224, patch_size=14, projection_dim=32)


def save_tiny_evaluators(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Tiny random encoders for a2/eval/evaluate.py: a CLIPModel (text + vision towers, the vision tower shaped as the
    tiny model's image encoder, the tiny tokenizer) and a Dinov2Model, each a transformers dir (their processors
    included). Returns dict(clip_text=dir, dino=dir)."""
    from transformers import BitImageProcessor, CLIPConfig, CLIPImageProcessor, CLIPModel, Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    tokenizer = tiny_tokenizer()
    clip = CLIPModel(CLIPConfig(
        text_config=dict(TINY_TOWER, vocab_size=len(tokenizer), max_position_embeddings=77, pad_token_id=0,
                         bos_token_id=None, eos_token_id=1),
        vision_config=TINY_CLIP_VISION, projection_dim=32)).eval()
    dino = Dinov2Model(Dinov2Config(**TINY_TOWER, image_size=224, patch_size=14)).eval()
    dirs = dict(clip_text=out_dir / "clip", dino=out_dir / "dino")
    # Dinov2's processor class, with the same defaults as CLIP's (shortest edge 224, centre crop 224, CLIP mean/std)
    for (model, processor), d in zip(((clip, CLIPImageProcessor), (dino, BitImageProcessor)), dirs.values()):
        model.save_pretrained(d)
        processor().save_pretrained(d)
    tokenizer.save_pretrained(dirs["clip_text"])
    return dirs


RELEASED_FLOW_SHIFT = 5.0  # Phantom-Wan's (--sample_shift default) and SkyReels-V3 R2V's sampling shift
MAGREF_FLOW_SHIFT = 3.0  # MAGREF's generate.py --sample_shift (Wan2.1-I2V-14B-480P-Diffusers' scheduler: 3.0 too)


def save_released(out_dir: Path, parts: dict, released: str) -> Path:
    """The tiny T2V model in a released subject-to-video model's own layout.
    phantom: Phantom-Wan's, an original-Wan checkpoint (sharded safetensors with an index, as its 14B) with a Wan
      config.json (the tiny heads are 32 wide, not Wan's 128), beside the Wan T2V parts in diffusers format
      (vae/ text_encoder/ tokenizer/ scheduler/, which the real release takes from Wan2.1-T2V-1.3B).
    v3: SkyReels-V3 R2V's, a diffusers dir whose transformer config names their class.
    refalign: RefAlign's, one model.safetensors in original-Wan keys (a dir whose name says refalign: how a2 tells it
      from Phantom-Wan, a2/model/transformer.py is_refalign), the Wan config.json and the Wan T2V parts beside it.
    magref: the tiny I2V model as MAGREF-Video/MAGREF ships its DiT: original-Wan keys in diffusion_pytorch_model
      shards + index, Wan's config.json (model_type i2v), a T5/VAE/CLIP .pth beside them (a stand-in file that a2
      must not take for the DiT), and the Wan I2V parts in diffusers format (which the release takes from
      Wan2.1-I2V-14B-480P-Diffusers).
    vace: the tiny VACE model as Wan-AI/Wan2.1-VACE-1.3B ships it: VaceWanModel's original keys in one
      diffusion_pytorch_model.safetensors, its config.json (vace_layers), the VAE and T5 .pth beside it (stand-ins),
      and the Wan T2V parts in diffusers format.
    vace-fun: the tiny VACE pair as alibaba-pai/Wan2.2-VACE-Fun-A14B ships it: high_noise_model/ and low_noise_model/
      (a2's transformer and transformer_2), each a config.json and diffusion_pytorch_model.safetensors, the VAE .pth
      beside them (a stand-in), and the Wan T2V parts in diffusers format.
    kaleido: the tiny T2V model as zai-org/Kaleido-14B-S2V ships its DiT: SAT's model/latest and
      model/1/mp_rank_00_model_states.pt ({"module": SAT names, fused q|k|v and k|v}: a2/kaleido.py original_to_sat),
      a Wan config.json beside `latest` (the tiny heads are 32 wide; the release has none: 128), Wan2.1_VAE.pth
      beside (a stand-in), and the Wan T2V parts in diffusers format."""
    from diffusers import WanPipeline
    from safetensors.torch import save_file

    parts["scheduler"] = type(parts["scheduler"]).from_config(
        parts["scheduler"].config, flow_shift=MAGREF_FLOW_SHIFT if released == "magref" else RELEASED_FLOW_SHIFT)
    if released == "v3":
        WanPipeline(**parts).save_pretrained(out_dir)
        cfg = json.loads((out_dir / "transformer" / "config.json").read_text())
        cfg["_class_name"] = "SkyReelsC1WanI2v3DModel"  # what the released transformer/config.json names
        (out_dir / "transformer" / "config.json").write_text(json.dumps(cfg, indent=2))
        return out_dir
    transformer = parts.pop("transformer")
    if released == "kaleido":
        from a2 import kaleido

        out_dir.mkdir(parents=True)
        for name, part in parts.items():
            part.save_pretrained(out_dir / name)
        kaleido.save(out_dir / "model", diffusers_to_original(transformer.state_dict()))
        (out_dir / "model" / "config.json").write_text(json.dumps(original_wan_config(transformer.config), indent=2))
        torch.save({"encoder.conv1.weight": torch.zeros(1)}, out_dir / "Wan2.1_VAE.pth")
        return out_dir
    experts = {"high_noise_model": transformer, "low_noise_model": parts.pop("transformer_2", None)}
    parts.pop("boundary_ratio", None)
    out_dir.mkdir(parents=True)
    for name, part in parts.items():
        part.save_pretrained(out_dir / name)
    for name, model in experts.items() if released == "vace-fun" else [("", transformer)]:
        (out_dir / name).mkdir(exist_ok=True)
        wan = dict(original_wan_config(model.config), **(dict(model_type="i2v") if released == "magref" else {}))
        (out_dir / name / "config.json").write_text(json.dumps(wan, indent=2))
        sd = {k: v.contiguous() for k, v in diffusers_to_original(model.state_dict()).items()}
        if released not in ("phantom", "magref"):
            save_file(sd, out_dir / name / ("model.safetensors" if released == "refalign" else
                                            "diffusion_pytorch_model.safetensors"))
            continue
        stem = "diffusion_pytorch_model" if released == "magref" else "Phantom_Wan_tiny"
        first, second = f"{stem}-00001-of-00002.safetensors", f"{stem}-00002-of-00002.safetensors"
        shards = {first: {k: v for k, v in sd.items() if k.startswith("blocks.")}}
        shards[second] = {k: v for k, v in sd.items() if k not in shards[first]}
        for shard_name, shard in shards.items():
            save_file(shard, out_dir / shard_name)
        index = {"metadata": {}, "weight_map": {k: shard_name for shard_name, shard in shards.items() for k in shard}}
        (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if released in ("magref", "vace", "vace-fun"):  # the original Wan VAE file sits beside the DiT in the release
        torch.save({"encoder.conv1.weight": torch.zeros(1)}, out_dir / "Wan2.1_VAE.pth")
    return out_dir


def save_tiny(out_dir: str | Path, seed: int = 0, t2v: bool = False, wan22: bool = False,
              preset: str = "tiny", ti2v: bool = False, released: str | None = None, vace: bool = False) -> Path:
    """Write the tiny model as a diffusers model dir (loadable by WanImageToVideoPipeline/WanPipeline, WanVACEPipeline
    with vace); for a real-size preset the transformer dir gets the config and the RANDOM_WEIGHTS marker instead of
    weights. released="phantom" | "v3" | "vace" | "vace-fun" ...: the tiny model in a released model's own layout
    (save_released)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel, WanVACEPipeline

    out_dir = Path(out_dir)
    parts = build_tiny(seed, t2v, wan22, preset, ti2v, vace or released in ("vace", "vace-fun"))
    if released:
        return save_released(out_dir, parts, released)
    config = None if preset == "tiny" else parts.pop("transformer")
    pipeline = WanVACEPipeline if vace else WanPipeline if t2v or ti2v else WanImageToVideoPipeline
    pipe = pipeline(**parts)  # 5B: WanPipeline, as its hub dir
    pipe.save_pretrained(out_dir)
    if config is not None:
        with torch.device("meta"):
            WanTransformer3DModel(**config).save_config(out_dir / "transformer")
        (out_dir / "transformer" / RANDOM_WEIGHTS).write_text("no weights: a2.model.transformer.load_transformer "
                                                              "builds "
                                                              "random ones of this config (a2/model/tiny.py)\n")
        index = json.loads((out_dir / "model_index.json").read_text())
        index["transformer"] = ["diffusers", "WanTransformer3DModel"]
        (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))
    return out_dir


def tiny_model_dir(name: str) -> Path:
    """The built-in tiny model `name` (a TINY_MODELS key), built once into a cache dir of that name (what `--model
    NAME` means).

    A file lock serialises the build: DDP ranks started together must not save concurrently (two
    concurrent transformers saves of the same model were seen to leave a shard missing)."""
    from transformers.utils import logging as hf_logging

    root = Path(os.environ.get("A2_CACHE", Path.home() / ".cache" / "a2")) / f"built-{TINY_BUILD}"
    root.mkdir(parents=True, exist_ok=True)
    d = root / name
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not d.exists():  # os.replace below: the dir exists only once complete
            tmp = d.with_name(d.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            bars = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # a built-in model's build is no download: no "Writing model shards"
            try:
                save_tiny(tmp, **TINY_MODELS[name])
            finally:
                if bars:
                    hf_logging.enable_progress_bar()
            os.replace(tmp, d)  # a killed build never leaves a half dir that looks complete
    return d


def model_path(name) -> Path:
    """What `--model NAME` (and `--image-encoder`) means: a built-in tiny model's dir (built on first use), a local
    dir, or a Hugging Face Hub id (`Skywork/SkyReels-A2`) resolved through the Hub cache (a2.model.transformer)."""
    if str(name) in TINY_MODELS:
        return tiny_model_dir(str(name))
    path = local_or_hub(name)
    if not path.exists() and len(path.parts) == 1:  # a bare name, no file, no Hub id: a built-in name mistyped?
        raise UnsupportedModel(not_a_model(name, TINY_MODELS))  # every one offered, from the registry
    return path


if __name__ == "__main__":
    print(save_tiny(sys.argv[1], t2v="--t2v" in sys.argv or "--vace" in sys.argv, wan22="--wan22" in sys.argv,
                    ti2v="--ti2v" in sys.argv, vace="--vace" in sys.argv))
