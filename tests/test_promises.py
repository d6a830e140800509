"""What `infer.py` with no sampling flag really samples with, held against the number in each lab's own code.

Each row below is written from the lab's entry point as a user runs it (file:line beside each value, in the
repository and commit docs/kinds.md names), never read from a2's `Kind` / `Sampling` table: the test runs infer.main
on a model dir of the kind (the flags a user types: the model, the size, the elements, the prompt, the output; no
sampling flag) and compares with what reached the scheduler (its class, shift and set_timesteps), the transformer
(each forward's timestep and sequence shape: the steps, the guidance passes, the frames and reference latents), the
text encoder (the negative prompt), the noise generator (the seed), the guidance combination the scheduler's step was
given (solved for its weights), the references the pipeline was handed (the framing) and the written file (fps).

The model dir is given as a path, so a2 takes a real model's defaults (a built-in tiny name samples in 10 steps); the
size is 32x48 (a tiny model; the size is not a sampling default) and the frames are the default."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tests.conftest import drawn_person
from tests.spy import run_infer, video_file
from tests.their_kaleido import NEGATIVE as KALEIDO_NEG
from tests.their_samplers import fit_pad_white, pixels
from tests.their_vace import wan_reference

WAN_NEG = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"  # noqa: RUF001
           "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的"  # noqa: RUF001
           "肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")  # noqa: RUF001
A2_NEG = ("Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, "
          "overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly "
          "drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy "
          "background, three legs, many people in the background, walking backwards")
H, W = 32, 48  # the video's size (non-square: a swapped height and width shows)
REF_SIZE = (40, 28)  # the element images' (h, w): another aspect than the video's, so the framing shows
BACKGROUND_SIZE = (28, 40)  # a third image's (SkyReels-A2's background, cropped): wider, yet narrower than the video


def a2_pad_resize(image, height, width):
    """SkyReels-A2's _crop_and_resize_pad (models/utils.py:5-20), written out: pad with white to the target aspect,
    the image centred and the pad truncated (int), then PIL's default resize; its subjects and objects (infer.py:
    65-66) and every CLIP image at 512x512 (:61)."""
    image = np.array(image)
    ih, iw, _ = image.shape
    if ih / iw < height / width:
        pad = int((((height / width) * iw) - ih) / 2.)
        padded = np.ones((ih + pad * 2, iw, 3), dtype=np.uint8) * 255
        padded[pad:pad + ih, :] = image
    else:
        pad = int((((width / height) * ih) - iw) / 2.)
        padded = np.ones((ih, iw + pad * 2, 3), dtype=np.uint8) * 255
        padded[:, pad:pad + iw] = image
    return Image.fromarray(padded).resize((width, height))


def a2_crop_resize(image, height, width):
    """SkyReels-A2's _crop_and_resize (models/utils.py:23-37), written out: the middle cropped to the target aspect
    (int), then PIL's default resize; its background, the third image (infer.py:67-68)."""
    image = np.array(image)
    ih, iw, _ = image.shape
    if ih / iw < height / width:
        cw = int(ih / height * width)
        left = (iw - cw) // 2
        image = image[:, left:left + cw]
    else:
        ch = int(iw / width * height)
        top = (ih - ch) // 2
        image = image[top:top + ch, :]
    return Image.fromarray(image).resize((width, height))


def magref_canvas_lab(images, height, width, rng):
    """MAGREF's process_refimg (magref/subject2video.py:133-220) with its resize_and_pad (:286-335), written out for
    up to 3 images: one white canvas of the video's size (its video is its canvas's: :389-393), cut into
    len(images) columns, the last taking the remainder (:162-172); the images' order and the blocks shuffled
    (:203-205, rng: a2 seeds MAGREF's unseeded shuffle with the seed, docs/kinds.md); each Lanczos-fit to its block
    (sides truncated), centred on white, the odd pixel right / bottom (:303-327), pasted at the block's corner."""
    assert 1 <= len(images) <= 3
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    bw = width // len(images)
    blocks = [(i * bw, 0, width if i == len(images) - 1 else (i + 1) * bw, height) for i in range(len(images))]
    indices = list(range(len(images)))
    rng.shuffle(indices)
    rng.shuffle(blocks)
    for i, (x0, y0, x1, y1) in zip(indices, blocks):
        img, tw, th = images[i].convert("RGB"), x1 - x0, y1 - y0
        ratio = img.width / img.height
        nw, nh = (tw, int(tw / ratio)) if ratio > tw / th else (int(th * ratio), th)
        img = img.resize((nw, nh), Image.Resampling.LANCZOS)
        pw, ph = tw - nw, th - nh
        canvas.paste(ImageOps.expand(img, (pw // 2, ph // 2, pw - pw // 2, ph - ph // 2), fill=(255, 255, 255)),
                     (x0, y0))
    return canvas


def flow_unipc(steps):
    """Wan's FlowUniPC (Phantom subject2video.py:252-257, MAGREF subject2video.py:462-467, Wan wan/vace.py:402-408)
    and diffusers 0.34's UniPC use_flow_sigmas (SkyReels-V3 pins diffusers==0.34.0; reference_to_video_pipeline.py
    :733-738): linspace from the training sigma 0.999 to 0, the 0 dropped, before the shift."""
    return np.linspace(0.999, 0, steps + 1)[:-1]


def flowmatch(steps):
    """DiffSynth's FlowMatchScheduler(sigma_min=0, extra_one_step=True) (Stand-In pipelines/wan_video.py:85, RefAlign
    wan_video_new3.py:828): linspace(1, 0, steps + 1) without the 0, before the shift."""
    return np.linspace(1.0, 0, steps + 1)[:-1]


def hunyuan(steps):
    """Kaleido's RFSampler (sgm/modules/diffusionmodules/sampling.py:889-898, 926): 1 - s / (7 + s - 7 s) for
    s = linspace(0, 1, steps + 1), which is the shift 7 of 1 - s: unshifted, 1 - s without the final 0."""
    return 1.0 - np.linspace(0.0, 1.0, steps + 1)[:-1]


def a2_timesteps(steps):
    """SkyReels-A2's scheduler as its infer.py:47 builds it and models/pipeline_a2.py:579 sets it (diffusers
    unpinned, requirements.txt: the installed one's own grid): its timesteps, shifted."""
    from diffusers import UniPCMultistepScheduler

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                    flow_shift=8)
    sched.set_timesteps(steps)
    return sched.timesteps.double().numpy()


# kind -> (model, the flags besides the common ones, the lab's values). Per value the lab's file:line.
LABS = {
    "prefix": ("a2", [], dict(  # SkyworkAI/SkyReels-A2 @ 7c14e2e infer.py (its dir: a2_dir)
        scheduler="UniPCMultistepScheduler", shift=8.0,  # infer.py:47 UniPC(flow_shift=8)
        schedule=None, timesteps=a2_timesteps,  # pipeline_a2.py:579 set_timesteps(num_inference_steps)
        steps=50,  # infer.py:87
        guidance=(5.0,),  # infer.py:84 guidance_scale=5.0 (text CFG: 2 forwards a step)
        negative=A2_NEG,  # infer.py:19
        seed=42,  # infer.py:24
        fps=15,  # infer.py:117 write_mp4(..., fps=15)
        latent_frames=21,  # infer.py:83 num_frames=81 -> (81 - 1) / 4 + 1 latents, the references among them
        framing="a2")),  # infer.py:58-72: subject, object padded; the background cropped; CLIP padded at 512
    "phantom": ("tiny-phantom", [], dict(  # svjack/Phantom @ 51ef427
        scheduler="UniPCMultistepScheduler", shift=5.0,  # generate.py:63 sample_shift 5.0
        schedule=flow_unipc, grid=flow_unipc,  # subject2video.py:252-257 FlowUniPC(shift=1).set_timesteps(shift=)
        steps=50,  # generate.py:60 (not i2v: 50)
        guidance=(7.5, 5.0),  # generate.py:210-220 --sample_guide_scale_text 7.5, _img 5.0 (3 forwards)
        negative=WAN_NEG,  # configs/shared_config.py:19 sample_neg_prompt, subject2video.py:213
        seed=42,  # generate.py:182 --base_seed -1 draws one; a2 keeps 42 (README "What each kind samples with")
        fps=16,  # configs/shared_config.py:18 sample_fps
        latent_frames=21 + 2,  # generate.py:69 frame_num 81, then one latent per reference (2 given)
        framing="fit_pad_white")),  # generate.py:242-272 Lanczos fit, white pad
    "v3": ("tiny-v3", [], dict(  # SkyworkAI/SkyReels-V3 @ 28c771e generate_video.py -> ReferenceToVideoPipeline
        scheduler="UniPCMultistepScheduler", shift=5.0,  # reference_to_video_pipeline.py:737 flow_shift=5.0
        schedule=flow_unipc, grid=flow_unipc,  # diffusers==0.34.0's flow sigmas (requirements.txt)
        steps=8,  # reference_to_video_pipeline.py:787 generate_video: num_inference_steps 8
        guidance=(),  # :782-783 guidance_scale 1.0, guidance_scale_img 1.0; :367-368 CFG only above 1: 1 forward
        negative=None,  # :778 negative_prompt "" (never encoded: no guidance pass)
        seed=42,  # generate_video.py:173 --seed 42
        fps=24,  # generate_video.py:342
        latent_frames=31 + 4,  # generate_video.py:153 duration 5, :773 5 * 24 + 1 = 121 frames; 4 slots (:35, :351)
        framing="fit_pad_white")),  # reference_to_video_pipeline.py:660-693
    "magref": ("tiny-magref", [], dict(  # MAGREF-Video/MAGREF @ e3c71b2
        scheduler="UniPCMultistepScheduler", shift=3.0,  # generate.py:90 --sample_shift 3.0
        schedule=flow_unipc, grid=flow_unipc,  # subject2video.py:462-467
        steps=40,  # generate.py:86 --sample_steps 40
        guidance=(5.0,),  # generate.py:95 --sample_guide_scale 5.0
        negative="镜头晃动，" + WAN_NEG,  # noqa: RUF001 configs/magref_14B.py:10
        seed=3407,  # generate.py:77 --base_seed 3407
        fps=15,  # configs/shared_config.py:17
        latent_frames=21,  # generate.py:25 --frame_num 81 (the canvas is its first frame)
        framing="canvas")),  # subject2video.py:133-220, 286-335 (magref_canvas_lab)
    "standin": ("tiny-t2v", ["--reference-layout", "standin"], dict(  # WeChatCV/Stand-In @ cceec58
        scheduler="FlowMatchEulerDiscreteScheduler", shift=5.0,  # pipelines/wan_video.py:85 FlowMatchScheduler(5)
        schedule=flowmatch, grid=flowmatch,
        steps=20,  # infer.py:29 --num_inference_steps 20
        guidance=(5.0,),  # pipelines/wan_video.py:510 cfg_scale 5.0
        negative=WAN_NEG,  # infer.py:38 --negative_prompt
        seed=0,  # infer.py:26 --seed 0
        fps=25,  # infer.py:43 --fps 25
        # pipelines/wan_video.py:508 num_frames=81; the reference is preprocessor/image_input_preprocessor.py:80's
        # 512x512 crop: its 64x64 latent's tokens, which a2 packs after the video in frames of its 4x6 latent grid
        latent_frames=21 + math.ceil(64 * 64 / (H // 8 * W // 8)),
        framing="512x512")),
    "refalign": ("tiny-refalign", [], dict(  # gudaochangsheng/RefAlign @ 6f91526
        scheduler="FlowMatchEulerDiscreteScheduler", shift=5.0,  # diffsynth/pipelines/wan_video_new3.py:807
        schedule=flowmatch, grid=flowmatch,  # wan_video_new3.py:828
        steps=50,  # wan_video_new3.py:806
        guidance=(7.5, 5.0),  # wan_video_new3.py:925 the hard-coded 7.5; Wan2.1-T2V-1.3B_subject.py:179 cfg_scale 5
        negative=WAN_NEG,  # examples/wanvideo/model_inference/Wan2.1-T2V-1.3B_subject.py:176
        seed=0,  # Wan2.1-T2V-1.3B_subject.py:178
        fps=16,  # Wan2.1-T2V-1.3B_subject.py:181
        latent_frames=21 + 2,  # wan_video_new3.py:801 num_frames=81, then the 2 references' latents
        framing="fit_pad_white")),  # Wan2.1-T2V-1.3B_subject.py:95-126
    "vace": ("tiny-vace", [], dict(  # Wan-Video/Wan2.1 @ 9737cba, ali-vilab/VACE @ 48eb44f
        scheduler="UniPCMultistepScheduler", shift=16.0,  # generate.py:76-81 (vace: 16); vace_wan_inference.py:49-50
        schedule=flow_unipc, grid=flow_unipc,  # wan/vace.py:402-408
        steps=50,  # generate.py:71-72
        guidance=(5.0,),  # generate.py:242 --sample_guide_scale 5.0
        negative=WAN_NEG,  # wan/vace.py:353-354 the config's sample_neg_prompt
        seed=2025,  # VACE vace_wan_inference.py:158-162 --base_seed 2025
        fps=16,  # wan/configs/shared_config.py:18
        latent_frames=21 + 2,  # generate.py:84-85 frame_num 81, the references' latents on top (wan/vace.py:380-387)
        framing="wan_reference")),  # wan/vace.py:249-277 bilinear fit, centred on white
    "kaleido": ("tiny-kaleido", [], dict(  # zai-org/Kaleido @ 4c6c757 sample_video.py with its two yaml configs
        scheduler="FlowMatchEulerDiscreteScheduler", shift=7.0,  # sampling.py:908 RFSampler shift_scale 7, Euler :959
        schedule=hunyuan, grid=hunyuan,  # sampling.py:926 make_hunyuan_timesteps (hunyuan_schedule: True)
        steps=50,  # dit_crossattn_14B_wanvae.yaml sampler_config num_steps 50
        guidance=(6.0,),  # dit_crossattn_14B_wanvae.yaml VanillaCFG scale 6 (the references in both branches)
        negative=KALEIDO_NEG,  # sample_wanvae_concat_14b.yaml:13 sample_neg_prompt
        seed=1234,  # sat/arguments.py:182 --seed 1234
        fps=16,  # sample_wanvae_concat_14b.yaml:19 sampling_fps
        latent_frames=2 + 21,  # the 2 references' latents, then sampling_num_frames 21 (81 frames)
        framing="fit_pad_white")),  # sample_video.py:212-228 Lanczos fit, white pad
}


@pytest.fixture(scope="module")
def element_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("promised_elements")
    paths = []
    for i, size in enumerate((REF_SIZE, REF_SIZE, BACKGROUND_SIZE)):
        p = d / f"person{i}.png"
        drawn_person(size, seed=i).save(p)
        paths.append(str(p))
    return paths


@pytest.fixture(scope="module")
def a2_dir(tmp_path_factory):
    """The tiny model dir as SkyReels-A2 ships its own: model_index.json's _class_name A2Pipeline (what tells it
    from Wan2.1 I2V, whose sampler is diffusers' I2V pipeline's), and a scheduler_config.json whose shift (3) is not
    A2's, so that the 8 A2's infer.py hard-codes shows as the kind's own."""
    import json

    from a2.model.tiny import model_path

    tiny, d = model_path("tiny"), tmp_path_factory.mktemp("skyreels_a2") / "SkyReels-A2"
    d.mkdir()
    for entry in tiny.iterdir():
        if entry.name not in ("model_index.json", "scheduler"):
            (d / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    index = json.loads((tiny / "model_index.json").read_text())
    (d / "model_index.json").write_text(json.dumps(dict(index, _class_name="A2Pipeline")))
    (d / "scheduler").mkdir()
    config = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
    (d / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(config, flow_shift=3.0)))
    return d


def shift(sigmas, s):
    return s * sigmas / (1 + (s - 1) * sigmas)


@pytest.mark.parametrize("kind", list(LABS))
def test_infer_samples_as_the_lab(kind, element_paths, tmp_path, monkeypatch, request):
    from a2.model.tiny import model_path

    name, flags, lab = LABS[kind]
    model = request.getfixturevalue("a2_dir") if name == "a2" else model_path(name)
    n_refs = dict(standin=1, prefix=3).get(kind, 2)  # (A2's three: its background framed apart)
    out = tmp_path / "out.mp4"
    rec = run_infer(monkeypatch, ["--model", str(model), "--resolution", str(H), str(W), "--device", "cpu",
                                  "--prompt", "a man is holding a teddy bear", "--out", str(out),
                                  "--elements", *element_paths[:n_refs], *flags])
    assert rec.layout.kind == kind
    # the scheduler, its shift and the unshifted sigmas it was handed (None: its own default grid)
    assert (rec.scheduler, rec.shift) == (lab["scheduler"], lab["shift"])
    given = rec.set_timesteps.get("sigmas")
    if lab["schedule"] is None:
        assert given is None and rec.set_timesteps["args"] == (lab["steps"],)
    else:  # float32 sigmas against float64 literals: the last bit of a value near 1
        np.testing.assert_allclose(given, lab["schedule"](lab["steps"]), rtol=1e-6, atol=1e-7)
    # what the transformer got: one timestep per step, each the lab's shifted sigma x 1000 (within 1: the int64
    # truncation of the FlowUniPC grids), the same timestep for every guidance pass of a step
    steps = sorted({t for t, _ in rec.calls}, reverse=True)
    assert len(steps) == len(rec.step_inputs) == lab["steps"]
    want = (lab["timesteps"](lab["steps"]) if "timesteps" in lab else
            1000 * shift(lab["grid"](lab["steps"]), lab["shift"]))
    np.testing.assert_allclose(steps, want, atol=1.0)
    passes = 1 + len(lab["guidance"]) if lab["guidance"] else 1
    assert rec.passes() == [passes] * lab["steps"]
    # the guidance weights the step's model output puts on each forward (cond, then uncond, then no references)
    if lab["guidance"]:
        s, *img = lab["guidance"]
        weights = (s, 1 - s) if not img else (s, img[0] - s, 1 - img[0])
        # float32 predictions combined and solved in float64: 1e-4 relative to weights of size ~5
        np.testing.assert_allclose(rec.guidance(), weights, atol=1e-4)
    # the texts: the prompt, then the lab's negative prompt (none encoded without a guidance pass)
    assert rec.texts == ["a man is holding a teddy bear"] + ([] if lab["negative"] is None else [lab["negative"]])
    assert rec.seed == lab["seed"]
    if kind == "magref":  # docs/kinds.md: the seed a2 also places MAGREF's canvas by (its shuffle is unseeded)
        assert rec.layout.placement_seed == lab["seed"]
    # the sequence: the lab's frames as latents, plus its reference latents
    assert {shape[2] for _, shape in rec.calls} == {lab["latent_frames"]}
    fps, _, (height, _) = video_file(out)
    assert fps == lab["fps"] and height == H
    # the references as the lab frames each image, at the video's (H, W)
    if lab["framing"] is not None:
        images = [Image.open(p).convert("RGB") for p in element_paths[:n_refs]]
        if lab["framing"] == "a2":  # the same uint8 pixels scaled alike
            subjects, background = images[:2], images[2]
            want = torch.stack([pixels(a2_pad_resize(im, H, W)) for im in subjects]
                               + [pixels(a2_crop_resize(background, H, W))])
            clip = torch.stack([pixels(a2_pad_resize(im, 512, 512)) for im in images])
            torch.testing.assert_close(rec.clip_references[0].float(), clip, atol=1e-6, rtol=0)
            tol = 1e-6
        elif lab["framing"] == "canvas":  # one frame: the canvas
            want = pixels(magref_canvas_lab(images, H, W, random.Random(lab["seed"])))[None]
            tol = 1e-6
        elif lab["framing"] == "512x512":  # a2 fits the image on white at Stand-In's size (its face crop is not done)
            want = torch.stack([pixels(fit_pad_white(im, 512, 512)) for im in images])
            tol = 1e-6
        elif lab["framing"] == "fit_pad_white":
            want = torch.stack([pixels(fit_pad_white(im, W, H)) for im in images])
            tol = 1e-6  # the same uint8 pixels scaled alike
        else:
            want = torch.stack([wan_reference(im, (H, W))[:, 0] for im in images])
            tol = 1e-5  # a bilinear resize of float32 pixels
        got = rec.references[0]
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


# ---------------------------------------------------------------- every sampling flag reaches the model

FRAMES = 9  # the flag runs: a short clip, 2 steps (the defaults' own values are held above)
SAMPLE = ["--resolution", str(H), str(W), "--num-frames", str(FRAMES), "--steps", "2", "--device", "cpu",
          "--prompt", "a man is holding a teddy bear"]


@pytest.fixture(scope="module")
def flag_sources(tmp_path_factory, element_paths):
    """A control video (uint8 frames, .npz) and masks: a hard one (0 / 255, a box) and the same box soft and at
    another size (40x60 for the 32x48 video: resized): its values 60 and 195, symmetric about VACE's threshold, so any
    resampling leaves each pixel on the hard one's side and the binarised masks agree."""
    from PIL import Image

    d = tmp_path_factory.mktemp("flag_sources")
    frames = (np.random.default_rng(5).random((FRAMES, H, W, 3)) * 255).astype(np.uint8)
    np.savez(d / "control.npz", frames=frames)
    hard = np.zeros((40, 60), np.uint8)
    hard[10:30, 15:45] = 255
    Image.fromarray(hard).save(d / "mask.png")
    Image.fromarray(np.where(hard > 0, 195, 60).astype(np.uint8)).save(d / "soft.png")
    return dict(control=str(d / "control.npz"), mask=str(d / "mask.png"), soft=str(d / "soft.png"),
                ref=element_paths[0])


def sample(argv, out):
    """infer.main on argv (parsed as its __main__ parses it), writing out.mp4 and out.pt: (latents, the file's fps)."""
    import infer
    from a2.cli import parse_cli
    from config import InferConfig

    cfg = parse_cli(InferConfig, args=[*argv, "--out", f"{out}.mp4", "--save-latents", f"{out}.pt"])
    assert infer.main(cfg) == 0
    return torch.load(f"{out}.pt", weights_only=False)["latents"], video_file(f"{out}.mp4")[0]


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory, flag_sources):
    """One run per model with no flag beyond SAMPLE, shared by every flag's case."""
    d, runs = tmp_path_factory.mktemp("default_runs"), {}

    def get(model):
        if model not in runs:
            runs[model] = sample(["--model", model, "--elements", flag_sources["ref"], *SAMPLE], d / model)
        return runs[model]
    return get


FLAGS = {  # flag -> (model, its flags; {control}/{mask}: flag_sources' files)
    "vace-scale": ("tiny-vace", ["--vace-scale", "0.5"]),
    "flow-shift": ("tiny-vace", ["--flow-shift", "3"]),
    "guidance-scale": ("tiny-vace", ["--guidance-scale", "2"]),
    "guidance-scale-img": ("tiny-phantom", ["--guidance-scale-img", "2"]),
    "steps": ("tiny-vace", ["--steps", "3"]),
    "seed": ("tiny-vace", ["--seed", "7"]),
    "negative-prompt": ("tiny-vace", ["--negative-prompt", "a dog on the beach"]),
    "scheduler": ("tiny-vace", ["--scheduler", "euler"]),
    "schedule": ("tiny-vace", ["--schedule", "flowmatch"]),
    "preset diffusers": ("tiny-vace", ["--preset", "diffusers"]),
    "control-video": ("tiny-vace", ["--control-video", "{control}"]),
    "control-video and mask": ("tiny-vace", ["--control-video", "{control}", "--mask", "{mask}"]),
}


@pytest.mark.parametrize("flag", list(FLAGS))
def test_every_sampling_flag_reaches_the_model(flag, default_runs, flag_sources, tmp_path):
    """Each flag changes the final latents against the same command without it (the real pipeline, 2 steps): a flag
    dropped between the CLI and the model leaves them bit-identical (the same ops on the same values), so any change
    above float32 rounding shows; the smallest, --schedule flowmatch against VACE's grid from 0.999, is 1.3e-4."""
    model, flags = FLAGS[flag]
    base, _ = default_runs(model)
    flags = [f.format(**flag_sources) for f in flags]
    latents, _ = sample(["--model", model, "--elements", flag_sources["ref"], *SAMPLE, *flags], tmp_path / "x")
    assert latents.shape == base.shape
    assert (latents - base).abs().max().item() > 1e-5, flag
    if flag == "control-video and mask":  # the mask itself, against the control video alone
        alone, _ = sample(["--model", model, "--elements", flag_sources["ref"], *SAMPLE, "--control-video",
                           flag_sources["control"]], tmp_path / "alone")
        assert (latents - alone).abs().max().item() > 1e-5


def test_fps_flag_is_the_written_files(default_runs, flag_sources, tmp_path):
    """--fps is the written file's rate (the latents do not depend on it); without it the kind's (Wan's VACE: 16,
    wan/configs/shared_config.py:18)."""
    _, fps = default_runs("tiny-vace")
    _, given = sample(["--model", "tiny-vace", "--elements", flag_sources["ref"], *SAMPLE, "--fps", "9"],
                      tmp_path / "fps")
    assert (fps, given) == (16, 9)


def test_a_soft_resized_mask_is_its_binarised_self(default_runs, flag_sources, tmp_path):
    """VACE binarises its mask at 0.5 (Wan's vace_encode_frames / vace_encode_masks, wan/vace.py: torch.where(m > 0.5,
    1, 0)): a soft mask of another size samples as the hard one it thresholds to, bit for bit (the same ops on the
    same binarised values), and differs from no mask."""
    run = ["--model", "tiny-vace", "--elements", flag_sources["ref"], *SAMPLE, "--control-video",
           flag_sources["control"]]
    hard, _ = sample([*run, "--mask", flag_sources["mask"]], tmp_path / "hard")
    soft, _ = sample([*run, "--mask", flag_sources["soft"]], tmp_path / "soft")
    assert torch.equal(hard, soft)


# ---------------------------------------------------------------- what the README and docs/ say, held


def test_a_local_dir_named_like_a_hub_id_wins(tmp_path, monkeypatch):
    """README: `--model` takes a Hub id, "a local dir of the same name wins": with the Hub offline and nothing cached,
    a dir at ./Skywork/SkyReels-A2 is the model infer.py reads, not a download."""
    from a2.model.tiny import model_path
    from a2.model.transformer import detect_model

    (tmp_path / "Skywork").mkdir()
    (tmp_path / "Skywork" / "SkyReels-A2").symlink_to(model_path("tiny"), target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert model_path("Skywork/SkyReels-A2") == tmp_path.joinpath("Skywork", "SkyReels-A2").relative_to(tmp_path)
    assert detect_model(model_path("Skywork/SkyReels-A2")).name == "Wan2.1 I2V"
    from a2.model.transformer import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="SkyReels-A3: no such local dir, and the Hugging Face Hub model"):
        model_path("Skywork/SkyReels-A3")  # the same id without the dir: the Hub, offline


def test_a_library_call_samples_as_infer_does(element_paths, monkeypatch):
    """README: a library call of A2Pipeline leaves every setting to the kind ("as for infer.py"): on Phantom-Wan the
    sampler it returns is Phantom's generate.py's (the LABS row), with nothing passed but the prompt, the
    references and the layout."""
    from a2.elements import RELEASED_ELEMENTS
    from a2.images import load_references
    from a2.model.tiny import model_path
    from a2.pipeline import A2Pipeline

    pipe = A2Pipeline.from_pretrained(model_path("tiny-phantom"))
    refs, clips, repeats, _ = load_references(list(zip(RELEASED_ELEMENTS, element_paths[:2])), (H, W))
    layout = pipe.plan(9, repeats)
    out = pipe("a man", refs, clips, layout=layout, height=H, width=W, decode="none", progress=False)
    lab, own = LABS["phantom"][2], out["sampling"]
    assert (own.steps, own.flow_shift, (own.guidance_scale, own.guidance_scale_img), own.negative_prompt, own.seed,
            own.fps) == (lab["steps"], lab["shift"], lab["guidance"], lab["negative"], lab["seed"], lab["fps"])
