"""The demo shows what training did: the built-in tiny model's VAE gives back what it encodes, and a short LoRA run on
one synthetic clip renders measurably closer to that clip than the base model does (a2/demo.py's picture)."""

import torch

from tests.conftest import args, train


def test_tiny_vae_decodes_an_encode_recognisably(tiny_dir):
    """The tiny VAE (invertible_init) returns a clip's 8x8-pixel, 4-frame block means: a solid colour comes back
    to within 1e-3, and the synthetic clip's reconstruction is far closer than a grey frame (a random VAE: 0.36
    against the grey frame's 0.17)."""
    from diffusers import AutoencoderKLWan

    from a2.demo import block_distance, read_clip
    from data import make_synthetic_dataset

    vae = AutoencoderKLWan.from_pretrained(tiny_dir / "vae").eval()
    solid = torch.tensor([0.5, -0.8, 0.1])[None, :, None, None, None].expand(1, 3, 9, 32, 32)
    with torch.no_grad():
        back = vae.decode(vae.encode(solid).latent_dist.mode()).sample
    assert (back - solid).abs().max() < 1e-3
    clip = read_clip(make_synthetic_dataset(tiny_dir.parent / "vae-clip", 1, 17, (64, 64)) / "000.mp4")  # (3, F, H, W)
    with torch.no_grad():
        back = vae.decode(vae.encode(clip[None]).latent_dist.mode()).sample[0]
    grey = torch.zeros_like(clip) + clip.mean()
    assert block_distance(back, clip) < 0.4 * block_distance(grey, clip)  # the block means survive (0.29x)
    assert ((back - clip) ** 2).mean() < 0.6 * ((grey - clip) ** 2).mean()  # finer texture is lost, by design


def test_lora_video_is_closer_to_the_training_clip_than_the_base(tmp_path):
    """A 60-step LoRA on one clip (the README demo's recipe, small): its video, same seed and elements as the
    base model's, is measurably closer to the clip (8x8-block pixel distance); the picture is written."""
    from a2.demo import DemoConfig, run
    from data import make_synthetic_dataset

    data = make_synthetic_dataset(tmp_path / "one", num_samples=1, num_frames=17, size=(32, 32))
    flags = args(data, tmp_path, "demo", "--max-steps", "60", "--lr", "2e-3", "--num-frames", "17")
    train(*flags)
    run_dir = tmp_path / "demo"
    els = [str(data / f"000_{n}.png") for n in ("person", "object", "background")]
    out = run(DemoConfig(str(run_dir), elements=tuple(els), clip=str(data / "000.mp4")))
    assert out["lora"] < 0.75 * out["base"], out
    from PIL import Image

    assert Image.open(out["path"]).size[0] > 200
