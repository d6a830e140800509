"""The in-context reference layout: clean element latents appended after the video latents on the time axis
of a T2V model's input (Phantom-Wan / SkyReels-V3 R2V). Model input, timesteps and loss against hand-built tensors,
training == sampling input, train -> LoRA -> infer on the tiny T2V model, precompute cache == live."""

import json

import pytest
import torch

import train_a2
from a2.cli import ConfigError
from a2.config.dataset_config import ConditioningConfig, load_dataset_config
from a2.data.loader import collate
from a2.kinds.conditioning import Conditioning, make_layout, model_input, prepare_latents, video_prediction
from a2.pipeline import A2Pipeline
from config import from_flags
from data import E2VDataset
from tests.conftest import args, assert_rounding, losses, max_diff, params, train, train_config

INCONTEXT = ["--reference-layout", "incontext", "--num-frames", "9"]  # 9 video frames (3 latents) + 3 references


def hand_encoded(vae, image: torch.Tensor, frames: int) -> torch.Tensor:
    """One element alone: `frames` copies of the image as a clip, the posterior mode, normalised by hand."""
    clip = image[None, :, None].repeat(1, 1, frames, 1, 1)  # (1, 3, frames, H, W)
    z = vae.encode(clip).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) * (1.0 / std)  # as SkyReels-A2 and diffusers normalise


def setup(data_dir, *extra, model="tiny-t2v"):  # noqa: F811
    """cfg, Run, Encoders and a one-sample batch, as train_a2.main builds them (CPU)."""
    cfg = train_config(["--model", model, "--data-root", str(data_dir), "--resolution", "32", "32",
                                      "--device", "cpu", *INCONTEXT, *extra])
    ds_cfgs = train_a2.run_datasets(cfg)
    run = train_a2.plan_run(cfg, 1, ds_cfgs, torch.device("cpu"))
    dataset = E2VDataset(ds_cfgs, num_frames=run.layout.clip_frames, verbose=False)
    enc = train_a2.load_run_encoders(cfg, run, torch.device("cpu"), needed=True)
    return cfg, run, enc, collate([dataset[0]])


def test_model_input_timesteps_and_prediction_against_hand_built_tensors(tiny_t2v_dir):
    pipe = A2Pipeline.from_pretrained(tiny_t2v_dir)
    g = torch.Generator().manual_seed(0)
    refs = torch.rand(2, 3, 3, 32, 48, generator=g) * 2 - 1  # (B, N, 3, H, W)
    repeats = (1, 4, 5)  # a clip of 5 frames is 2 latents: L_ref = 1 + 1 + 2
    with torch.no_grad():
        cond = prepare_latents(pipe.vae, make_layout("incontext", 9, repeats), references=refs)
        want = torch.cat([torch.cat([hand_encoded(pipe.vae, refs[b, i], k) for i, k in enumerate(repeats)], dim=2)
                          for b in range(2)])
    assert cond.condition is None and cond.num_ref_latents == 0 and cond.kind == "incontext"
    assert want.shape == (2, 16, 4, 4, 6)
    assert_rounding(cond.ref_latents, want, 64)  # a batch of 2 encoded at once against each alone

    x_t = torch.randn(2, 16, 3, 4, 6, generator=g)  # 9 video frames: 3 latents
    ts = torch.tensor([700.0, 250.0])
    x, t = model_input(x_t, cond, ts, (1, 2, 2))
    assert torch.equal(x, torch.cat([x_t, cond.ref_latents], dim=2)) and torch.equal(t, ts)  # shared (Phantom, V3)
    zero = Conditioning("incontext", ref_latents=cond.ref_latents, reference_timestep="zero")
    x, t = model_input(x_t, zero, ts, (1, 2, 2))
    grid = torch.zeros(2, 3 + 4, 4 // 2, 6 // 2)  # the patch grid (T + L_ref, h/2, w/2), frame-major as diffusers
    grid[:, :3] = ts.view(2, 1, 1, 1)
    assert torch.equal(x, torch.cat([x_t, cond.ref_latents], dim=2)) and torch.equal(t, grid.flatten(1))
    # the per-token path is diffusers' own: all tokens at the sample's timestep == the shared timestep
    with torch.no_grad():
        tr, text = pipe.transformer, torch.randn(2, 512, 32, generator=g)
        shared = tr(hidden_states=x, timestep=ts, encoder_hidden_states=text, return_dict=False)[0]
        per_token = tr(hidden_states=x, timestep=ts[:, None].expand(-1, grid[0].numel()), encoder_hidden_states=text,
                       return_dict=False)[0]
        zeroed = tr(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    assert_rounding(per_token, shared, 256)
    assert (zeroed - shared)[:, :, :3].abs().max() > 1e-4  # the references' timestep reaches the video tokens
    # a per-token video timestep (Wan 2.2 TI2V: the first frame's tokens at 0) keeps its tokens; the references
    # get the sample's timestep (shared) or 0 (zero)
    ti2v = grid[:, :3].flatten(1).clone()
    ti2v[:, :6] = 0
    for how, ref_t in (("shared", ts), ("zero", torch.zeros(2))):
        ref_cond = Conditioning("incontext", ref_latents=cond.ref_latents, reference_timestep=how)
        _, t = model_input(x_t, ref_cond, ti2v, (1, 2, 2))
        assert torch.equal(t, torch.cat([ti2v, ref_t[:, None].expand(-1, 4 * 6)], dim=1))
    pred = torch.randn(2, 16, 7, 4, 6, generator=g)
    assert torch.equal(video_prediction(pred, cond), pred[:, :, :3])
    # nothing assumes 16 channels or the 8x VAE: a 48-channel latent (Wan 2.2 TI2V-5B) with its own grid
    refs48, x48 = torch.randn(1, 48, 2, 6, 10), torch.randn(1, 48, 5, 6, 10)
    zero48 = Conditioning("incontext", ref_latents=refs48, reference_timestep="zero")
    x, t = model_input(x48, zero48, torch.tensor([500.0]), (1, 2, 2))
    assert x.shape == (1, 48, 7, 6, 10) and t.shape == (1, 7 * 3 * 5) and t[0, :15 * 5].eq(500).all() and \
        t[0, 15 * 5:].eq(0).all()


@pytest.mark.parametrize("timestep", ["shared", "zero"])
def test_loss_is_on_the_video_latents_only(data_dir, timestep):  # noqa: F811
    cfg, run, enc, batch = setup(data_dir, "--reference-timestep", timestep, "--reference-dropout", "0")
    inputs = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                   torch.device("cpu"))
    cond, sigmas = inputs["cond"], inputs["sigmas"]
    target = inputs["noise"] - inputs["x0"]
    seen = []

    class Model(torch.nn.Module):  # returns the exact target on the video frames, `junk` on the reference frames
        config = type("C", (), {"patch_size": (1, 2, 2)})

        def forward(self, hidden_states, timestep, **kw):
            seen.append((hidden_states, timestep))
            return (torch.cat([target + offset, junk], dim=2),)

    offset, junk = 0.0, torch.full((1, 16, 3, 4, 4), 50.0)
    amp = torch.autocast("cpu", enabled=False)
    loss, _ = train_a2.forward_loss(Model(), inputs, cfg.objective, cfg.references, run, amp, torch.float32)
    assert loss.item() == 0.0
    junk = -junk
    assert train_a2.forward_loss(Model(), inputs, cfg.objective, cfg.references, run, amp,
                                 torch.float32)[0].item() == 0.0
    offset = 1.0  # the video frames do count
    assert train_a2.forward_loss(Model(), inputs, cfg.objective, cfg.references, run, amp,
                                 torch.float32)[0].item() == pytest.approx(1.0)
    hidden, t = seen[0]
    x_t = (1 - sigmas.view(-1, 1, 1, 1, 1)) * inputs["x0"] + sigmas.view(-1, 1, 1, 1, 1) * inputs["noise"]
    assert torch.equal(hidden[:, :, 3:], cond.ref_latents) and cond.ref_latents.abs().max() > 0  # clean: never noised
    torch.testing.assert_close(hidden[:, :, :3], x_t)
    if timestep == "shared":
        assert torch.equal(t, sigmas * 1000)
    else:
        assert torch.equal(t, torch.cat([(sigmas * 1000).expand(3 * 4), torch.zeros(3 * 4)])[None])


def test_reference_dropout_zeroes_the_references(data_dir):  # noqa: F811
    _, _, _, batch = setup(data_dir)
    for p, dropped in ((0.0, False), (1.0, True)):
        cfg, run, enc, _ = setup(data_dir, "--reference-dropout", str(p))
        cond = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                     torch.device("cpu"))["cond"]
        assert cond.ref_latents.shape == (1, 16, 3, 4, 4) and (cond.ref_latents.abs().max() == 0) == dropped


def test_train_lora_export_infer_round_trip(data_dir, tmp_path):  # noqa: F811
    import infer

    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    r = train(*args(data_dir, tmp_path, "ic", "--max-steps", "3", "--lr", "5e-2", "--warmup-steps", "0", *INCONTEXT,
                    "--reference-timestep", "zero", "--val-elements", *els, "--val-steps", "2", "--no-val-metrics",
                    model="tiny-t2v"))
    run = json.loads((r["run_dir"] / "run.json").read_text())
    assert run["layout"]["kind"] == "incontext" and not run["layout"]["expand"]
    assert [v.name for v in (r["run_dir"] / "samples").glob("*.mp4")] == ["step-0000003.mp4"]  # validation samples it
    assert r["weights"].name == "pytorch_lora_weights.safetensors"
    base = dict(model="tiny-t2v", elements=els, height=32, width=32, num_frames=9, steps=2, device="cpu",
                conditioning=ConditioningConfig(reference_layout="incontext", reference_timestep="zero"),
                out=str(tmp_path / "v.mp4"))
    assert infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "base.pt"))) == 0
    saved = torch.load(tmp_path / "base.pt")
    assert saved["latents"].shape == (1, 16, 3, 4, 4) and saved["condition"].shape == (1, 16, 3, 4, 4)
    lora = dict(base, lora=str(r["weights"]))
    assert infer.main(infer.InferConfig.from_flags(**lora, save_latents=str(tmp_path / "lora.pt"), compare=str(
        tmp_path / "base.pt"))) == 1  # the LoRA changes the video...
    # repeatably
    assert infer.main(infer.InferConfig.from_flags(**lora, compare=str(tmp_path / "lora.pt"), tolerance=0.0)) == 0
    other = dict(lora, elements=tuple(str(data_dir / f"001{s}") for s in ("_person.png", "_object.png",
                                                                          "_background.png")))
    # ...and so do the refs
    assert infer.main(infer.InferConfig.from_flags(**other, compare=str(tmp_path / "lora.pt"))) == 1
    with pytest.raises(ConfigError, match="36 input channels .* incontext is for T2V models"):
        infer.main(infer.InferConfig.from_flags(**dict(base, model="tiny")))


def test_cached_training_equals_live_training(data_dir, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    steps = ["--max-steps", "3", "--text-dropout", "0.5", "--reference-dropout", "0.3", *INCONTEXT]
    live = train(*args(data_dir, tmp_path, "live", *steps, model="tiny-t2v"))
    train(*args(data_dir, tmp_path, "pre", "--cache-dir", str(cache), "--precompute", *INCONTEXT, model="tiny-t2v"))
    (key_dir,) = cache.iterdir()
    assert len(torch.load(key_dir / "samples" / "0.pt")["posteriors"]) == 3 + 1  # one encode per element, the clip
    cached = train(*args(data_dir, tmp_path, "cached", "--cache-dir", str(cache), *steps, model="tiny-t2v"))
    assert losses(cached["run_dir"]) == losses(live["run_dir"])
    assert max_diff(params(cached["run_dir"] / "ckpt-0000003"), params(live["run_dir"] / "ckpt-0000003")) == 0.0
    # the channel layout of the same data and the same 9-frame clip (21 - 3 reference latents) is another cache
    with pytest.raises(FileNotFoundError, match="--precompute first"):
        train(*args(data_dir, tmp_path, "chan", "--cache-dir", str(cache), "--max-steps", "1", "--num-frames", "21",
                    "--e2v-type", "vae", "--training-type", "full", model="tiny-t2v"))


def test_config_names_and_refusals(data_dir, tmp_path):  # noqa: F811
    cfg_file = tmp_path / "ds.json"
    vae = {"reference_layout": "incontext", "reference_timestep": "zero"}
    elements = [{"name": "subject", "suffixes": ["_person.png"]}]
    cfg_file.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "elements": elements,
                                                  "processors": {"vae": vae}}]}))
    (ds,) = load_dataset_config(cfg_file)
    assert (ds.vae.reference_layout, ds.vae.reference_timestep) == ("incontext", "zero")
    cfg = from_flags(model="tiny-t2v", dataset_config=str(cfg_file), num_frames=9, device="cpu")
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
    assert (run.layout.kind, run.layout.clip_frames, run.layout.ref_latents) == ("incontext", 9, 1)
    for bad, message, els in (({"reference_layout": "time"}, "reference_layout: 'time' is not one of", elements),
                              ({"reference_layout": "incontext", "frame_conditioning": "first"}, "use full", elements),
                              (vae, r"datasets\[0\] lists no elements", [])):
        cfg_file.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "elements": els,
                                                      "processors": {"vae": bad}}]}))
        with pytest.raises(ConfigError, match=message):
            load_dataset_config(cfg_file)
    _, run, _, _ = setup(data_dir, "--expert", "low", model="tiny-wan22-t2v")  # a Wan 2.2 T2V expert: a LoRA too
    assert (run.layout.kind, run.layout.expand, run.subfolder) == ("incontext", False, "transformer_2")
    with pytest.raises(ConfigError, match="36 input channels .* incontext is for T2V models"):
        setup(data_dir, model="tiny")
    with pytest.raises(ConfigError, match="no CLIP image branch"):
        setup(data_dir, "--e2v-type", "dual")
    with pytest.raises(ConfigError, match="needs element images"):
        setup(data_dir, "--dataset-type", "t2v")


def test_reference_guidance_as_phantom(tiny_t2v_dir):
    """guidance_scale_img: three forwards a step, the unconditional one with zero references and the negative prompt;
    u + s_img (r - u) + s (c - r) from the recorded outputs; s_img = 1 is text CFG with the references in both."""
    pipe = A2Pipeline.from_pretrained(tiny_t2v_dir)
    refs = torch.rand(1, 2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out[0])), with_kwargs=True)

    def sample(**kw):
        calls.clear()
        return pipe("a bear", refs, None, layout=pipe.plan(5, (1, 1), ConditioningConfig(reference_layout="incontext")),
                    height=32, width=32, num_inference_steps=1, scheduler="euler",
                    generator=torch.Generator().manual_seed(2), decode="none", progress=False, **kw)["latents"]

    text_cfg = sample(guidance_scale=4.0)
    assert len(calls) == 2
    guided = sample(guidance_scale=4.0, guidance_scale_img=3.0)
    (c_kw, c), (r_kw, r), (u_kw, u) = calls
    assert torch.equal(c_kw["hidden_states"], r_kw["hidden_states"]) and c_kw["hidden_states"][:, :, 2:].abs().max() > 0
    assert torch.equal(u_kw["hidden_states"][:, :, :2], c_kw["hidden_states"][:, :, :2])  # the same noisy video
    assert u_kw["hidden_states"][:, :, 2:].abs().max() == 0  # zero references
    assert torch.equal(r_kw["encoder_hidden_states"], u_kw["encoder_hidden_states"])  # both: the negative prompt
    assert not torch.equal(c_kw["encoder_hidden_states"], r_kw["encoder_hidden_states"])
    pred = (u + 3.0 * (r - u) + 4.0 * (c - r))[:, :, :2]
    noise = c_kw["hidden_states"][:, :, :2]  # sigma 1: x_t is the noise; one Euler step to sigma 0 = noise - pred
    assert_rounding(guided, noise - pred, 16)  # the same sum, another order
    assert_rounding(sample(guidance_scale=4.0, guidance_scale_img=1.0), text_cfg, 16)
    assert (guided - text_cfg).abs().max() > 1e-4
    with pytest.raises(ValueError, match="for reference_layout incontext"):
        pipe("a bear", layout=pipe.plan(5), guidance_scale_img=2.0, height=32, width=32, num_inference_steps=1)
