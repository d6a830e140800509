"""prepare_latents: masks, shapes and values against independently built expectations; T2V expansion;
preprocessing on pictures of the SkyReels-A2 photos' sizes (and the photos, where they are beside the checkout); A2's
own sampling."""

from functools import cache

import numpy as np
import pytest
import torch
from PIL import Image

from a2.images import pil_to_tensor, preprocess_image
from a2.kinds.conditioning import conditioning_frame_indices, encode_vae, frame_mask, make_layout, prepare_latents
from tests.conftest import a2_photos, assert_rounding, drawn_person

H, W = 32, 48
# the SkyReels-A2 photos' sizes (w x h: human, thing, env), drawn; the photos themselves added where they are
PICTURES = {f"drawn-{w}x{h}": dict(size=(h, w), seed=i) for i, (w, h) in enumerate(((1280, 720), (1250, 1250),
                                                                                     (1080, 1920)))}
PICTURES.update({p.name: dict(path=p) for p in a2_photos()})


@cache
def picture(name: str) -> Image.Image:
    spec = PICTURES[name]
    return Image.open(spec["path"]).convert("RGB") if "path" in spec else drawn_person(spec["size"], spec["seed"])


@pytest.fixture(scope="module")
def vae(tiny_dir):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(tiny_dir, subfolder="vae").eval()


def a2_mask(num_images, num_frames, repeat=True):
    """SkyReels-A2's mask construction, written out per its branches (2/3 references). For one reference
    A2 repeats the first frame 8 times, building F+7 mask frames that cannot be reshaped; diffusers' Wan
    I2V rule (repeat 4) is the expectation there."""
    extra = {1: 0, 2: 4, 3: 8 if repeat else 2}[num_images]  # first frame repeated 4 + extra
    skip = {1: 1, 2: 5, 3: 9 if repeat else 3}[num_images]
    m = torch.ones(num_frames)
    m[1:] = 0
    m = torch.cat([m[:1].repeat(4 + extra), m[skip:]])
    return m.view(-1, 4).T  # (4, T)


@pytest.mark.parametrize("repeats", [(1,), (1, 4), (1, 4, 4), (1, 1, 1)])
def test_prefix_before_mask_and_latents(vae, repeats):
    f = 21
    g = torch.Generator().manual_seed(0)
    refs = torch.rand(2, len(repeats), 3, H, W, generator=g) * 2 - 1
    with torch.no_grad():
        cond = prepare_latents(vae, make_layout("prefix", f, repeats, combine="before"), references=refs)
        # expected: the mini-video spelled out frame by frame, then zeros, encoded once
        frames = [refs[:, i] for i, k in enumerate(repeats) for _ in range(k)]
        frames += [torch.zeros_like(refs[:, 0])] * (f - sum(repeats))
        expected = encode_vae(vae, torch.stack(frames, dim=2))
    t = (f - 1) // 4 + 1
    assert cond.condition.shape == (2, 20, t, H // 8, W // 8)
    assert_rounding(cond.condition[:, 4:], expected, 64)  # encoded as a batch of 2 (each frame alone below)
    want = a2_mask(len(repeats), f, repeat=repeats != (1, 1, 1))
    assert torch.equal(cond.condition[:, :4, :, 0, 0], want[None].expand(2, -1, -1))
    assert (cond.condition[:, :4] == cond.condition[:, :4, :, :1, :1]).all()  # constant over space
    assert cond.num_ref_latents == (sum(repeats) - 1) // 4 + 1
    assert_rounding(cond.ref_latents, expected[:, :, : cond.num_ref_latents], 64)


def test_prefix_after_encodes_each_element_alone(vae):
    f, repeats = 21, (1, 4, 4)
    refs = torch.rand(1, 3, 3, H, W, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        cond = prepare_latents(vae, make_layout("prefix", f, repeats, combine="after"), references=refs)
        parts = [encode_vae(vae, refs[:, i, :, None].repeat(1, 1, k, 1, 1)) for i, k in enumerate(repeats)]
    lat = cond.condition[:, 4:]
    assert cond.num_ref_latents == 3  # 1 + (4-1)//4 + 1 ... one latent per element
    assert_rounding(lat[:, :, :3], torch.cat(parts, 2), 64)
    assert (lat[:, :, 3:] == 0).all()
    mask = cond.condition[0, :4, :, 0, 0]
    assert (mask[:, :3] == 1).all() and (mask[:, 3:] == 0).all()


def test_before_and_after_differ(vae):
    """Encoding the references together (before) lets the VAE's causal temporal convolutions mix the elements;
    alone (after) does not. The tiny model's VAE is set to per-frame block means (a2/model/tiny.py invertible_init),
    which mix nothing: a randomly initialised VAE of its shape does."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan.from_config(vae.config).eval()
    refs = torch.rand(1, 2, 3, H, W, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        a = prepare_latents(vae, make_layout("prefix", 13, (1, 4), combine="before"), references=refs).condition
        b = prepare_latents(vae, make_layout("prefix", 13, (1, 4), combine="after"), references=refs).condition
    assert a.shape == b.shape and (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("mode,flags", [
    ("first", [0]), ("first_and_last", [0, 16]), ("index", [5]), ("prefix", [0, 1, 2, 3, 4]),
])
def test_inplace_modes(vae, mode, flags):
    f = 17
    video = torch.rand(1, 3, f, H, W, generator=torch.Generator().manual_seed(3)) * 2 - 1
    idx = conditioning_frame_indices(mode, f, index=5, prefix=5)
    assert sorted(idx) == flags
    with torch.no_grad():
        cond = prepare_latents(vae, make_layout("inplace", f), video=video, cond_frame_indices=idx)
        kept = torch.zeros_like(video)
        kept[:, :, flags] = video[:, :, flags]
        expected = encode_vae(vae, kept)
    assert_rounding(cond.condition[:, 4:], expected, 64)
    # mask channel c of latent t is pixel frame 4t+c-3 (frame 0 fills all of latent 0)
    mask = cond.condition[0, :4, :, 0, 0]
    for t in range(mask.shape[1]):
        for c in range(4):
            frame = 0 if t == 0 else 4 * t + c - 3
            assert mask[c, t] == (1.0 if frame in flags else 0.0), (mode, t, c)
    assert cond.num_ref_latents == 0 and cond.ref_latents is None


def test_random_frame_is_a_function_of_the_generator():
    a = conditioning_frame_indices("random", 81, generator=torch.Generator().manual_seed(5))
    b = conditioning_frame_indices("random", 81, generator=torch.Generator().manual_seed(5))
    assert a == b and 0 <= a[0] < 81


def test_sample_mode_uses_generator(vae):
    refs = torch.rand(1, 1, 3, H, W) * 2 - 1
    with torch.no_grad():
        s1 = prepare_latents(vae, make_layout("prefix", 9, (1,)), references=refs, sample_mode="sample",
                             generator=torch.Generator().manual_seed(0)).condition
        s2 = prepare_latents(vae, make_layout("prefix", 9, (1,)), references=refs, sample_mode="sample",
                             generator=torch.Generator().manual_seed(0)).condition
        s3 = prepare_latents(vae, make_layout("prefix", 9, (1,)), references=refs, sample_mode="sample",
                             generator=torch.Generator().manual_seed(1)).condition
        m = prepare_latents(vae, make_layout("prefix", 9, (1,)), references=refs, sample_mode="argmax").condition
    assert torch.equal(s1, s2) and not torch.equal(s1, s3) and not torch.equal(s1, m)


def test_bad_inputs_raise(vae):
    refs = torch.zeros(1, 3, 3, H, W)
    with pytest.raises(ValueError, match="leaves no frame"):
        prepare_latents(vae, make_layout("prefix", 9, (1, 4, 4)), references=refs)
    with pytest.raises(ValueError, match=r"takes 2 reference image\(s\) for the element repeats \(1, 4\), got 3"):
        prepare_latents(vae, make_layout("prefix", 21, (1, 4)), references=refs)
    with pytest.raises(ValueError, match="takes element references"):
        prepare_latents(vae, make_layout("prefix", 21))


def test_frame_mask_matches_diffusers_rule():
    flags = torch.zeros(1, 9)
    flags[0, 0] = 1
    m = frame_mask(flags, (1, 1))[0, :, :, 0, 0]
    assert torch.equal(m, torch.tensor([[1.0, 0, 0]] * 4))


def test_expanded_t2v_equals_base(tiny_t2v_dir):
    from a2.model.transformer import expand_to_e2v, load_transformer

    base = load_transformer(tiny_t2v_dir).eval()
    e2v = expand_to_e2v(base, image_dim=32).eval()
    assert e2v.config.in_channels == 36 and e2v.config.image_dim == 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 3, 8, 8, generator=g)
    cond = torch.randn(1, 20, 3, 8, 8, generator=g)
    text = torch.randn(1, 512, 32, generator=g)
    image = torch.randn(1, 2 * 257, 32, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        want = base(x, t, text, return_dict=False)[0]
        got = e2v(torch.cat([x, cond], 1), t, text, encoder_hidden_states_image=image, return_dict=False)[0]
    assert_rounding(got, want, 256)  # a 36-channel patch embedding: other conv kernels
    # the new parameters are live: perturbing add_v_proj changes the output
    with torch.no_grad():
        e2v.blocks[0].attn2.add_v_proj.bias.fill_(1.0)
        moved = e2v(torch.cat([x, cond], 1), t, text, encoder_hidden_states_image=image, return_dict=False)[0]
    assert (moved - want).abs().max() > 1e-4


@pytest.mark.parametrize("name", PICTURES)
def test_preprocess_modes_keep_the_picture(name):
    image = picture(name)
    h, w = 480, 832
    iw, ih = image.size
    for mode in ("resize", "center_crop", "pad_white", "letterbox"):
        out = preprocess_image(image, mode, (h, w))
        assert out.size == (w, h), mode
    a = np.asarray(preprocess_image(image, "pad_white", (h, w)))
    b = np.asarray(preprocess_image(image, "letterbox", (h, w)))
    if ih / iw > h / w:  # taller than the target: bars left and right
        assert (a[:, :5] == 255).all() and (b[:, :5] == 0).all() and (a[:, -5:] == 255).all()
        inner = a[:, w // 2]
    else:  # wider: bars top and bottom
        assert (a[:5] == 255).all() and (b[:5] == 0).all() and (a[-5:] == 255).all()
        inner = a[h // 2]
    assert inner.std() > 1  # the picture itself, not padding
    # center_crop adds no border: it is the middle of the picture at the target aspect, resized
    # (compared at 1/8 size: the two roundings of the crop box may differ by a sub-pixel shift)
    small = (w // 8, h // 8)
    c = np.asarray(preprocess_image(image, "center_crop", (h, w)).resize(small, Image.BOX)).astype(float)
    cw, ch = (iw, iw * h / w) if ih / iw > h / w else (ih * w / h, ih)
    box = ((iw - cw) / 2, (ih - ch) / 2, (iw + cw) / 2, (ih + ch) / 2)
    ref = np.asarray(image.resize(small, Image.BOX, box=box)).astype(float)
    assert np.abs(c - ref).mean() < 4.0
    # square CLIP path (A2: pad_white to 512x512)
    sq = np.asarray(preprocess_image(image, "pad_white", (512, 512)))
    assert sq.shape == (512, 512, 3)
    if iw != ih:
        edge = sq[:, :3] if ih > iw else sq[:3]
        assert (edge == 255).all()


def test_pil_to_tensor_range():
    x = pil_to_tensor(Image.fromarray(np.array([[[0, 255, 128]]], dtype=np.uint8)))
    assert x.shape == (3, 1, 1) and x[0].item() == -1.0 and x[1].item() == 1.0


def test_a2_checkpoint_extra_norm_added_q_is_ignored(tiny_dir, tmp_path):
    """SkyReels-A2's transformer files carry `norm_added_q` weights diffusers' Wan has no module for."""
    import shutil

    from safetensors.torch import load_file, save_file

    from a2.model.transformer import load_transformer

    src = tiny_dir / "transformer"
    dst = tmp_path / "transformer"
    shutil.copytree(src, dst)
    f = dst / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    sd["blocks.0.attn2.norm_added_q.weight"] = torch.ones(128)
    save_file(sd, f)
    a, b = load_transformer(tiny_dir).eval(), load_transformer(tmp_path).eval()
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert not any("norm_added_q" in k for k in b.state_dict())


def a2_reference(image: Image.Image, mode: str, h: int, w: int) -> Image.Image:
    """SkyReels-A2's infer.py preprocessing built by hand: white padding (same on both sides, truncated) or a
    centred crop to the target aspect, then one PIL resize with its default filter (bicubic). letterbox: black."""
    iw, ih = image.size
    if mode in ("pad_white", "letterbox"):
        fill = 255 if mode == "pad_white" else 0
        if ih / iw < h / w:
            pad = int((h / w * iw - ih) / 2.0)
            padded = np.full((ih + 2 * pad, iw, 3), fill, np.uint8)
            padded[pad:pad + ih] = np.asarray(image)
        else:
            pad = int((w / h * ih - iw) / 2.0)
            padded = np.full((ih, iw + 2 * pad, 3), fill, np.uint8)
            padded[:, pad:pad + iw] = np.asarray(image)
        return Image.fromarray(padded).resize((w, h))
    if ih / iw < h / w:
        cw = int(ih / h * w)
        return image.crop(((iw - cw) // 2, 0, (iw - cw) // 2 + cw, ih)).resize((w, h))
    ch = int(iw / w * h)
    return image.crop((0, (ih - ch) // 2, iw, (ih - ch) // 2 + ch)).resize((w, h))


def synthetic(iw: int, ih: int) -> Image.Image:
    g = torch.Generator().manual_seed(iw * 1000 + ih)
    return Image.fromarray(torch.randint(0, 256, (ih, iw, 3), generator=g, dtype=torch.uint8).numpy())


@pytest.mark.parametrize("size", [(480, 832), (512, 512), (832, 480)])
def test_preprocess_is_a2s_pad_or_crop_then_resize(size):
    h, w = size
    images = [picture(name) for name in PICTURES]
    images += [synthetic(301, 97), synthetic(97, 301), synthetic(416, 240)]  # wider, taller, exactly 480:832
    for image in images:
        for mode in ("pad_white", "center_crop", "letterbox"):
            got, want = preprocess_image(image, mode, (h, w)), a2_reference(image, mode, h, w)
            assert np.array_equal(np.asarray(got), np.asarray(want)), (image.size, mode, size)


def test_video_frames_are_framed_like_reference_images():
    """a2.images.resize_frames (torch, uint8) crops/pads like preprocess_image (PIL): the same geometry, so the two
    differ only by the two libraries' bicubic rounding, not by a shifted or rescaled picture."""
    from a2.images import resize_frames

    for iw, ih in ((301, 97), (97, 301)):
        image = synthetic(iw, ih).filter(__import__("PIL.ImageFilter").ImageFilter.GaussianBlur(3))
        for mode in ("center_crop", "pad_white", "letterbox", "resize"):
            pil = pil_to_tensor(preprocess_image(image, mode, (48, 80)))
            frames = resize_frames(np.array(image)[None], mode, (48, 80))[:, 0]
            assert (pil - frames).abs().mean() < 0.02, (iw, ih, mode)


def test_latents_are_scaled_by_the_reciprocal_std(vae):
    """`(z - mean) * (1 / std)` and back `z / (1 / std) + mean`, bit for bit as SkyReels-A2 and diffusers."""
    from a2.pipeline import decode_vae

    x = torch.rand(1, 3, 5, H, W) * 2 - 1
    z = vae.encode(x).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    assert torch.equal(encode_vae(vae, x), (z - mean) * inv_std)
    latents = torch.randn(1, 16, 2, H // 8, W // 8)
    want = vae.decode(latents / inv_std + mean, return_dict=False)[0].clamp(-1, 1)
    assert torch.equal(decode_vae(vae, latents), want)


def a2_named(model_dir, tmp_path):
    """A copy of a tiny Wan2.1 I2V dir named as SkyReels-A2 ships (its pipeline and transformer classes)."""
    import json
    import shutil

    d = tmp_path / "a2"
    shutil.copytree(model_dir, d)
    for f, name in ((d / "model_index.json", "A2Pipeline"), (d / "transformer" / "config.json", "A2Model")):
        f.write_text(json.dumps({**json.loads(f.read_text()), "_class_name": name}))
    return d


# SkyReels-A2's infer.py (SkyworkAI/SkyReels-A2 7c14e2e), which takes no flag: its negative prompt (:19), seed (:24),
# UniPC at flow_shift 8 (:47), guidance 5 (:84), 50 steps (:87)
A2_NEGATIVE = ("Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, "
               "static, overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra "
               "fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, "
               "still picture, messy background, three legs, many people in the background, walking backwards")
A2_SEED, A2_SHIFT, A2_GUIDE, A2_STEPS = 42, 8, 5.0, 50


@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_equals_a2s_own_sampling(tiny_dir, n, tmp_path):
    """infer.py on an A2 dir (A2's names; its scheduler config shipping shift 3, which A2's infer.py overrides) with
    only its images, prompt, size and frames == SkyReels-A2's infer.py + pipeline, written out here step by step at
    its hard-coded settings (its preprocessing; noise drawn first, then the condition's posterior sampled with the
    same generator; `(z - mean) * (1 / std)`; its per-branch mask; text-only CFG 5 with the same image tokens and
    its English negative prompt; UniPC at shift 8, 50 steps, seed 42), with the same transformer: bit for bit. (A2's
    own transformer class applies RoPE in float64; diffusers' in float32.) The elements are drawn, none square: a
    person on white wider than the video (padded above and below), an odd-width portrait one (padded left and right,
    unevenly) and a portrait scene (cropped)."""
    import json

    from diffusers import UniPCMultistepScheduler

    import infer
    from a2.pipeline import A2Pipeline, encode_prompt

    model = a2_named(tiny_dir, tmp_path)
    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "flow_shift": 3.0}))
    pipe = A2Pipeline.from_pretrained(model)  # A2's weights: A2's sampler, by its name
    h, w, f, prompt = 32, 48, 21, "a man in the forest"
    paths = [tmp_path / f"{name}.png" for name in ("human", "thing", "env")][:n]
    for i, (path, size, background) in enumerate(zip(paths, ((720, 1280), (1250, 999), (1920, 1080)),
                                                     ("white", "white", "scene"))):
        drawn_person(size, seed=i, background=background).save(path)
    g = torch.Generator().manual_seed(A2_SEED)
    with torch.no_grad():
        latents = torch.randn(1, 16, (f - 1) // 4 + 1, h // 8, w // 8, generator=g)
        vae, clip = [], []
        for i, p in enumerate(paths):
            image = Image.open(p).convert("RGB")
            clip.append(a2_reference(image, "pad_white", 512, 512))
            vae.append(pil_to_tensor(a2_reference(image, "center_crop" if i == 2 else "pad_white", h, w)))
        repeats = (1, 4) if n == 2 else (1, 4, 4)
        frames = [v for v, r in zip(vae, repeats) for _ in range(r)]
        video = torch.stack(frames + [torch.zeros(3, h, w)] * (f - sum(repeats)), 1)[None]
        z = pipe.vae.encode(video).latent_dist.sample(g)
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
        z = (z - mean) * (1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1))
        flags = torch.zeros(f + 3)  # A2: the first flag repeated 4 + (4 | 8) times, then frames 5 | 9 on (zeros)
        flags[:3 + sum(repeats)] = 1
        mask = flags.view(-1, 4).T[None, :, :, None, None].expand(1, 4, -1, h // 8, w // 8)
        condition = torch.cat([mask, z], 1)
        text = encode_prompt(pipe.tokenizer, pipe.text_encoder, [prompt, A2_NEGATIVE])
        image_tokens = torch.cat([pipe.image_encoder(**pipe.image_processor(images=c, return_tensors="pt"),
                                                     output_hidden_states=True).hidden_states[-2] for c in clip], 1)
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=A2_SHIFT)
        sched.set_timesteps(A2_STEPS)
        for t in sched.timesteps:
            x = torch.cat([latents, condition], 1)
            cond, uncond = (pipe.transformer(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=e[None],
                                             encoder_hidden_states_image=image_tokens, return_dict=False)[0]
                            for e in text)
            latents = sched.step(uncond + A2_GUIDE * (cond - uncond), t, latents, return_dict=False)[0]
    assert infer.main(infer.InferConfig.from_flags(model=str(model), elements=tuple(map(str, paths)), prompt=prompt,
                                                   height=h, width=w, num_frames=f, device="cpu", decode="none",
                                                   save_latents=str(tmp_path / "a2.pt"))) == 0
    out = torch.load(tmp_path / "a2.pt")
    assert torch.equal(out["condition"], condition)
    assert torch.equal(out["latents"], latents)
