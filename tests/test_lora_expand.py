"""A LoRA on a T2V base expanded to the E2V inputs: LoRA + the expansion's weights (widened patch embedding, and
with CLIP the image branch) train, ship beside the adapter, and infer.py rebuilds the trained model exactly."""

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import args, losses, max_diff, params, train


def trained_model(t2v_dir, ckpt, image_dim):
    """The run's transformer rebuilt as build_transformer makes it, with the checkpoint's trainable weights."""
    from peft import LoraConfig

    from a2.model.transformer import expand_to_e2v, load_transformer
    from config import LORA_TARGETS

    model = expand_to_e2v(load_transformer(t2v_dir, torch.float32), image_dim=image_dim)
    target = LORA_TARGETS.replace("|add_k_proj|add_v_proj", "")  # the expansion's image K/V train in full
    model.add_adapter(LoraConfig(r=32, lora_alpha=32.0, target_modules=target))
    sd = load_file(ckpt / "trainable.safetensors")
    result = model.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if k in sd]
    return model.eval()


def forward(model, image_dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 36, 3, 4, 4, generator=g)
    text = torch.randn(1, 512, model.config.text_dim, generator=g)
    image = None if image_dim is None else torch.randn(1, 257 * 3, image_dim, generator=g)
    with torch.no_grad():
        return model(x, torch.tensor([500.0]), text, encoder_hidden_states_image=image, return_dict=False)[0]


@pytest.mark.parametrize("clip", [False, True], ids=["vae", "dual"])
def test_e2v_lora_from_t2v_base_round_trip(data_dir, tmp_path, tiny_t2v_dir, tiny_dir, clip):  # noqa: F811
    import infer
    from a2.model.transformer import expand_to_e2v, load_transformer
    from a2.pipeline import A2Pipeline
    from a2.train.lora import E2V_NAME, load_expanded, load_lora

    paths = ["--e2v-type", "dual", "--image-encoder", str(tiny_dir)] if clip else ["--e2v-type", "vae"]
    r = train(*args(data_dir, tmp_path, "run", "--max-steps", "3", "--ckpt-every", "3", "--lr", "5e-2",
                    "--warmup-steps", "0", *paths, model=tiny_t2v_dir))
    lora, ckpt = r["weights"], r["run_dir"] / "ckpt-0000003"
    full = load_file(lora.parent / E2V_NAME)
    assert all("lora" not in k for k in full) and "transformer.patch_embedding.weight" in full
    assert any("image_embedder" in k for k in full) == clip and any("add_k_proj" in k for k in full) == clip
    assert all("lora" in k for k in load_file(lora))  # the adapter file stays plain LoRA (diffusers' loader)
    assert "patch_embedding.weight" in params(ckpt)  # the checkpoint holds the full weights (resume)
    assert full["transformer.patch_embedding.weight"][:, 16:].abs().max() > 0  # the new input channels trained

    image_dim = full["transformer.condition_embedder.image_embedder.norm1.weight"].shape[0] if clip else None
    want = forward(trained_model(tiny_t2v_dir, ckpt, image_dim), image_dim)
    model = load_expanded(load_transformer(tiny_t2v_dir, torch.float32), lora)
    pipe = A2Pipeline(model, None, None, None)
    assert "modules of transformer adapted" in load_lora(pipe, str(lora))
    got = forward(pipe.transformer, image_dim)
    assert torch.equal(got, want)
    untrained = forward(expand_to_e2v(load_transformer(tiny_t2v_dir, torch.float32), image_dim=image_dim), image_dim)
    assert (untrained - want).abs().max() > 1e-4

    # infer.py on the T2V base with the run's LoRA: expands, loads, samples
    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    kw = dict(image_encoder=str(tiny_dir)) if clip else {}
    assert infer.main(infer.InferConfig.from_flags(model=str(tiny_t2v_dir), lora=str(lora), elements=els, height=32,
                                                   width=32, num_frames=21, steps=2, device="cpu", decode="none",
                                                   **kw)) == 0


def test_e2v_lora_from_t2v_base_resumes(data_dir, tmp_path, tiny_t2v_dir):  # noqa: F811
    flags = ["--e2v-type", "vae", "--ckpt-every", "1", "--warmup-steps", "0"]
    whole = train(*args(data_dir, tmp_path, "whole", "--max-steps", "2", *flags, model=tiny_t2v_dir))["run_dir"]
    train(*args(data_dir, tmp_path, "cut", "--max-steps", "1", *flags, model=tiny_t2v_dir))
    cut = train(*args(data_dir, tmp_path, "cut", "--max-steps", "2", "--resume", "auto", *flags,
                      model=tiny_t2v_dir))["run_dir"]
    assert losses(cut) == losses(whole)
    a, b = params(whole / "ckpt-0000002"), params(cut / "ckpt-0000002")
    assert "patch_embedding.weight" in a and max_diff(a, b) == 0.0
