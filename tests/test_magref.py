"""MAGREF's reference canvas (a2.images.magref_canvas) against MAGREF's own rule, written out here as its
magref/subject2video.py (MAGREF-Video/MAGREF e3c71b2) runs it: process_refimg's grid, shuffles and paste, and
resize_and_pad's fit-and-centre with white padding and its 0/1 mask. On drawn persons of the SkyReels-A2 example
photos' sizes (a landscape, a square and a portrait picture)."""

import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import train_a2
from a2.config.dataset_config import ConditioningConfig
from a2.images import magref_canvas
from a2.kinds.kinds import kind_sampling
from config import from_flags, with_flags
from tests.conftest import drawn_person

PHOTOS = ((720, 1280), (1250, 1250), (1920, 1080))  # (h, w): the SkyReels-A2 photos' sizes (human, thing, env)
MAGREF = ConditioningConfig(reference_layout="magref")


def their_canvas(images, height, width):
    """MAGREF's process_refimg + resize_and_pad, step by step, with Python's global random as it uses it."""
    n = len(images)
    scale = min([s for s in [1, 2, 3, 4, 6, 8] if s >= n], default=8)
    W, H = width, height
    if scale == 1:
        layout = [(0, 0, W, H)]
    elif scale == 2:
        layout = [(0, 0, W // 2, H), (W // 2, 0, W, H)]
    elif scale == 3:
        b = W // 3
        layout = [(0, 0, b, H), (b, 0, 2 * b, H), (2 * b, 0, W, H)]
    elif scale == 4:
        bw, bh = W // 2, H // 2
        layout = [(0, 0, bw, bh), (bw, 0, W, bh), (0, bh, bw, H), (bw, bh, W, H)]
    elif scale == 6:
        bw, bh = W // 3, H // 2
        layout = [(0, 0, bw, bh), (bw, 0, 2 * bw, bh), (2 * bw, 0, W, bh),
                  (0, bh, bw, H), (bw, bh, 2 * bw, H), (2 * bw, bh, W, H)]
    else:
        bw, bh = W // 4, H // 2
        layout = [(0, 0, bw, bh), (bw, 0, 2 * bw, bh), (2 * bw, 0, 3 * bw, bh), (3 * bw, 0, W, bh),
                  (0, bh, bw, H), (bw, bh, 2 * bw, H), (2 * bw, bh, 3 * bw, H), (3 * bw, bh, W, H)]
    canvas = Image.new("RGB", (W, H), (255, 255, 255))
    mask = np.zeros((H, W), dtype=np.uint8)
    indices = list(range(n))
    random.shuffle(indices)
    random.shuffle(layout)
    for i, (x0, y0, x1, y1) in zip(indices[:len(layout)], layout):
        img = images[i].convert("RGB")
        tw, th = x1 - x0, y1 - y0
        img_ratio, target_ratio = img.width / img.height, tw / th
        if img_ratio > target_ratio:
            new_w = tw
            new_h = int(new_w / img_ratio)
        else:
            new_h = th
            new_w = int(new_h * img_ratio)
        img = img.resize((new_w, new_h), Image.Resampling.LANCZOS)
        pw, ph = tw - new_w, th - new_h
        padding = (pw // 2, ph // 2, pw - pw // 2, ph - ph // 2)
        block = ImageOps.expand(img, padding, fill=(255, 255, 255))
        block_mask = ImageOps.expand(Image.new("L", (new_w, new_h), color=1), padding, fill=0)
        mask[y0:y1, x0:x1] = np.asarray(block_mask, dtype=np.uint8)
        canvas.paste(block, (x0, y0))
    return canvas, mask


def their_latent_mask(mask, factor=8):
    """process_refimg's downsample_mask: a latent cell is 1 when any pixel of its 8x8 patch is."""
    h, w = mask.shape
    out = np.zeros((h // factor, w // factor), dtype=np.uint8)
    for i in range(h // factor):
        for j in range(w // factor):
            out[i, j] = mask[i * factor:(i + 1) * factor, j * factor:(j + 1) * factor].any()
    return out


@pytest.fixture(scope="module")
def photos():
    return [drawn_person(size, seed=i, background="white" if i == 1 else "scene") for i, size in enumerate(PHOTOS)]


@pytest.mark.parametrize("n,seed", [(1, 0), (2, 1), (3, 2), (3, 7), (5, 3), (8, 4)])
def test_canvas_is_magrefs(photos, n, seed):
    """1-8 references (the three pictures repeated) at MAGREF's 480x832: the same canvas pixels and mask as MAGREF's
    rule after random.seed(seed), with random.Random(seed); the latent mask of the spec (max-pool 8) is theirs."""
    images = [photos[i % 3] for i in range(n)]
    random.seed(seed)
    want_canvas, want_mask = their_canvas(images, 480, 832)
    canvas, mask = magref_canvas(images, (480, 832), rng=random.Random(seed))
    assert canvas.size == (832, 480) and mask.shape == (480, 832) and mask.dtype == torch.bool
    assert np.array_equal(np.asarray(canvas), np.asarray(want_canvas))
    assert np.array_equal(mask.numpy(), want_mask.astype(bool))
    assert 0 < mask.sum() < mask.numel() or n == 1  # white margins exist unless one picture fills the canvas
    assert (np.asarray(canvas)[~mask.numpy()] == 255).all()  # outside the references: white
    pooled = torch.nn.functional.max_pool2d(mask[None, None].float(), 8)[0, 0]
    assert np.array_equal(pooled.numpy().astype(np.uint8), their_latent_mask(want_mask))


def test_canvas_without_rng_places_in_order(photos):
    """rng=None: reference i in block i (left to right), which is MAGREF's placement when the shuffles leave the
    order unchanged; at another video size (the grid follows the size)."""
    canvas, mask = magref_canvas(photos, (256, 384))
    third = 384 // 3
    for i, photo in enumerate(photos):
        cols = mask[:, i * third:(i + 1) * third if i < 2 else 384].any(0).nonzero()
        rows = mask[:, i * third:(i + 1) * third if i < 2 else 384].any(1).nonzero()
        w, h = int(cols.max() - cols.min() + 1), int(rows.max() - rows.min() + 1)
        assert abs(w / h - photo.width / photo.height) < 0.05  # aspect kept, each in its own block


def test_canvas_bad_input(photos):
    with pytest.raises(ValueError, match=r"^a\.png, .*at most 8$"):
        magref_canvas([photos[0]] * 9, (480, 832), names=["a.png"] + ["b.png"] * 8)
    with pytest.raises(ValueError, match="no references"):
        magref_canvas([], (480, 832))
    strip = Image.new("RGB", (3000, 100), (10, 20, 30))  # 277 px wide in a third of 832 -> 9 px high
    with pytest.raises(ValueError, match=r"^strip\.png: a 3000x100 reference is 277x9 px in its 277x480 block .*"
                                         r"fewer references$"):
        magref_canvas([photos[0], strip, photos[1]], (480, 832), names=["h.png", "strip.png", "t.png"])
    canvas, mask = magref_canvas([strip], (480, 832))  # alone it has the whole width: 832x27
    assert mask.sum() == 832 * 27


# ---------------------------------------------------------------- MAGREF's sampler, written out

# MAGREF's defaults as its entry point runs, read from MAGREF-Video/MAGREF e3c71b2 (not from a2): generate.py's
# argparse (--sample_steps 40, --sample_shift 3.0, --sample_guide_scale 5.0, --base_seed 3407, --frame_num 81),
# magref/configs/magref_14B.py:10 (sample_neg_prompt = "镜头晃动，" + Wan's shared one) and
# magref/configs/shared_config.py:17-18 (sample_fps 15, Wan's negative prompt)
THEIR_STEPS, THEIR_SHIFT, THEIR_GUIDE, THEIR_SEED, THEIR_FPS = 40, 3.0, 5.0, 3407, 15
THEIR_NEGATIVE = ("镜头晃动，色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，"  # noqa: RUF001
                  "最差质量，低质量，JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，"  # noqa: RUF001
                  "畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，"  # noqa: RUF001
                  "倒着走")


def their_magref_sample(transformer, vae, clip, clip_mean, clip_std, refs, text, text_null, num_frames, height,
                        width, steps=THEIR_STEPS, seed=THEIR_SEED, shift=THEIR_SHIFT, guide=THEIR_GUIDE):
    """MagRefModel.generate (magref/subject2video.py:337-551) for `refs` with random.seed(seed) placement (MAGREF
    never seeds Python's random: its placement is random; a2 places by the seed), at generate.py's defaults: their
    canvas (their_canvas) -> TF.to_tensor(...).sub_(0.5).div_(0.5); noise torch.randn(16, T, h, w) before the VAE;
    y = VAE([canvas, F-1 zero frames]) posterior mean, normalised; mask: the latent region mask on pixel frame 0,
    frame 0 repeated 4x, read as (T, 4) -> 4 channels of latent frame 0; CLIP of the canvas squashed to 224 (torch
    bicubic, no crop), Normalize, penultimate layer; FlowUniPC (order 2, bh2) on their schedule, shift 3; CFG
    uncond + 5·(cond - uncond) with clip and y in both, uncond on text_null (their config's negative prompt);
    decode, the first 4 frames dropped (generate.py:213-215). Their WanModel is diffusers' WanTransformer3DModel with
    the original keys converted (the DiT is plain Wan 2.1 I2V): `x = cat([noisy, y])` on the channel axis is
    hidden_states here, clip_fea encoder_hidden_states_image. Their `81` is the frame count here (they hard-code it:
    another frame count fails in theirs)."""
    import torchvision.transforms as T

    from tests import their_samplers as theirs

    random.seed(seed)
    canvas, mask = their_canvas(refs, height, width)
    img = theirs.pixels(canvas)  # (3, H, W)
    lat_t, lat_h, lat_w = (num_frames - 1) // 4 + 1, height // 8, width // 8
    noise = torch.randn(16, lat_t, lat_h, lat_w, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    msk = torch.zeros(1, num_frames, lat_h, lat_w)
    msk[:, :1] = torch.from_numpy(their_latent_mask(mask)).float()
    msk = torch.cat([torch.repeat_interleave(msk[:, 0:1], repeats=4, dim=1), msk[:, 1:]], dim=1)
    msk = msk.view(1, msk.shape[1] // 4, 4, lat_h, lat_w).transpose(1, 2)[0]  # (4, T, h, w)
    frames = torch.cat([torch.nn.functional.interpolate(img[None], size=(height, width), mode="bicubic")
                        .transpose(0, 1), torch.zeros(3, num_frames - 1, height, width)], dim=1)
    y = theirs.normalise(vae, vae.encode(frames[None]).latent_dist.mean)[0]
    y = torch.cat([msk, y])  # (20, T, h, w)
    x = torch.nn.functional.interpolate(img[None], size=(224, 224), mode="bicubic", align_corners=False)
    x = T.Normalize(clip_mean, clip_std)(x.mul_(0.5).add_(0.5))
    clip_fea = clip(pixel_values=x, output_hidden_states=True).hidden_states[-2]
    sigmas, timesteps = theirs.shifted(theirs.phantom_sigmas(steps), shift)
    solver, latent = theirs.FlowUniPC(sigmas), noise
    for t in timesteps:
        t = torch.stack([t])
        inp = torch.cat([latent, y])[None]
        cond = transformer(hidden_states=inp, timestep=t, encoder_hidden_states=text,
                           encoder_hidden_states_image=clip_fea, return_dict=False)[0][0]
        uncond = transformer(hidden_states=inp, timestep=t, encoder_hidden_states=text_null,
                             encoder_hidden_states_image=clip_fea, return_dict=False)[0][0]
        latent = solver.step(uncond + guide * (cond - uncond), latent)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    video = vae.decode(latent[None] / std + mean, return_dict=False)[0].clamp(-1, 1)
    return dict(condition=y[None], image=clip_fea, latents=latent[None], video=video[:, :, 4:])


@pytest.fixture(scope="module")
def magref_parts():
    from a2.pipeline import A2Pipeline

    return A2Pipeline.from_pretrained("tiny-magref")


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("seed", [None, 5])
def test_infer_samples_as_magref(magref_parts, n, seed, tmp_path):
    """infer.py on a MAGREF checkpoint (tiny-magref's files, given by path: a model as released, not the built-in
    name's smoke-test defaults) with only the flags MAGREF's generate.py takes (the prompt, the images, the size and
    frame count, and --seed or not) == MAGREF's sampler written out at generate.py's defaults: the same condition
    (mask | canvas latents) and final latents for 1, 2 and 3 references, with its --base_seed 3407 when no --seed is
    given. Everything MAGREF fixes comes from the kind (a2.kinds.kinds.KIND_DEFS["magref"]): its UniPC from sigma
    0.999, shift 3, 40 steps, its negative prompt, the posterior mean of the canvas, the seed's placement (of the
    noise's seed). The references are synthetic photos of other aspects than their blocks' and the video's, read by
    infer.py and given to theirs as read."""
    import infer
    from a2.images import read_image
    from a2.pipeline import encode_prompt
    from tests.test_released_models import synthetic

    pipe, h, w, f, prompt = magref_parts, 48, 96, 9, "a person holds a thing"
    files = []
    for i, size in enumerate([(120, 100), (100, 130), (90, 90)][:n]):
        synthetic(*size, 30 + i).save(tmp_path / f"ref{i}.png")
        files.append(tmp_path / f"ref{i}.png")
    text, null = (encode_prompt(pipe.tokenizer, pipe.text_encoder, [p]) for p in (prompt, THEIR_NEGATIVE))
    proc = pipe.image_processor
    with torch.no_grad():
        want = their_magref_sample(pipe.transformer, pipe.vae, pipe.image_encoder, proc.image_mean, proc.image_std,
                                   [read_image(p) for p in files], text, null, f, h, w,
                                   seed=THEIR_SEED if seed is None else seed)
    cfg = infer.InferConfig.from_flags(model=str(pipe.info.path), elements=tuple(map(str, files)), prompt=prompt,
                                       height=h, width=w, num_frames=f, seed=seed, device="cpu", decode="none",
                                       save_latents=str(tmp_path / "ours.pt"))
    assert infer.main(cfg) == 0
    got = torch.load(tmp_path / "ours.pt")
    assert torch.equal(got["condition"], want["condition"])
    assert got["condition"][:, :4, 0].amax() == 1  # the region mask on latent frame 0
    diff = (got["latents"] - want["latents"]).abs().max().item()
    assert diff <= 1e-5, diff
    if seed == 5 and n == 3:  # and it can fail: another seed moves the canvas and the noise
        cfg.sampling.seed, cfg.parity.save_latents = seed + 1, str(tmp_path / "other.pt")
        assert infer.main(cfg) == 0
        assert (torch.load(tmp_path / "other.pt")["latents"] - want["latents"]).abs().max() > 1e-2


def test_magref_samples_with_its_scripts_defaults():
    """The magref kind's own sampler is MAGREF's generate.py and configs as read (THEIR_*: MAGREF-Video/MAGREF e3c71b2
    generate.py --sample_steps / --sample_shift / --sample_guide_scale / --base_seed, magref/configs/magref_14B.py's
    negative prompt, shared_config.py's fps), not the model dir's shift."""
    own = kind_sampling("magref", "MAGREF")
    assert (own.steps, own.flow_shift, own.guidance_scale, own.seed, own.fps) == (
        THEIR_STEPS, THEIR_SHIFT, THEIR_GUIDE, THEIR_SEED, THEIR_FPS)
    assert own.negative_prompt == THEIR_NEGATIVE and own.seeded_placement and own.encode_mode == "argmax"


def test_magref_checkpoint_loads_and_refusals(tmp_path, data_dir):
    """tiny-magref (MAGREF's release layout: original-Wan DiT shards + index and a Wan VAE .pth beside them) is
    detected as MAGREF, its DiT loads through original_to_diffusers to the tiny I2V weights; the kind's refusals
    are one line naming the fix."""
    import shutil

    from a2.cli import ConfigError
    from a2.model.tiny import model_path
    from a2.model.transformer import UnsupportedModel, detect_model, load_transformer
    from a2.plan import sampling_plan

    d = model_path("tiny-magref")
    info = detect_model(d)
    assert (info.name, info.native_kind, info.in_channels, info.image_branch) == ("MAGREF", "magref", 36, True)
    assert [p.name for p in info.original_weights] == [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors"
                                                       for i in (1, 2)]  # not Wan2.1_VAE.pth
    got, want = load_transformer(d).state_dict(), load_transformer(model_path("tiny")).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    bare = tmp_path / "magref"  # the DiT without the Wan I2V parts, components not given and no Hub
    bare.mkdir()
    for p in d.iterdir():
        if p.is_file():
            shutil.copy(p, bare / p.name)
    with pytest.raises(UnsupportedModel, match=r"parts dir .* has no vae, text_encoder, .*Wan2.1-I2V-14B-480P") as e:
        detect_model(bare, components=tmp_path / "no-such" / "Wan-AI" / "parts")
    assert "\n" not in str(e.value)
    assert detect_model(bare, components=d).components_dir == d
    cfg = from_flags(model="tiny-t2v", data_root=str(data_dir), conditioning=MAGREF, num_frames=9,
                      resolution=(32, 64), device="cpu")
    with pytest.raises(ConfigError, match=r"16 input channels: reference_layout magref is MAGREF's Wan I2V layout"):
        train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
    cfg = from_flags(model="tiny-magref", data_root=str(data_dir), conditioning=MAGREF, num_frames=9,
                      resolution=(48, 48), device="cpu", cache_dir=str(tmp_path / "c"))  # 3 elements: 16 px each
    layout = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu")).layout  # a cache too
    assert (layout.kind, layout.clip_frames, layout.ref_latents, layout.use_clip) == ("magref", 8, 1, True)
    assert layout.cacheable
    with pytest.raises(ValueError, match="MAGREF's Wan I2V layout"):
        sampling_plan(detect_model(model_path("tiny-t2v")), (1,), MAGREF, 9)


MAGREF_ELEMENTS = ("subject=_person.png:repeat=1", "object=_object.png:repeat=1")


def test_a_canvas_that_cannot_hold_an_element_is_refused_in_one_line(data_dir, tmp_path, monkeypatch):
    """More than 8 elements are refused by the plan (train_a2.py, infer.py) before anything loads. Whether an image
    is a token (16 px) on each side once placed depends on its aspect, so that is checked as the images load, in one
    line naming the file: inference (infer.py, before any weights load), --val-elements (in the plan), and a
    training sample (the failed item's problem line, naming the sample and the file)."""
    import shutil

    import infer
    from a2.cli import ConfigError
    from a2.pipeline import A2Pipeline
    from data import E2VDataset

    def plan(cfg):
        return train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))

    cfg = from_flags(model="tiny-magref", data_root=str(data_dir), conditioning=MAGREF, num_frames=9,
                      resolution=(32, 32), device="cpu", elements=MAGREF_ELEMENTS)
    layout = plan(cfg).layout
    nine = tuple(f"e{i}=_e{i}.png" for i in range(9))
    with pytest.raises(ConfigError, match=r"^elements e0, e1, .*, e8: MAGREF's canvas places at most 8 .*got 9: "
                                          r"keep at most 8$"):
        plan(with_flags(cfg, elements=nine, resolution=(480, 832)))

    strip = tmp_path / "strip.png"  # 3000x100: 16x0 px in a 16x32 block of a 32x32 canvas of two
    Image.new("RGB", (3000, 100), (10, 20, 30)).save(strip)
    person = str(data_dir / "000_person.png")
    line = rf"{strip}: a 3000x100 reference is 16x0 px in its 16x32 block of MAGREF's 32x32 canvas \(2 references\)"

    def no_loading(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(A2Pipeline, "from_pretrained", no_loading)
    with pytest.raises(ValueError, match=rf"^{line}, under 16 px: .*fewer references$") as e:
        infer.main(infer.InferConfig.from_flags(model="tiny-magref", elements=(person, str(strip)), height=32, width=32,
                                                num_frames=9, device="cpu", conditioning=MAGREF))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=rf"^--val-elements: {line}"):
        plan(with_flags(cfg, val_elements=(person, str(strip))))

    d = tmp_path / "data"
    shutil.copytree(data_dir, d)
    shutil.copy(strip, d / "001_object.png")
    ds = E2VDataset(train_a2.run_datasets(with_flags(cfg, data_root=str(d))), layout.clip_frames, verbose=False,
                    layout=layout)  # the sizes the scan read: left out before step 1, never loaded
    assert [str(p) for p in ds.left_out] == [f"001: {d / '001.mp4'}: {d / '001_object.png'}: a 3000x100 reference "
                                             f"is 16x0 px in its 16x32 block of MAGREF's 32x32 canvas (2 references), "
                                             "under 16 px: crop it nearer the block's aspect or pass fewer references"]
    assert "001" not in [x.id for x in ds.samples] and "failed" not in ds[0]


def test_a_portrait_reference_on_a_landscape_video_covers_what_magref_covers(tmp_path):
    """A portrait picture (a drawn person, 1080x1920) as the one reference of a 48x96 video: the canvas and its region
    mask are MAGREF's rule's on the picture as read (fitted to the height, aspect kept: 27x48 px in the middle), the
    same from the dataset (training) as from load_references (sampling); not the whole canvas, which the picture framed
    to the video's size first would cover."""
    from a2.config.dataset_config import DatasetConfig
    from a2.elements import A2_ELEMENTS
    from a2.images import load_references, pil_to_tensor, read_image
    from a2.kinds.conditioning import make_layout
    from data import E2VDataset, make_synthetic_dataset

    subject = A2_ELEMENTS[0]
    d = make_synthetic_dataset(tmp_path / "data", num_samples=1, num_frames=9, size=(48, 96), elements=(subject,))
    drawn_person(PHOTOS[2]).save(d / "000_person.png")
    layout = make_layout("magref", 9, (1,), e2v_type="dual")
    random.seed(0)
    canvas, mask = their_canvas([read_image(d / "000_person.png")], 48, 96)
    refs, _, _, region = load_references([(subject, d / "000_person.png")], (48, 96), (64, 64), layout)
    item = E2VDataset([DatasetConfig(str(d), target_resolution=(48, 96), elements=(subject,))], layout.clip_frames,
                      verbose=False, layout=layout)[0]
    assert torch.equal(region[0], torch.from_numpy(mask.astype(bool))) and torch.equal(item["region"], region[0])
    assert torch.equal(refs[0, 0], pil_to_tensor(canvas)) and torch.equal(item["ref_vae"], refs[0])
    cols = region[0].any(0).nonzero()
    assert region[0].sum() == 27 * 48 and (int(cols.min()), int(cols.max())) == (34, 60)  # the picture, centred


def test_train_lora_export_infer_round_trip_and_full(data_dir, tmp_path):
    """MAGREF trained from an E2V dataset with train_a2.py (LoRA; full fine-tuning runs too), its exported LoRA read
    by infer.py on tiny-magref with the magref kind: the LoRA changes the video, repeatably."""
    import json

    import infer
    from tests.conftest import args, train

    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png"))
    kind = ("--reference-layout", "magref", "--num-frames", "9", "--elements", *MAGREF_ELEMENTS)
    r = train(*args(data_dir, tmp_path, "mr", "--max-steps", "2", "--lr", "5e-2", "--warmup-steps", "0", *kind,
                    model="tiny-magref"))
    layout = json.loads((r["run_dir"] / "run.json").read_text())["layout"]
    assert (layout["kind"], layout["clip_frames"], layout["use_clip"]) == ("magref", 8, True)
    base = dict(model="tiny-magref", elements=els, element_specs=MAGREF_ELEMENTS, height=32, width=32, num_frames=9,
                steps=2, device="cpu", conditioning=MAGREF, out=str(tmp_path / "v.mp4"))
    assert infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "base.pt"))) == 0
    saved = torch.load(tmp_path / "base.pt")
    assert saved["latents"].shape == (1, 16, 3, 4, 4) and saved["condition"].shape == (1, 20, 3, 4, 4)
    lora = dict(base, lora=str(r["weights"]))
    # the LoRA changes the video
    assert infer.main(infer.InferConfig.from_flags(**lora, save_latents=str(tmp_path / "lora.pt"),
                                                   compare=str(tmp_path / "base.pt"))) == 1
    assert infer.main(infer.InferConfig.from_flags(**lora, compare=str(tmp_path / "lora.pt"), tolerance=0.0)) == 0
    full = train(*args(data_dir, tmp_path, "full", "--max-steps", "1", "--training-type", "full", *kind,
                       model="tiny-magref"))
    rec = [json.loads(line) for line in (full["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in rec if "loss" in x]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses)


# ---------------------------------------------------------------- an a2 LoRA in MAGREF's checkpoint


def test_a2_lora_in_magrefs_checkpoint(tmp_path):
    """A LoRA trained in a2 on MAGREF (peft on diffusers names, train_a2.py's default targets: attention with the
    image K/V, FFN) and exported by a2/train/lora.py: MAGREF's code loads no LoRA; its original-key file (ComfyUI's /
    Wan's loaders) merged into MAGREF's original-Wan checkpoint as W + up·down and read back gives a2's forward within
    1e-5 of its largest value (merging re-associates (W + BA)x as Wx + B(Ax) in float32: a few ulps per product, through
    2 blocks); diffusers' loader of the same file gives it bit for bit.

    MAGREF's own class (magref/modules/model.py WanModel, MAGREF-Video/MAGREF e3c71b2) was run once outside the suite
    (tests/their_magref_check.py: it needs their code, which calls flash_attention directly, and that asserts CUDA;
    attention replaced by float32 SDPA with their k_lens mask; CLIP width 1280, hard-coded in their MLPProj, else
    these tiny shapes, random weights): the merged checkpoint loads into it strictly, and its forward against a2's
    peft forward differs by max 3.0e-6 with the LoRA and 3.3e-6 without (outputs of max 2.23: 1.4e-6 relative),
    where the LoRA moves the output by 0.062; float32 rounding of a different order of operations (their float64
    sinusoid and complex128 RoPE are not it: either computed in float32 leaves 3.2e-6), on this 2-core CPU."""
    import copy

    from diffusers.loaders import WanLoraLoaderMixin
    from peft import LoraConfig
    from safetensors.torch import load_file

    from a2.model.tiny import model_path
    from a2.model.transformer import load_transformer
    from a2.train.lora import export_lora
    from config import LORA_TARGETS
    from tests.test_released_models import merged_original

    d = model_path("tiny-magref")
    model = load_transformer(d)
    torch.manual_seed(0)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))  # scale 1: the loaders' convention
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 36, 3, 4, 6, generator=g), torch.tensor([700])  # noisy | mask | canvas latents
    text, image = torch.randn(1, 512, 32, generator=g), torch.randn(1, 257, 32, generator=g)

    def forward(m):
        with torch.no_grad():
            return m(hidden_states=x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=image,
                     return_dict=False)[0]

    want = forward(model)
    _, comfy_file = export_lora(tmp_path, model)
    assert {"diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight",
            "diffusion_model.blocks.1.cross_attn.v_img.lora_up.weight"} <= load_file(comfy_file).keys()  # Wan's names
    got = forward(merged_original(d, comfy_file))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert (got - forward(load_transformer(d))).abs().max() > 1e-3  # the LoRA matters
    m = copy.deepcopy(load_transformer(d))  # owned storage, as in test_released_models
    m.load_lora_adapter(WanLoraLoaderMixin.lora_state_dict(str(comfy_file)), prefix="transformer")
    assert torch.equal(forward(m), want)
