"""a2/kinds/conditioning.py, per kind: the transformer receives in training exactly what it receives in sampling;
training from a precompute cache equals training from pixels; the plan's refusals."""

import json

import numpy as np
import pytest
import torch
import tyro

import a2.eval.evaluate
import infer
import train_a2
from a2.cli import ConfigError
from a2.config.dataset_config import ConditioningConfig
from a2.data.loader import collate
from a2.elements import pair_elements
from a2.images import load_references
from a2.pipeline import A2Pipeline
from a2.plan import validation_layout
from a2.train.step import Process
from config import TrainConfig, from_flags, with_flags
from data import E2VDataset
from tests.conftest import args, losses, max_diff, params, train, train_config

# kind -> (model, flags, the frame count the sampler renders); every kind of a2/kinds/conditioning.py
KINDS = {
    "t2v": ("tiny-t2v", ["--dataset-type", "t2v", "--num-frames", "17"]),
    "prefix": ("tiny", ["--num-frames", "21"]),  # A2: 3 elements (1/4/4) as the leading latents, CLIP tokens
    "prefix-clip": ("tiny", ["--num-frames", "21", "--e2v-type", "clip"]),  # the VAE path off: zeros, no mask
    "inplace": ("tiny-wan22-i2v", ["--frame-conditioning", "first", "--num-frames", "17", "--expert", "high"]),
    "incontext-shared": ("tiny-t2v", ["--reference-layout", "incontext", "--num-frames", "9"]),
    "incontext-zero": ("tiny-t2v", ["--reference-layout", "incontext", "--reference-timestep", "zero",
                                    "--num-frames", "9"]),
    "clean": ("tiny-ti2v", ["--frame-conditioning", "first", "--num-frames", "17"]),
    "incontext-ti2v": ("tiny-ti2v", ["--reference-layout", "incontext", "--reference-timestep", "zero",
                                     "--num-frames", "9"]),
    "phantom": ("tiny-phantom", ["--num-frames", "9"]),  # the released models' own layouts, chosen by their weights
    "v3": ("tiny-v3", ["--num-frames", "9"]),
    "refalign": ("tiny-refalign", ["--num-frames", "9"]),  # (RefAlign's weights: Phantom's, named RefAlign)
    # two elements side by side on one canvas (three would be 10 px wide at 32x32: under one token, refused)
    "magref": ("tiny", ["--reference-layout", "magref", "--num-frames", "9", "--elements",
                        "subject=_person.png:repeat=1", "object=_object.png:repeat=1"]),
    # Stand-In: one element's latent packed after the video's, read as reference tokens by its forward
    "standin": ("tiny-t2v", ["--reference-layout", "standin", "--num-frames", "9", "--elements",
                             "subject=_person.png"]),
    # VACE: the references' latent frames before the clip's, its context packed beside them; R2V, and a clip whose
    # mask (<id>_vace_mask.png) the sampler is given with the clip outside it as its control video
    "vace": ("tiny-vace", ["--num-frames", "9"]),
    "vace-mask": ("tiny-vace", ["--num-frames", "9"]),
    # Kaleido: its references' latent frames before the video's, each at its own RoPE position
    "kaleido": ("tiny-kaleido", ["--num-frames", "9"]),
}


# element counts each kind takes (Kind.references): the fewest and the most, element images cycling through the
# data's three; MAGREF's 2x4 canvas of eight needs 64x128 (each block a token wide at least)
SUFFIXES = ("_person.png", "_object.png", "_background.png")
COUNTS = [("prefix", 1), ("prefix", 8), ("incontext-shared", 1), ("incontext-shared", 8), ("phantom", 1),
          ("phantom", 4), ("v3", 1), ("v3", 4), ("refalign", 1), ("refalign", 3), ("magref", 1), ("magref", 8),
          ("vace", 1), ("vace", 4), ("kaleido", 1), ("kaleido", 3)]


def count_flags(name, n):
    """The kind's flags with n elements instead of its own."""
    model, extra = KINDS[name]
    if "--elements" in extra:
        extra = extra[:extra.index("--elements")]
    size = ["--resolution", "64", "128"] if (name, n) == ("magref", 8) else []
    return [*extra, *size, "--elements", *(f"ref{i}={SUFFIXES[i % 3]}:repeat=1" for i in range(n))]


def masked_clips(data_dir, tmp_path, ids=("000",)):
    """A copy of the dataset whose clips `ids` have a VACE mask (white where VACE generates: a box)."""
    import shutil

    from PIL import Image

    from data import MASK_SUFFIX

    d = tmp_path / "masked"
    shutil.copytree(data_dir, d)
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 4:20] = 255
    for i in ids:
        Image.fromarray(mask).save(d / f"{i}{MASK_SUFFIX}")
    return d


def setup(data_dir, name, *flags, n=None, tmp_path=None):
    model, extra = KINDS[name]
    if n is not None:
        extra = count_flags(name, n)
    if name == "vace-mask":
        data_dir = masked_clips(data_dir, tmp_path)
    cfg = train_config(["--model", model, "--data-root", str(data_dir), "--resolution", "32", "64",
                                      "--device", "cpu", "--text-dropout", "0", *extra, *flags])
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
    ds = E2VDataset(run.datasets, num_frames=run.layout.clip_frames, verbose=False, layout=run.layout)
    batch = collate([ds[0]])
    batch["files"] = [str(p) for p in ds.samples[0].elements.values()]  # the images as a user names them, in order
    enc = train_a2.load_run_encoders(cfg, run, torch.device("cpu"), needed=True)
    return cfg, run, enc, batch


@pytest.mark.parametrize("name,n", [(k, None) for k in KINDS] + COUNTS,
                         ids=list(KINDS) + [f"{k}-{n}refs" for k, n in COUNTS])
def test_training_feeds_what_the_sampler_feeds(data_dir, name, n, monkeypatch, tmp_path):
    """At the sampler's first step (sigma 1) with the same noise and the same element images (or first frame), the
    training step gives the transformer exactly the hidden states, timestep, text and image tokens A2Pipeline gives
    it: forward hooks on the one transformer, every kind, each VAE-encoding as its kind does on its model (no mode
    given on either side: the same mode in both), with its own elements and with the fewest and the most it takes
    (n). Both sides take their element specs from their CLI's defaults: training the kind's (train_a2.py with no
    --elements, or the --elements given), sampling infer.py's for the same files named in order (its --element-specs
    the same --elements, else none): the same images framed alike. Where that mode draws from the posterior (A2's,
    in-context, V3) the draws come from each side's own generator, so the tensors are compared with the posterior
    mean on both."""
    from a2.kinds import conditioning

    modes = []
    encode_vae = conditioning.encode_vae
    monkeypatch.setattr(conditioning, "encode_vae", lambda *a, **k: modes.append(a[2]) or encode_vae(*a, **k))
    cfg, run, enc, batch = setup(data_dir, name, n=n, tmp_path=tmp_path)
    h, w = cfg.data.resolution
    kind = run.layout.kind
    assert kind == name.split("-")[0]
    transformer = train_a2.load_transformer(run.info.path, torch.float32, run.subfolder)
    if run.layout.expand:
        raise AssertionError("the tiny models take these kinds without expansion")
    seen = []
    transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    pipe = A2Pipeline(transformer, enc.vae, enc.tokenizer, enc.text_encoder, enc.image_encoder, enc.image_processor,
                      expand_timesteps=run.info.ti2v, model=run.info.name)
    refs = clips = region = None
    repeats, first_frame = (), None
    if run.layout.takes_references:  # infer.py's specs for the sample's files (a user's --elements on both sides)
        specs = infer.element_specs(infer.InferConfig.from_flags(element_specs=cfg.data.elements,
                                                                 conditioning=cfg.conditioning),
                                    run.info)
        files = pair_elements(batch["files"], specs)
        refs, clips, repeats, region = load_references(files, (h, w), (cfg.model.clip_size, cfg.model.clip_size),
                                                       run.layout)
        assert n is None or len(repeats) == len(run.layout.repeats) == n  # both sides: n references
    elif kind == "inplace":  # Wan I2V: the sampler takes the first frame as the one reference of one frame
        refs, repeats = batch["video"][:, None, :, 0], (1,)
    elif kind == "clean":
        first_frame = batch["video"][:, :, 0]
    control = mask = None
    if batch.get("region") is not None and kind == "vace":  # the masked clip: its clip outside the mask, and the mask
        mask = batch["region"]
        control = batch["video"] * (1 - mask[:, None])
    layout = validation_layout(run.layout, repeats)  # as validate() samples the run

    def sample(mode=None):
        seen.clear()
        pipe(batch["prompts"][0], refs, clips, layout=layout, height=h, width=w, num_inference_steps=1,
             guidance_scale=1.0, scheduler="euler", sigmas=np.ones(1), sample_mode=mode,
             generator=torch.Generator().manual_seed(1), decode="none", progress=False, first_frame=first_frame,
             region=region, control_video=control, mask=mask)
        return seen[0]

    sampled = sample()
    sampling_modes, modes[:] = modes[:], []
    train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0, torch.device("cpu"))
    assert set(sampling_modes) <= set(modes) == {run.encode_mode}  # the kind's one encode mode, on both sides
    if run.encode_mode == "sample":
        cfg, run, enc, batch = setup(data_dir, name, "--vae-sample-mode", "argmax", n=n, tmp_path=tmp_path)
        sampled = sample("argmax")
    assert sampled["timestep"].reshape(-1)[-1].item() == 1000.0 or kind == "incontext"  # sigma 1: x_t is the noise

    inputs = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                   torch.device("cpu"))
    c, t = inputs["x0"].shape[1], inputs["x0"].shape[2]
    first = run.layout.ref_latents if run.layout.definition.prepended else 0  # Kaleido's references come first
    inputs["noise"], inputs["sigmas"] = sampled["hidden_states"][:, :c, first:first + t].clone(), torch.tensor([1.0])
    seen.clear()
    train_a2.forward_loss(transformer, inputs, cfg.objective, cfg.references, run,
                          torch.autocast("cpu", enabled=False), torch.float32)
    (trained,) = seen
    for key in ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"):
        a, b = trained.get(key), sampled.get(key)
        assert (a is None) == (b is None), key
        assert a is None or torch.equal(a, b.to(a.dtype)), key
    x = trained["hidden_states"]
    if kind == "magref":  # the region mask on latent frame 0 only, and one CLIP image: the canvas
        assert x.shape[1] == 36 and x[:, 16:20, 1:].abs().max() == 0 and x[:, 16:20, 0].max() == 1
        assert trained["encoder_hidden_states_image"].shape[1] == 257
    if kind in ("prefix", "inplace"):
        assert x.shape[1] == 36 and x[:, 16:20].abs().max() == (0 if name == "prefix-clip" else 1)
    if kind in ("incontext", "phantom", "v3"):
        assert x.shape[2] == t + (4 if kind == "v3" else n or 3)  # the sample's 3 (n), V3's 4 slots
    if kind == "standin":  # Stand-In's 512x512 reference (64x64 latents) packed in 4x8-latent frames: 128 of them
        from a2.kinds.standin import unpack_reference

        assert x.shape[2] == t + 128 and unpack_reference(x, run.layout.reference_grid)[1].shape == (1, 16, 1, 64, 64)
    if name == "prefix":
        assert trained["encoder_hidden_states_image"].shape[1] == (n or 3) * 257
    if kind == "vace":  # x_t | VACE's 96-channel context, over the references' latent frames and then the clip's
        assert x.shape[1:3] == (16 + 96, t) and t == (n or 3) + 3
        assert (mask is not None) == (name == "vace-mask")


# kind -> (model, the flags train_a2.py and infer.py both take, element images): what validation and infer.py sample
VALIDATION = {
    "t2v": ("tiny-t2v", [], 0),
    "prefix": ("tiny", ["--num-frames", "21"], 3),  # the sequence: A2's three elements' 9 frames and the clip
    # fewer images than A2's elements: --num-frames is the whole sequence in both (its 1 reference frame and 17 video
    # frames), not the run's 9-frame clip
    "prefix-one": ("tiny", ["--num-frames", "21"], 1),
    "incontext": ("tiny-t2v", ["--reference-layout", "incontext", "--num-frames", "9"], 2),
    "clean": ("tiny-ti2v", ["--frame-conditioning", "first", "--num-frames", "9"], 1),  # the image: the first frame
    "phantom": ("tiny-phantom", [], 2),
    "v3": ("tiny-v3", [], 2),
    "refalign": ("tiny-refalign", [], 2),
    "magref": ("tiny-magref", [], 2),
    "standin": ("tiny-t2v", ["--reference-layout", "standin", "--num-frames", "9"], 1),
    "vace": ("tiny-vace", [], 2),
    "kaleido": ("tiny-kaleido", [], 2),
}


@pytest.mark.parametrize("name", list(VALIDATION))
def test_validation_video_is_infers(data_dir, tmp_path, name, monkeypatch):
    """A run's validation video is the video infer.py makes from the same weights, prompt (both CLIs' default) and
    element images, each on its CLI's defaults (no sampling flag, no element specs; the size, frames and 2 steps
    given to both alike): the same tensor, bit for bit, written at the kind's own fps. Both fill what their user
    left out in one place, A2Pipeline (the kind's guidance, reference guidance, negative prompt, seed, noise
    device, schedule), and frame the images with the specs the kind takes (a2.kinds.kinds.kind_elements)."""

    from a2.kinds.kinds import kind_sampling

    model, extra, n = VALIDATION[name]
    sample = sorted(data_dir.glob("*.mp4"))[0].stem
    images = [str(data_dir / f"{sample}{x}") for x in SUFFIXES[:n]]
    shared = ["--model", model, "--resolution", "32", "64", "--device", "cpu", *(extra or ["--num-frames", "9"])]
    written = {}

    def save(key):
        return lambda path, video, fps=15, references=None: written.setdefault(key, (video, fps)) and path

    monkeypatch.setattr(a2.eval.evaluate, "save_video", save("validation"))
    monkeypatch.setattr(infer, "save_video", save("infer"))
    cfg = train_config([*shared, "--data-root", str(data_dir), "--val-steps", "2", "--val-every", "1",
                                      *(["--val-elements", *images] if n else ["--dataset-type", "t2v"])])
    device = torch.device("cpu")
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), device)
    enc = train_a2.load_run_encoders(cfg, run, device, needed=True)
    transformer = train_a2.load_transformer(run.info.path, torch.float32, run.subfolder)
    a2.eval.evaluate.validate(1, *train_a2.validation_sections(cfg), run, transformer, enc, tmp_path, {},
                              Process(0, 0, 1, device))
    given = ["--image", images[0]] if name == "clean" else ["--elements", *images] if n else []
    assert infer.main(tyro.cli(infer.InferConfig, args=[*shared, "--steps", "2", "--out", str(tmp_path / "v.mp4"),
                                                        *given])) == 0
    (video, fps), (want, want_fps) = written["validation"], written["infer"]
    assert fps == want_fps == kind_sampling(run.layout.kind, run.info.name).fps
    assert video.shape == want.shape and torch.equal(video, want)


@pytest.mark.parametrize("name,extra", [
    ("prefix-mixed", ["--max-steps", "3"]),  # clips of 3, 2 and 1 elements: each cached with its own layout
    ("inplace-prefix5", ["--frame-conditioning", "prefix", "--prefix-frames", "5", "--num-frames", "17"]),
    ("inplace-last", ["--frame-conditioning", "first_and_last", "--num-frames", "17"]),
    ("clean-prefix5", ["--frame-conditioning", "prefix", "--prefix-frames", "5", "--num-frames", "17"]),
    ("t2v", ["--dataset-type", "t2v", "--num-frames", "17"]),
    ("phantom", ["--num-frames", "9"]),
    ("v3", ["--num-frames", "9"]),  # V3 samples its references' posteriors (its own encode)
    ("standin", ["--reference-layout", "standin", "--num-frames", "9", "--elements", "subject=_person.png"]),
    # MAGREF: the canvas' encodes, its CLIP tokens and its latent region mask cached; two elements side by side
    ("magref", ["--reference-layout", "magref", "--num-frames", "9", "--elements", "subject=_person.png:repeat=1",
                "object=_object.png:repeat=1"]),
    ("vace-mask", ["--num-frames", "9", "--max-steps", "4"]),  # VACE: its context's encodes, R2V and masked clips
])
def test_training_from_the_cache_equals_training_from_pixels(data_dir, tmp_path, name, extra):
    """Every kind the prefix and incontext cache tests (test_cache.py, test_incontext.py) do not cover: the VAE
    calls a precompute records are the ones the step replays, with the run's own frame conditioning (5 prefix frames
    too: the cache once encoded 1 while the mask marked 5)."""
    model = {"prefix": "tiny", "inplace": "tiny", "clean": "tiny-ti2v", "t2v": "tiny-t2v", "phantom": "tiny-phantom",
             "v3": "tiny-v3", "standin": "tiny-t2v", "magref": "tiny-magref", "vace": "tiny-vace"}[name.split("-")[0]]
    cache = tmp_path / "cache"
    if name == "prefix-mixed":
        data_dir = mixed_elements(data_dir, tmp_path)
    if name == "vace-mask":  # two of the four clips masked: two buckets, one of each context
        data_dir = masked_clips(data_dir, tmp_path, ids=("000", "002"))
    dropout = [] if name == "vace-mask" else ["--reference-dropout", "0.5"]  # (VACE's guidance keeps its references)
    steps = ["--max-steps", "2", "--text-dropout", "0.5", *dropout, *extra]
    live = train(*args(data_dir, tmp_path, "live", *steps, model=model))
    train(*args(data_dir, tmp_path, "pre", "--cache-dir", str(cache), "--precompute", *extra, model=model))
    cached = train(*args(data_dir, tmp_path, "cached", "--cache-dir", str(cache), *steps, model=model))
    assert losses(cached["run_dir"]) == losses(live["run_dir"])
    last = max(losses(live["run_dir"]))
    assert max_diff(params(cached["run_dir"] / f"ckpt-{last:07d}"), params(live["run_dir"] / f"ckpt-{last:07d}")) == 0.0


def test_the_cache_replays_the_runs_conditioning_frames(data_dir, tmp_path):
    """The cache of a 5-frame prefix run holds the 5 frames' encoding: its condition differs from a 1-frame one."""
    from a2.kinds.conditioning import PosteriorCache, encode

    _, run, enc, batch = setup(data_dir, "inplace")  # tiny-wan22-i2v, first frame
    rec = PosteriorCache(dict(enc.vae.config), vae=enc.vae)
    with torch.no_grad():
        _, first = encode(rec, run.layout, batch["video"], None, None, "argmax")
        from dataclasses import replace

        five = replace(run.layout, frame_conditioning="prefix", prefix_frames=5)
        _, prefix = encode(PosteriorCache(dict(enc.vae.config), vae=enc.vae), five, batch["video"], None, None,
                           "argmax")
    assert first.condition[:, 0].sum() < prefix.condition[:, 0].sum()  # the mask marks 5 frames
    assert (first.condition[:, 4:] - prefix.condition[:, 4:]).abs().max() > 1e-3  # and the latents hold them


def test_concatenate_mask_false_is_refused_in_one_line(data_dir, tmp_path):
    cfg_file = tmp_path / "ds.json"
    elements = [{"name": "subject", "suffixes": ["_person.png"]}]
    cfg_file.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "elements": elements,
                                                  "target_resolution": [32, 32],
                                                  "processors": {"vae": {"concatenate_mask": False}}}]}))
    cfg = from_flags(model="tiny", dataset_config=str(cfg_file), num_frames=21, resolution=(32, 32), device="cpu")
    with pytest.raises(ConfigError, match=r"concatenate_mask false: .*\(Wan2.1 I2V\) takes 36 input channels"):
        train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
    # a kind without a mask has nothing to concatenate: false is what it does
    vae = {"concatenate_mask": False, "reference_layout": "incontext"}
    cfg_file.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "elements": elements,
                                                  "target_resolution": [32, 32], "processors": {"vae": vae}}]}))
    cfg = from_flags(model="tiny-t2v", dataset_config=str(cfg_file), num_frames=9, resolution=(32, 32), device="cpu")
    assert train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu")).layout.kind == "incontext"


@pytest.mark.parametrize("layout", ["standin", "magref", "incontext"])
def test_element_layouts_with_frame_conditioning_are_refused_in_one_line(data_dir, tmp_path, layout):
    """An element layout with --frame-conditioning (whose clips carry no elements) once trained the inplace kind
    silently; it is refused before any weights load, from the flags and from a dataset config alike."""
    cfg = from_flags(model="tiny", data_root=str(data_dir),
                      conditioning=ConditioningConfig(reference_layout=layout, frame_conditioning="first"),
                      num_frames=9, resolution=(32, 32), device="cpu")
    with pytest.raises(ConfigError, match=rf"^--reference-layout {layout} places element references: it needs "
                                          r"element images \(--dataset-type e2v, --frame-conditioning full\)$"):
        train_a2.run_datasets(cfg)
    cfg_file = tmp_path / "ds.json"
    cfg_file.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "processors": {"vae": {
        "reference_layout": layout, "frame_conditioning": "first"}}}]}))
    with pytest.raises(ConfigError, match=rf"processors.vae: reference_layout {layout} places element references; "
                                          r"frame_conditioning 'first' conditions on video frames \(use full\)$"):
        train_a2.run_datasets(from_flags(model="tiny", dataset_config=str(cfg_file), device="cpu"))


def test_one_conditioning_section_for_the_flags_both_clis_and_a_dataset_file(data_dir, tmp_path, capsys):
    """train_a2.py, infer.py and a dataset file's processors.vae take the same conditioning settings (one dataclass,
    its choices checked the same way); with --dataset-config the file holds and a flag that disagrees is refused in
    one line; a file's vae_sample_mode is the run's encode mode."""
    from dataclasses import fields

    import infer
    from a2.cli import option_names
    from a2.config.dataset_config import VaeProcessorConfig, load_dataset_config

    names = [f.name for f in fields(ConditioningConfig)]
    assert [f.name for f in fields(VaeProcessorConfig)][:len(names)] == names
    for cli in (TrainConfig, infer.InferConfig):
        assert next(f for f in fields(cli) if f.name == "conditioning").default_factory is ConditioningConfig
        assert "conditioning options" in tyro_help(cli)
        assert {"--reference-layout", "--vae-sample-mode", "--sample-mode"} <= set(option_names(cli))  # typo hints
    flags = tyro.cli(TrainConfig, args=["--reference-layout", "incontext", "--combine", "after", "--sample-mode",
                                        "argmax"])
    assert flags.conditioning == ConditioningConfig(reference_layout="incontext", combine="after",
                                                    vae_sample_mode="argmax")
    cfg_file = tmp_path / "ds.json"
    elements = [{"name": "subject", "suffixes": ["_person.png"]}]
    vae = {"reference_layout": "incontext", "combine": "after", "vae_sample_mode": "sample"}
    cfg_file.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "elements": elements,
                                                  "target_resolution": [32, 32], "processors": {"vae": vae}}]}))
    assert load_dataset_config(cfg_file)[0].vae == VaeProcessorConfig(**vae, resolution=(32, 32))
    cfg = from_flags(model="tiny-t2v", dataset_config=str(cfg_file), num_frames=9, resolution=(32, 32), device="cpu")
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
    assert (run.layout.kind, run.layout.combine, run.encode_mode) == ("incontext", "after", "sample")
    same = with_flags(cfg, conditioning=ConditioningConfig(reference_layout="incontext"))  # agrees with the file
    assert train_a2.run_datasets(same)[0].vae.reference_layout == "incontext"
    other = with_flags(cfg, conditioning=ConditioningConfig(combine="before", reference_timestep="zero"))
    with pytest.raises(ConfigError, match=rf"^--reference-timestep zero: {cfg_file} sets processors.vae."
                                          r"reference_timestep to 'shared'; set it in the file, or drop the flag$"):
        train_a2.run_datasets(other)
    # the data's own flags beside the file would be ignored (the file's datasets train): refused, all named
    beside = with_flags(cfg, data_root=str(data_dir), elements=("subject=_person.png",), frame_extraction="head")
    with pytest.raises(ConfigError, match=rf"^--data-root --frame-extraction --elements: {cfg_file} describes the "
                                          r"data \(each dataset's keys of the same names\); set them there"):
        train_a2.run_datasets(beside)
    cfg_file.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "elements": elements,
                                                  "target_resolution": [32, 32],
                                                  "processors": {"vae": {"vae_sample_mode": "mean"}}}]}))
    with pytest.raises(ConfigError, match=r"processors.vae.vae_sample_mode: 'mean' is not one of \('sample', "
                                          r"'argmax', None\)$"):
        load_dataset_config(cfg_file)
    with pytest.raises(ConfigError, match=r"^--frame-conditioning index: infer.py conditions on element images"):
        infer.main(infer.InferConfig.from_flags(model="tiny", elements=(str(data_dir / "000_person.png"),), height=32,
                                                width=32, num_frames=21,
                                                conditioning=ConditioningConfig(frame_conditioning="index")))


def tyro_help(cli) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(cli, args=["--help"])
    return out.getvalue()


def test_the_pipeline_samples_the_layout_it_is_given(tiny_dir, data_dir):
    """A2Pipeline derives no kind of its own: the call takes a layout (the plan's), refuses inputs the layout does
    not take, and the README's library example (pipe.plan, then the call) runs."""
    import re
    from pathlib import Path

    pipe = A2Pipeline.from_pretrained(tiny_dir)
    with pytest.raises(TypeError, match="layout"):
        pipe("x", height=32, width=32, num_inference_steps=1)
    layout = pipe.plan(21, (1, 4, 4))
    assert layout.kind == "prefix" and layout.repeats == (1, 4, 4)
    with pytest.raises(ValueError, match="the prefix layout takes reference images"):
        pipe("x", layout=layout, height=32, width=32, num_inference_steps=1)
    with pytest.raises(ValueError, match="num_frames 17: the layout was planned for 21"):
        pipe("x", torch.zeros(1, 3, 3, 32, 32), layout=layout, num_frames=17, height=32, width=32)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    example = re.search(r"a library caller plans one on the loaded\nmodel:\n\n```python\n(.*?)```", readme, re.S)[1]
    files = [str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png")]
    example = example.replace('["me.png", "bear.png", "forest.png"]', repr(files))
    example = example.replace('"tiny"', repr(str(tiny_dir)))
    example = example.replace("height=64, width=64)", "height=64, width=64, num_inference_steps=2, progress=False)")
    scope = {}
    exec(example, scope)
    assert scope["video"].shape == (1, 3, 33 - 12, 64, 64)


def mixed_elements(data_dir, tmp_path):
    """A copy of the 4-clip dataset whose clips hold 3, 2, 1 and no element images (optional elements missing)."""
    import shutil

    d = tmp_path / "data"
    shutil.copytree(data_dir, d)
    for f in ("001_object.png", "002_object.png", "002_background.png", "003_person.png", "003_object.png",
              "003_background.png"):
        (d / f).unlink()
    return d


THREE = ["--elements", "subject=_person.png", "object=_object.png", "background=_background.png"]


@pytest.mark.parametrize("model,extra", [
    ("tiny", THREE),  # A2's prefix: the roles kept, the absent ones absent
    ("tiny-t2v", [*THREE, "--reference-layout", "incontext", "--num-frames", "9"]),
    ("tiny-v3", [*THREE, "--num-frames", "9"]),
    ("tiny-phantom", [*THREE, "--num-frames", "9"]),
    # MAGREF's canvas of 1 or 2 images (3 side by side would be under a token wide at 32x32)
    ("tiny-magref", ["--num-frames", "9", "--elements", "subject=_person.png:repeat=1",
                     "object=_object.png:repeat=1"]),
])
def test_clips_of_different_element_sets_train_and_one_the_kind_cannot_take_is_left_out(data_dir, tmp_path, capsys,
                                                                                         model, extra):
    """A folder dataset whose clips hold 3, 2 and 1 element images (the object, the background missing: optional
    elements) trains for a full epoch with the kind's defaults, a layout per element set (element_layout); a clip
    with none is named and left out before step 1."""
    d = mixed_elements(data_dir, tmp_path)
    sets = (["subject, object, background", "subject, background", "subject"] if "background=_background.png" in extra
            else ["subject, object", "subject"])
    r = train(*args(d, tmp_path, "mixed", "--max-steps", "3", *extra, model=model))  # magref: 001, 002 the subject
    out = capsys.readouterr().out
    assert "left out 1 the kind cannot take" in out and "left out: 003: " in out
    assert all(f"[{names}]: " in out for names in sets)
    assert len(losses(r["run_dir"])) == 3  # one epoch: every clip it can take, once


def test_no_kind_name_is_compared_outside_the_kind_definitions():
    """Every kind's defaults come from its definition (a2/kinds/kinds.py: KIND_DEFS; a2/kinds/conditioning.py: the
    Layout's properties; a2/plan.py: which kind a model takes from which flags): no project module outside those
    compares a kind name, or a kind set, except the weights' detection (a2/model/transformer.py names the released
    layouts it reads; a2/model/tiny.py builds them) and bench.py's own --layout flag (its choices, config.KIND_NAMES,
    are held equal to KIND_DEFS by tests/test_cli.py). A dataset type that shares a name (t2v) is not a kind."""
    import re
    from pathlib import Path

    from a2.kinds.kinds import KIND_DEFS

    names = "|".join(KIND_DEFS)
    compared = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)|\bkind\b\S*\s+(not\s+)?in\b"""
                          r"|\b[A-Z_]*KINDS\b")
    root = Path(__file__).resolve().parents[1]
    allowed = {"a2/kinds/conditioning.py", "a2/plan.py", "a2/kinds/kinds.py", "a2/model/transformer.py",
               "a2/model/tiny.py", "bench.py"}
    found = [f"{f.relative_to(root)}:{i}: {line.strip()}"
             for f in sorted([*root.glob("*.py"), *root.glob("a2/**/*.py")]) if str(f.relative_to(root)) not in allowed
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if compared.search(re.sub(r"dataset_type\s*==\s*\S+", "", line.split("#")[0]))]
    assert not found, "\n".join(found)
    # and it can fail: the rule finds the comparisons a kind's definition replaced
    assert compared.search('if layout.kind == "magref":') and compared.search("kind not in CHANNEL_KINDS")
    # inside the definitions a kind is named only where it is particular (A2's mini-video, MAGREF's canvas, the
    # frame kinds' validation layout): what differs as data is read from its Kind row
    inside = [line for f in ("kinds/conditioning.py", "plan.py") for line in (root / "a2" / f).read_text().splitlines()
              if re.search(r"""\bkind\b\s*(==|!=)|\bkind\b\S*\s+(not\s+)?in\b|\b[A-Z_]+_KINDS\b""", line.split("#")[0])]
    assert len(inside) <= 20, "\n".join(inside)


def test_no_import_cycle_among_the_projects_modules():
    """The modules import each other in layers (scripts/imports.py's graph, imports inside functions counted: images,
    fake, media at the bottom; conditioning below the pipeline; the tracer above the production modules it
    measures): no cycle, and no library module imports a top-level module (data.py, train_a2.py, ..., and config.py:
    the sections library code takes are a2/config/sections.py's)."""
    from scripts.imports import floors, folders, graph

    g = graph()
    assert floors(g)[1] == []
    assert floors(folders(g))[1] == []  # and none between a2/'s folders
    scripts = [f"{m} -> {d}" for m in g if m.startswith("a2.") for d in g[m] if "." not in d]
    assert scripts == []
    # and it can fail: an arrow back up is a cycle
    assert floors(g | {"a2.images": g["a2.images"] | {"a2.pipeline"}})[1]
    assert floors(folders(g | {"a2.model.tiny": g["a2.model.tiny"] | {"a2.kinds.kinds"}}))[1]


def late_imports(path, root) -> list[str]:
    """`file:line module (why)` for each import inside a function of `path` that has no reason to be there: a
    standard-library module (it costs nothing at the top), or a module the file already imports at its top. What a
    function may import itself: an optional or heavy dependency, or a module whose top-level import would be a cycle.
    `from a2 import x` names the module a2.x (a submodule), not the package."""
    import ast
    import sys

    tree = ast.parse(path.read_text())

    def modules(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        return [f"{node.module}.{a.name}" if (root / node.module.replace(".", "/") / f"{a.name}.py").exists()
                else node.module for a in node.names]

    top = {m for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom) for m in modules(node)}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for m in dict.fromkeys(modules(node)):
                    why = ("standard library" if m.split(".")[0] in sys.stdlib_module_names
                           else "imported at the top" if m in top else None)
                    if why:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {m} ({why})")
    return sorted(set(found), key=lambda f: (f.split(":")[0], int(f.split(":")[1].split()[0])))


def test_no_function_imports_a_module_it_could_import_at_the_top(tmp_path):
    """No function of a2's code (the scripts, a2/) imports a standard-library module or one its file imports at the
    top: those imports cost nothing at the top, where a reader looks for a file's dependencies."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = [f for path in sorted([*root.glob("*.py"), *root.glob("a2/**/*.py")]) for f in late_imports(path, root)]
    assert found == []
    # and it can fail: a stdlib module, a module imported at the top, an a2 submodule beside another one
    (tmp_path / "a2").mkdir()
    for name in ("x", "y"):
        (tmp_path / "a2" / f"{name}.py").write_text("")
    (tmp_path / "m.py").write_text("import torch\nfrom a2 import y\n\n\ndef f():\n    import json\n"
                                   "    from torch import nn\n    from a2 import x\n    from a2 import y\n")
    assert late_imports(tmp_path / "m.py", tmp_path) == ["m.py:6 json (standard library)",
                                                         "m.py:7 torch (imported at the top)",
                                                         "m.py:9 a2.y (imported at the top)"]


def test_ddp_on_mixed_element_sets_equals_one_process(data_dir, tmp_path):
    """2 ranks x micro-batch 1 on clips of two element sets (a global batch holds one bucket: both ranks take the
    same set) == one process x micro-batch 2 on the same samples, after an epoch of both buckets."""
    import shutil

    from tests.conftest import launch

    d = tmp_path / "data"
    shutil.copytree(data_dir, d)
    for f in ("002_object.png", "003_object.png"):
        (d / f).unlink()
    steps = ["--max-steps", "2", "--lr", "1e-2", "--adam-eps", "1e-4"]
    p = launch(args(d, tmp_path, "ddp", "--micro-batch", "1", *steps), nproc=2)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    one = train(*args(d, tmp_path, "one", "--micro-batch", "2", *steps))
    assert "[subject, background]: 2 samples" in out and "[subject, object, background]: 2 samples" in out
    assert max_diff(params(tmp_path / "ddp" / "ckpt-0000002"), params(one["run_dir"] / "ckpt-0000002")) <= 1e-6
    assert losses(tmp_path / "ddp").keys() == losses(one["run_dir"]).keys() == {1, 2}
