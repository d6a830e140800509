"""Wan 2.2 TI2V-5B: detection, the 5B's first-frame conditioning against tensors built as diffusers
builds them, parity of A2Pipeline with diffusers' own 5B pipelines, training == sampling input (first frame, and E2V
through the in-context layout), and train -> export -> infer round trips on the tiny 5B-shaped model (48-channel
Wan 2.2 VAE with patch 2 and residual blocks, 16x spatial)."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train_a2
from a2.config.dataset_config import ConditioningConfig
from config import from_flags
from tests.conftest import args, train

H, W, F = 64, 96, 9  # latents (3, 4, 6); tokens 3 x 2 x 3


@pytest.fixture(scope="module")
def ti2v_dir():
    from a2.model.tiny import model_path

    return model_path("tiny-ti2v")  # built into the session's A2_CACHE, as `--model tiny-ti2v` does


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("data") / "clips", num_samples=4, num_frames=17,
                                  size=(32, 32))


def ti2v_args(data_dir, out, run, *extra):
    return args(data_dir, out, run, "--num-frames", "17", *extra, model="tiny-ti2v")


def random_image(seed=0, h=H, w=W):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ---------------------------------------------------------------- detection


def test_detect_model_reads_the_5b_layout(ti2v_dir, tmp_path):
    from a2.model.transformer import UnsupportedModel, detect_model

    info = detect_model(ti2v_dir)
    assert (info.name, info.in_channels, info.image_branch, info.boundary_ratio) == ("Wan2.2 TI2V 5B", 48, False,
                                                                                      None)
    assert (info.z_dim, info.vae_scale, info.patch_size, info.ti2v) == (48, 16, (1, 2, 2), True)
    assert info.spatial_multiple == 32 and info.latent_tokens(81, 704, 1280) == 21 * 22 * 40  # 5B at 720p: 18,480
    vae = json.loads((ti2v_dir / "vae" / "config.json").read_text())
    assert (vae["z_dim"], vae["patch_size"], vae["is_residual"], vae["scale_factor_spatial"]) == (48, 2, True, 16)

    def variant(name, part, **change):
        d = tmp_path / name
        shutil.copytree(ti2v_dir, d)
        path = d / part
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
        return d

    with pytest.raises(UnsupportedModel, match="z_dim 16; need Wan 2.2's AutoencoderKLWan, z_dim 48"):
        detect_model(variant("vae16", "vae/config.json", z_dim=16))
    with pytest.raises(UnsupportedModel, match="needs one transformer with in/out_channels 48 .* in 36"):
        detect_model(variant("in36", "transformer/config.json", in_channels=36))
    with pytest.raises(UnsupportedModel, match="z_dim 48; need the Wan 2.1 AutoencoderKLWan, z_dim 16"):
        detect_model(variant("noexpand", "model_index.json", expand_timesteps=False))


# ---------------------------------------------------------------- the conditioning, against diffusers' formulas


def test_model_input_matches_diffusers_formulas():
    """model_input on the 5B (clean frames, per-token timesteps) == diffusers' WanImageToVideoPipeline
    (expand_timesteps) / WanPipeline loop, written out."""
    from a2.kinds.conditioning import Conditioning, model_input

    def ti2v_model_input(x_t, clean, t, conditioned=None):
        return model_input(x_t, Conditioning("clean" if clean is not None else "t2v", clean=clean, keep=conditioned,
                                             per_token=True), t)

    g = torch.Generator().manual_seed(0)
    latents, condition = torch.randn(2, 48, 3, 4, 6, generator=g), torch.randn(2, 48, 1, 4, 6, generator=g)
    t = torch.tensor(937)  # UniPC's timesteps are int64
    mask = torch.ones(1, 1, 3, 4, 6)  # pipeline_wan_i2v.prepare_latents: first_frame_mask
    mask[:, :, 0] = 0
    want_x = (1 - mask) * condition + mask * latents
    want_t = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(2, -1)
    x, ts = ti2v_model_input(latents, condition, t)
    assert torch.equal(x, want_x) and torch.equal(ts, want_t)
    assert ts.shape == (2, 3 * 2 * 3) and ts.dtype == torch.float32
    assert (ts[:, :6] == 0).all() and (ts[:, 6:] == 937).all()  # frame-major tokens: frame 0's 2x3 are clean
    # T2V (WanPipeline with expand_timesteps): the latents as they are, the timestep on every token
    ones = torch.ones(1, 1, 3, 4, 6)
    x, ts = ti2v_model_input(latents, None, t)
    assert torch.equal(x, latents) and torch.equal(ts, (ones[0][0][:, ::2, ::2] * t).flatten()[None].expand(2, -1))
    # training: per-sample sigmas, and a reference-dropped sample (conditioned 0) is T2V
    sig = torch.tensor([0.25, 0.75]) * 1000
    x, ts = ti2v_model_input(latents, condition, sig, conditioned=torch.tensor([1.0, 0.0]))
    assert torch.equal(x[0], want_x[0]) and torch.equal(x[1], latents[1])
    assert torch.equal(ts[0], (mask[0][0][:, ::2, ::2] * sig[0]).flatten()) and (ts[1] == 750).all()
    # prefix of 5 frames = 2 latent frames: 12 clean tokens
    x, ts = ti2v_model_input(latents, torch.randn(2, 48, 2, 4, 6, generator=g), t)
    assert (ts[:, :12] == 0).all() and (ts[:, 12:] == 937).all() and torch.equal(x[:, :, 2], latents[:, :, 2])
    # E2V on the 5B: the in-context references (2 latent frames) come after, at 0 (zero) or the sample's t (shared)
    refs = torch.randn(2, 48, 2, 4, 6, generator=g)
    for how, ref_t in (("zero", 0.0), ("shared", 937.0)):
        both = Conditioning("incontext", ref_latents=refs, clean=condition, reference_timestep=how, per_token=True)
        x, ts = model_input(latents, both, t, (1, 2, 2))
        assert torch.equal(x, torch.cat([want_x, refs], dim=2)) and ts.shape == (2, 5 * 6)
        assert torch.equal(ts, torch.cat([want_t, torch.full((2, 12), ref_t)], dim=1))


def test_clean_frames_are_the_videos_leading_latents(ti2v_dir):
    """The image encoded alone (as inference encodes it) == the first latent of the whole clip (as x0 holds it):
    the causal Wan 2.2 VAE. Normalised with the VAE's 48 means/stds."""
    from a2.kinds.conditioning import encode_vae, latent_stats, make_layout, prepare_latents
    from a2.pipeline import A2Pipeline

    vae = A2Pipeline.from_pretrained(ti2v_dir).vae
    video = torch.rand(1, 3, F, H, W, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        x0 = encode_vae(vae, video)
        first = prepare_latents(vae, make_layout("clean", F, clean_frames=1), video=video).clean
        prefix = prepare_latents(vae, make_layout("clean", F, clean_frames=5), video=video).clean
        raw = vae.encode(video[:, :, :1]).latent_dist.mode()
    mean, std = latent_stats(vae, raw.device, raw.dtype)
    assert x0.shape == (1, 48, 3, 4, 6) and first.shape == (1, 48, 1, 4, 6) and prefix.shape == (1, 48, 2, 4, 6)
    assert torch.allclose(first, (raw - mean) / std, atol=1e-6)
    assert (first - x0[:, :, :1]).abs().max() <= 1e-5 and (prefix - x0[:, :, :2]).abs().max() <= 1e-5
    assert (mean.abs().max() > 0) and (std - 1).abs().max() > 0  # the normalisation is not the identity
    with pytest.raises(ValueError, match="4k\\+1 frames of the video: 2 of 9"):
        prepare_latents(vae, make_layout("clean", F, clean_frames=2), video=video)


def test_forward_loss_sees_the_clean_frame_at_timestep_0_and_leaves_it_out():
    """The training step feeds what inference feeds (clean frame 0, timestep 0 on its tokens) and the loss ignores
    the prediction there."""
    from a2.kinds.conditioning import Conditioning, make_layout
    from a2.train.flow import noisy_latents

    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(2, 48, 3, 4, 6, generator=g), torch.randn(2, 48, 3, 4, 6, generator=g)
    clean, sigmas = torch.randn(2, 48, 1, 4, 6, generator=g), torch.tensor([0.3, 0.9])
    x_t, target = noisy_latents(x0, noise, sigmas)
    seen = {}

    def model(hidden_states, timestep, **kw):  # predicts the target, and garbage on the clean frame
        seen.update(x=hidden_states, t=timestep)
        pred = target.clone()
        pred[:, :, 0] = 1e3
        return (pred,)

    model.config = SimpleNamespace(patch_size=(1, 2, 2))

    objective = SimpleNamespace(loss_on_references=False, loss_weighting="none")  # the sections forward_loss reads
    references = SimpleNamespace(align_loss=False)
    cond = Conditioning("clean", clean=clean, keep=torch.ones(2), per_token=True)
    inputs = dict(x0=x0, noise=noise, sigmas=sigmas, cond=cond, text=torch.zeros(2, 512, 32), reference_images=None,
                  layout=make_layout("clean", 9, clean_frames=1))
    loss, _ = train_a2.forward_loss(model, inputs, objective, references, None, torch.autocast("cpu", enabled=False),
                                    torch.float32)
    assert loss.item() == 0.0
    assert torch.equal(seen["x"][:, :, :1], clean) and torch.equal(seen["x"][:, :, 1:], x_t[:, :, 1:])
    assert (seen["t"][:, :6] == 0).all() and torch.equal(seen["t"][:, 6:], (sigmas[:, None] * 1000).expand(-1, 12))


# ---------------------------------------------------------------- parity with diffusers' Wan 2.2 5B pipelines


def test_t2v_and_i2v_match_diffusers_5b_pipelines(ti2v_dir):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from a2.images import pil_to_tensor
    from a2.pipeline import A2Pipeline

    prompt, negative, steps = "a hiker on a mountain", "blurry", 3
    kw = dict(prompt=prompt, negative_prompt=negative, height=H, width=W, num_frames=F, num_inference_steps=steps,
              guidance_scale=5.0, output_type="latent")
    pipe = A2Pipeline.from_pretrained(ti2v_dir)
    assert pipe.expand_timesteps and pipe.flow_shift == 5.0

    def ours(seed, **extra):
        return pipe(prompt, layout=pipe.plan(F, first_frame="first_frame" in extra), negative_prompt=negative, height=H,
                    width=W, num_inference_steps=steps,
                    guidance_scale=5.0, generator=torch.Generator().manual_seed(seed), decode="none", progress=False,
                    **extra)["latents"]

    t2v = WanPipeline.from_pretrained(ti2v_dir)
    t2v.set_progress_bar_config(disable=True)
    assert t2v.config.expand_timesteps
    expected = t2v(**kw, generator=torch.Generator().manual_seed(7)).frames
    got = ours(7)
    assert got.shape == expected.shape == (1, 48, 3, 4, 6)
    assert (got - expected).abs().max().item() <= 1e-6  # measured 0.0

    image = random_image()
    i2v = WanImageToVideoPipeline.from_pretrained(ti2v_dir)
    i2v.set_progress_bar_config(disable=True)
    assert i2v.config.expand_timesteps and i2v.transformer.config.image_dim is None
    expected_i2v = i2v(image=image, **kw, generator=torch.Generator().manual_seed(7)).frames
    first = pil_to_tensor(image)[None]
    got_i2v = ours(7, first_frame=first)  # the posterior mean: diffusers' encode, TI2V-5B's own
    # bit-identical (a2 normalises latents as diffusers does, (z - mean) * (1 / std); with `/ std` it was 3.8e-6)
    assert (got_i2v - expected_i2v).abs().max().item() <= 1e-6
    assert (got_i2v - expected).abs().max().item() > 1e-2  # the image conditions the video
    # and the comparison can fail: another seed is far beyond the tolerance
    assert (ours(8, first_frame=first) - expected_i2v).abs().max().item() > 1e-2


# ---------------------------------------------------------------- training, export, inference


def test_train_infer_share_the_first_frame_conditioning(ti2v_dir, data_dir):
    """The clean latent a training sample gets (a2.kinds.conditioning.encode) == what A2Pipeline builds from the same
    first frame (posterior mode)."""
    from a2.data.loader import collate
    from a2.kinds.conditioning import encode
    from a2.pipeline import A2Pipeline
    from data import E2VDataset

    pipe = A2Pipeline.from_pretrained(ti2v_dir)

    cfg = from_flags(model="tiny-ti2v", data_root=str(data_dir), resolution=(32, 32), num_frames=17,
                      conditioning=ConditioningConfig(frame_conditioning="first"))
    ds_cfgs = train_a2.run_datasets(cfg)
    run = train_a2.plan_run(cfg, 1, ds_cfgs, torch.device("cpu"))
    batch = collate([E2VDataset(ds_cfgs, num_frames=run.layout.clip_frames, verbose=False)[0]])
    with torch.no_grad():
        x0, cond = encode(pipe.vae, run.layout, batch["video"], None, None, run.encode_mode)  # the kind's own
    clean = cond.clean
    assert cond.kind == "clean" and x0.shape == (1, 48, 5, 2, 2) and clean.shape == (1, 48, 1, 2, 2)
    out = pipe("x", layout=pipe.plan(17, first_frame=True), height=32, width=32, num_inference_steps=1,
               first_frame=batch["video"][:, :, 0],
               generator=torch.Generator().manual_seed(0), decode="none", progress=False)
    assert torch.equal(out["condition"], clean)
    assert torch.equal(out["latents"][:, :, :1], clean)  # the result keeps the given frame


def test_lora_first_frame_and_t2v_round_trip(ti2v_dir, data_dir, tmp_path):
    """TI2V LoRA (first frame) and T2V LoRA: train -> export -> infer.py (with --image / prompt only) -> the LoRA
    changes the result; the I2V LoRA also loads into diffusers' 5B I2V pipeline."""
    import imageio.v3 as iio
    from diffusers import WanImageToVideoPipeline

    import infer

    image = tmp_path / "first.png"
    random_image(3, 32, 32).save(image)
    steps = ("--max-steps", "3", "--lr", "5e-2", "--warmup-steps", "0")
    i2v = train(*ti2v_args(data_dir, tmp_path, "i2v", "--frame-conditioning", "first", *steps, "--val-elements",
                           str(image), "--val-steps", "2"))  # the validation video starts from this first frame
    t2v = train(*ti2v_args(data_dir, tmp_path, "t2v", "--dataset-type", "t2v", *steps))
    for r in (i2v, t2v):
        assert r["step"] == 3 and all(np.isfinite(r["losses"]))
        assert any("lora_B" in k for k in load_file(r["weights"]))
    assert iio.imread(tmp_path / "i2v" / "samples" / "step-0000003.mp4", plugin="pyav").shape == (17, 32, 32, 3)
    base = dict(model="tiny-ti2v", height=32, width=32, num_frames=17, steps=2, device="cpu")
    for name, r, extra in (("i2v", i2v, dict(image=str(image))), ("t2v", t2v, {})):
        plain, mp4 = tmp_path / f"{name}.pt", tmp_path / f"{name}.mp4"
        assert infer.main(infer.InferConfig.from_flags(**base, **extra, out=str(mp4), save_latents=str(plain))) == 0
        assert iio.imread(mp4, plugin="pyav").shape == (17, 32, 32, 3)
        assert infer.main(infer.InferConfig.from_flags(**base, **extra, decode="none", compare=str(plain),
                                                       tolerance=0.0)) == 0
        assert infer.main(infer.InferConfig.from_flags(**base, **extra, decode="none", lora=str(r["weights"]),
                                                       compare=str(plain))) == 1
    saved = torch.load(tmp_path / "i2v.pt", weights_only=True)
    assert saved["condition"].shape == (1, 48, 1, 2, 2) and torch.equal(saved["latents"][:, :, :1],
                                                                        saved["condition"])
    pipe = WanImageToVideoPipeline.from_pretrained(ti2v_dir)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(image=Image.open(image), prompt="a square", height=32, width=32, num_frames=9, num_inference_steps=2,
              output_type="latent")
    before = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
    pipe.load_lora_weights(str(i2v["weights"].parent))
    assert (pipe(**kw, generator=torch.Generator().manual_seed(0)).frames - before).abs().max() > 1e-4


def test_full_fine_tune_exports_a_transformer_infer_loads(ti2v_dir, data_dir, tmp_path):
    import infer

    r = train(*ti2v_args(data_dir, tmp_path, "full", "--frame-conditioning", "first", "--training-type", "full",
                         "--max-steps", "2", "--lr", "1e-2", "--warmup-steps", "0"))
    out = r["weights"]
    assert out.name == "transformer" and json.loads((out / "config.json").read_text())["in_channels"] == 48
    base = dict(model="tiny-ti2v", height=32, width=32, num_frames=17, steps=2, device="cpu", decode="none",
                image=str(data_dir / "000_person.png"))
    assert infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "base.pt"))) == 0
    assert infer.main(infer.InferConfig.from_flags(**base, transformer=str(out),
                                                   compare=str(tmp_path / "base.pt"))) == 1


def test_e2v_incontext_lora_round_trip(data_dir, tmp_path):
    """E2V on the 5B: references in context (item 1's layout), a LoRA -> infer.py with --elements, alone and with a
    first frame too."""
    import infer

    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    r = train(*args(data_dir, tmp_path, "e2v", "--max-steps", "3", "--lr", "5e-2", "--warmup-steps", "0",
                    "--reference-layout", "incontext", "--reference-timestep", "zero", "--num-frames", "9",
                    "--val-elements", *els, "--val-steps", "2", "--no-val-metrics", model="tiny-ti2v"))
    run = json.loads((r["run_dir"] / "run.json").read_text())
    assert run["layout"]["kind"] == "incontext" and run["layout"]["e2v_type"] == "vae" and not run["layout"]["expand"]
    assert (r["run_dir"] / "samples" / "step-0000003.mp4").exists()
    base = dict(model="tiny-ti2v", elements=els, height=32, width=32, num_frames=9, steps=2, device="cpu",
                conditioning=ConditioningConfig(reference_layout="incontext", reference_timestep="zero"), decode="none")
    assert infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "base.pt"))) == 0
    saved = torch.load(tmp_path / "base.pt", weights_only=True)
    assert saved["latents"].shape == (1, 48, 3, 2, 2) and saved["condition"].shape == (1, 48, 3, 2, 2)
    assert infer.main(infer.InferConfig.from_flags(**base, lora=str(r["weights"]),
                                                   compare=str(tmp_path / "base.pt"))) == 1
    # a first frame and references together: the first latent is the image's, the rest moves
    assert infer.main(infer.InferConfig.from_flags(**base, image=els[2], save_latents=str(tmp_path / "both.pt"))) == 0
    both = torch.load(tmp_path / "both.pt", weights_only=True)
    assert (both["latents"] - saved["latents"]).abs().max() > 1e-3


def test_ti2v_refusals(data_dir, tmp_path):
    import infer
    from a2.cli import ConfigError

    with pytest.raises(ConfigError, match="element references go in context"):
        train(*args(data_dir, tmp_path, "e2v", model="tiny-ti2v"))  # A2's elements, prefix layout
    with pytest.raises(ConfigError, match="first_and_last is not a run of leading latent frames"):
        train(*ti2v_args(data_dir, tmp_path, "fl", "--frame-conditioning", "first_and_last"))
    with pytest.raises(ConfigError, match="--prefix-frames 3 must be 4k\\+1"):
        train(*ti2v_args(data_dir, tmp_path, "p3", "--frame-conditioning", "prefix", "--prefix-frames", "3"))
    with pytest.raises(ConfigError, match="--val-elements: Wan2.2 TI2V 5B image-to-video takes one image"):
        train(*ti2v_args(data_dir, tmp_path, "v2", "--frame-conditioning", "first", "--val-elements", "a.png", "b.png"))
    with pytest.raises(ConfigError, match="--val-elements: nope.png: first frame image is not a readable image"):
        train(*ti2v_args(data_dir, tmp_path, "v1", "--frame-conditioning", "first", "--val-elements", "nope.png"))
    with pytest.raises(ValueError, match="multiples of 32, got 48x32"):
        train(*ti2v_args(data_dir, tmp_path, "r48", "--resolution", "48", "32"))
    with pytest.raises(ValueError, match="--image is Wan 2.2 TI2V-5B's image-to-video"):
        infer.main(infer.InferConfig.from_flags(model="tiny-t2v", image=str(data_dir / "000_person.png"), device="cpu"))
    assert not any(p.name in ("e2v", "fl", "p3", "r48", "v1", "v2") for p in tmp_path.iterdir())


def test_aspect_buckets_fit_the_5b_grid(tmp_path):
    """Auto aspect buckets round height and width to the model's VAE x patch (TI2V-5B: 32, not 16)."""
    from a2.config.dataset_config import DatasetConfig
    from data import E2VDataset, make_synthetic_dataset

    d = make_synthetic_dataset(tmp_path / "wide", num_samples=2, num_frames=17, size=(32, 48))
    cfgs = [DatasetConfig(str(d), target_resolution=(64, 64), auto_frame_buckets=True)]
    sizes = {m: {b[1:3] for b in E2VDataset(cfgs, num_frames=17, verbose=False, size_multiple=m).buckets}
             for m in (16, 32)}
    assert all(h % 32 == 0 and w % 32 == 0 for h, w in sizes[32])
    assert any(h % 32 or w % 32 for h, w in sizes[16])  # the 16-grid bucket would not fit the 5B
