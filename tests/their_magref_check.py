"""Run by hand, not by pytest (it needs MAGREF's code): an a2 LoRA, exported and merged into MAGREF's original-Wan
checkpoint keys, loaded into MAGREF's own model class (magref/modules/model.py WanModel, MAGREF-Video/MAGREF e3c71b2),
whose forward is compared with a2's (diffusers' WanTransformer3DModel with the peft LoRA). The numbers are recorded in
tests/test_magref.py: test_a2_lora_in_magrefs_checkpoint.

    MAGREF_MODULES=<dir holding their magref/modules/model.py and attention.py> python3 -m tests.their_magref_check

Their model.py imports flash_attention directly (not their attention(), which has an SDPA fallback), and
flash_attention asserts a CUDA tensor and casts q/k/v to bf16: it is replaced here by float32 SDPA with the same
k_lens mask (keys past k_lens excluded). Their MLPProj hard-codes the CLIP width 1280, so the tiny model here is
tiny-magref's config with image_dim 1280, random weights."""

import importlib
import os
import sys
import tempfile
import types
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from peft import LoraConfig
from safetensors.torch import load_file

from a2.model.tiny import model_path
from a2.model.transformer import diffusers_to_original, load_transformer
from a2.train.lora import export_lora
from config import LORA_TARGETS


def sdpa(q, k, v, q_lens=None, k_lens=None, **_):
    """flash_attention's contract, [B, L, N, D] in and out, in float32: keys past k_lens masked."""
    mask = None if k_lens is None else (torch.arange(k.shape[1])[None] < k_lens[:, None])[:, None, None]
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask)
    return out.transpose(1, 2).type(q.dtype)


def their_model_module(modules_dir: Path):
    pkg = types.ModuleType("magref_modules")  # their package __init__ imports T5/CLIP/VAE code not needed here
    pkg.__path__ = [str(modules_dir)]
    sys.modules["magref_modules"] = pkg
    module = importlib.import_module("magref_modules.model")
    module.flash_attention = sdpa
    return module


def main():
    theirs = their_model_module(Path(os.environ["MAGREF_MODULES"]))
    config = dict(load_transformer(model_path("tiny-magref")).config)
    config = {k: v for k, v in config.items() if not k.startswith("_")} | dict(image_dim=1280)
    torch.manual_seed(0)
    base = WanTransformer3DModel(**config)
    with torch.no_grad():
        for p in base.parameters():  # every weight random (diffusers zero-initialises some)
            p.normal_(std=0.05)
    lora = WanTransformer3DModel(**config)
    lora.load_state_dict(base.state_dict())
    lora.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        _, comfy = export_lora(Path(tmp), lora)
        adapter = load_file(comfy)
    original = diffusers_to_original(base.state_dict())
    merged = dict(original)
    for key in [k for k in adapter if k.endswith(".lora_down.weight")]:
        module = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
        merged[f"{module}.weight"] = original[f"{module}.weight"] + adapter[key.replace("down", "up")] @ adapter[key]

    def their_class(sd):
        m = theirs.WanModel(model_type="i2v", in_dim=36, dim=config["num_attention_heads"] *
                            config["attention_head_dim"], ffn_dim=config["ffn_dim"], freq_dim=config["freq_dim"],
                            text_dim=config["text_dim"], out_dim=config["out_channels"],
                            num_heads=config["num_attention_heads"], num_layers=config["num_layers"],
                            cross_attn_norm=config["cross_attn_norm"], eps=config["eps"])
        m.load_state_dict(sd, strict=True)
        return m.eval()

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 16, 3, 4, 6, generator=g), torch.randn(1, 20, 3, 4, 6, generator=g)
    y[:, 4:] = 0  # the mask's later frames are 0 in MAGREF's condition
    t = torch.tensor([700.0])
    text, clip = torch.randn(1, 512, config["text_dim"], generator=g), torch.randn(1, 257, 1280, generator=g)
    def a2_forward(m):
        return m(hidden_states=torch.cat([x, y], 1), timestep=t, encoder_hidden_states=text,
                 encoder_hidden_states_image=clip, return_dict=False)[0]

    with torch.no_grad():
        for name, a2_model, sd in (("base", base, original), ("LoRA", lora, merged)):
            want = a2_forward(a2_model)
            got = their_class(sd)([x[0]], t, [text[0]], seq_len=3 * 2 * 3, clip_fea=clip, y=[y[0]])[0][None]
            print(f"{name}: their WanModel vs a2 forward: max |diff| {(got - want).abs().max():.3g}, "
                  f"max |a2| {want.abs().max():.3g}, relative {(got - want).abs().max() / want.abs().max():.3g}")
        print(f"the LoRA's effect on a2's forward: max |diff| {(a2_forward(lora) - a2_forward(base)).abs().max():.3g}")


if __name__ == "__main__":
    main()
