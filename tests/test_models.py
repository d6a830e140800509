"""Base models: detection of each supported model dir (and clear errors for the others), Wan 2.2 A14B expert
training (sigma range, the right transformer, export), reload and sampling with both experts, and parity of
A2Pipeline with diffusers' Wan 2.2 pipelines."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from a2.model.transformer import UnsupportedModel, detect_model
from config import from_flags
from tests.conftest import args, assert_rounding, train


@pytest.fixture(scope="module")
def wan22_t2v_dir(tmp_path_factory):
    from a2.model.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("wan22_t2v") / "model", t2v=True, wan22=True)


@pytest.fixture(scope="module")
def wan22_i2v_dir(tmp_path_factory):
    from a2.model.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("wan22_i2v") / "model", wan22=True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from data import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("data") / "e2v", num_samples=4, num_frames=17,
                                  size=(32, 32))


def configs_only(src, dst):
    """A copy of a model dir's configs without weights: all detection reads."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return dst


def edit(path, **changes):
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# ---------------------------------------------------------------- detection


def test_detects_each_supported_model(tiny_dir, tiny_t2v_dir, wan22_t2v_dir, wan22_i2v_dir, tmp_path):
    i2v, t2v, w22t, w22i = (detect_model(d) for d in (tiny_dir, tiny_t2v_dir, wan22_t2v_dir, wan22_i2v_dir))
    assert (i2v.name, i2v.in_channels, i2v.image_branch, i2v.boundary_ratio) == ("Wan2.1 I2V", 36, True, None)
    assert i2v.image_encoder_dir == tiny_dir and i2v.image_encoder_dim == 32
    assert (t2v.name, t2v.in_channels, t2v.image_branch, t2v.image_encoder_dir) == ("Wan2.1 T2V", 16, False, None)
    assert (w22t.name, w22t.in_channels, w22t.image_branch, w22t.boundary_ratio) == ("Wan2.2 T2V A14B", 16, False,
                                                                                      0.875)
    assert (w22i.name, w22i.in_channels, w22i.image_branch, w22i.boundary_ratio) == ("Wan2.2 I2V A14B", 36, False,
                                                                                      0.9)
    assert w22i.image_encoder_dir is None
    # SkyReels-A2: the Wan2.1 I2V architecture, named by its own pipeline / transformer class
    a2 = configs_only(tiny_dir, tmp_path / "a2")
    edit(a2 / "model_index.json", _class_name="A2Pipeline")
    edit(a2 / "transformer" / "config.json", _class_name="A2Model")
    assert detect_model(a2).name == "SkyReels-A2"
    # a T2V base with another dir's CLIP (expansion to E2V), and the built-in tiny names
    with_clip = detect_model(tiny_t2v_dir, image_encoder=tiny_dir)
    assert with_clip.image_encoder_dir == tiny_dir and with_clip.image_encoder_dim == 32
    from a2.model.tiny import model_path

    assert detect_model(model_path("tiny-wan22-i2v")).name == "Wan2.2 I2V A14B"
    # which transformer each expert trains
    assert (w22i.subfolder("high"), w22i.subfolder("low"), i2v.subfolder(None)) == ("transformer", "transformer_2",
                                                                                    "transformer")
    with pytest.raises(UnsupportedModel, match="two experts .*--expert high or --expert low"):
        w22i.subfolder(None)
    with pytest.raises(UnsupportedModel, match="has one transformer; --expert is for Wan 2.2"):
        i2v.subfolder("low")


def _no_index(d):
    (d / "model_index.json").unlink()


def _ti2v_5b(d):  # Wan2.2-TI2V-5B's flags on an I2V dir (tests/test_ti2v.py: the supported 5B layout)
    edit(d / "model_index.json", expand_timesteps=True)
    edit(d / "vae" / "config.json", z_dim=48)
    edit(d / "transformer" / "config.json", in_channels=48, out_channels=48)


def _vae48(d):
    edit(d / "vae" / "config.json", z_dim=48)


def _flux(d):
    edit(d / "transformer" / "config.json", _class_name="FluxTransformer2DModel")


def _vace(d):
    edit(d / "transformer" / "config.json", _class_name="WanVACETransformer3DModel")


def _no_text_encoder(d):
    shutil.rmtree(d / "text_encoder")


def _no_clip(d):
    shutil.rmtree(d / "image_encoder")


def _pair_without_ratio(d):
    shutil.copytree(d / "transformer", d / "transformer_2")
    edit(d / "model_index.json", transformer_2=["diffusers", "WanTransformer3DModel"])


def _ratio_without_pair(d):
    edit(d / "model_index.json", boundary_ratio=0.9)


def _36ch_no_branch_single(d):
    edit(d / "transformer" / "config.json", image_dim=None, added_kv_proj_dim=None)


def _in_channels_20(d):
    edit(d / "transformer" / "config.json", in_channels=20)


@pytest.mark.parametrize("breaks,message", [
    (_no_index, r"model: no model_index.json; expected a diffusers-format model dir"),
    (_ti2v_5b, r"model: expand_timesteps \(TI2V-5B\) needs one transformer with in/out_channels 48 and no image "
               r"branch; transformer has in 48, out 48, image_dim 32"),  # 5B-shaped but with Wan I2V's CLIP branch
    (_vae48, r"model: vae is AutoencoderKLWan with z_dim 48; need the Wan 2.1 AutoencoderKLWan, z_dim 16"),
    (_flux, r"model: transformer is a FluxTransformer2DModel, not a Wan transformer"),
    (_vace, r"model: transformer is a VACE transformer with in/out_channels 36/16, image_dim 32, vace_in_channels "
            r"None; Wan's VACE models take 16/16, none, 96"),  # VACE's class on an I2V config (tests/test_vace.py)
    (_no_text_encoder, r"model: component 'text_encoder' is missing"),
    (_no_clip, r"model: the transformer has a CLIP image branch .* pass --image-encoder DIR"),
    (_pair_without_ratio, r"model: transformer_2 is listed but boundary_ratio is None"),
    (_ratio_without_pair, r"model: boundary_ratio 0.9 is set but there is no transformer_2"),
    (_36ch_no_branch_single, r"model: 36 input channels without an image branch and one transformer"),
    (_in_channels_20, r"model: transformer has in_channels 20, out_channels 16"),
])
def test_unsupported_dirs_fail_clearly(tiny_dir, tmp_path, breaks, message):
    d = configs_only(tiny_dir, tmp_path / "model")
    detect_model(d)  # intact: supported
    breaks(d)
    with pytest.raises(UnsupportedModel, match=message):
        detect_model(d)


def test_unsupported_pairs_and_paths(wan22_i2v_dir, tiny_dir, tmp_path):
    d = configs_only(wan22_i2v_dir, tmp_path / "pair")
    edit(d / "transformer_2" / "config.json", in_channels=16)
    with pytest.raises(UnsupportedModel, match=r"transformer and transformer_2 take different inputs"):
        detect_model(d)
    with pytest.raises(UnsupportedModel, match=r"nowhere: not a directory"):
        detect_model(tmp_path / "nowhere")
    with pytest.raises(UnsupportedModel, match=r"--image-encoder needs image_encoder/"):
        detect_model(tiny_dir, image_encoder=tmp_path)


# ---------------------------------------------------------------- expert sigma ranges


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform", "shifted"])
def test_expert_sigma_is_the_truncated_distribution(sampling):
    """Each expert's sigmas stay in its range and follow the configured distribution restricted to it: the same
    as rejection sampling from the unrestricted sampler (two-sample Kolmogorov-Smirnov)."""
    from a2.train.flow import sample_generator, sample_sigma

    cfg = from_flags(sigma_sampling=sampling).objective
    b, n = 0.875, 3000
    g = torch.Generator().manual_seed(1)
    free = np.array([sample_sigma(cfg, g) for _ in range(40 * n)])  # the unrestricted sampler
    for lo, hi in ((b, 1.0), (0.0, b)):
        s = np.array([sample_sigma(cfg, sample_generator(0, 0, k), lo, hi) for k in range(n)])
        assert s.min() >= lo and (s.max() <= 1.0 if hi == 1.0 else s.max() < hi)
        assert (torch.tensor(s, dtype=torch.float32) * 1000 >= 1000 * b).all() == (lo == b)  # its side in float32
        ref = free[(free >= lo) & (free < hi) if hi < 1 else free >= lo][:n]
        assert len(ref) >= 500, len(ref)
        grid = np.sort(np.concatenate([s, ref]))
        ks = np.abs(np.searchsorted(np.sort(s), grid, "right") / len(s)
                    - np.searchsorted(np.sort(ref), grid, "right") / len(ref)).max()
        assert ks < 1.95 * np.sqrt(1 / len(s) + 1 / len(ref)), (lo, hi, ks)  # alpha 0.001


# ---------------------------------------------------------------- Wan 2.2 experts: train, export, reload, sample


def record_loads(monkeypatch):
    """Wrap load_transformer (training's and validation's): which subfolders were loaded, and the timesteps each
    model saw."""
    import a2.eval.evaluate
    import train_a2

    seen = []
    real = train_a2.load_transformer

    def load(model_dir, dtype=torch.float32, subfolder="transformer"):
        model = real(model_dir, dtype, subfolder)
        steps = []
        model.register_forward_pre_hook(lambda m, a, k: steps.extend(k["timestep"].flatten().tolist()),
                                        with_kwargs=True)
        seen.append((subfolder, steps))
        return model

    monkeypatch.setattr(train_a2, "load_transformer", load)
    monkeypatch.setattr(a2.eval.evaluate, "load_transformer", load)
    return seen


def test_wan22_expert_training_export_and_sampling(wan22_i2v_dir, data_dir, tmp_path, monkeypatch):
    import infer
    from a2.model.transformer import load_transformer
    from a2.pipeline import A2Pipeline

    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png", "_background.png"))
    # low expert, LoRA, with a validation video at the end (which needs the other expert too)
    seen = record_loads(monkeypatch)
    r = train(*args(data_dir, tmp_path, "low", "--expert", "low", "--max-steps", "3", "--lr", "5e-2",
                    "--warmup-steps", "0", "--val-elements", *els, "--val-steps", "3", model=wan22_i2v_dir))
    assert [s for s, _ in seen] == ["transformer_2", "transformer"]  # trained expert first; the other for validation
    low_steps, high_steps = seen[0][1], seen[1][1]
    assert len(low_steps) >= 3 and max(low_steps) < 900  # training and validation below the boundary (0.9 * 1000)
    assert high_steps and min(high_steps) >= 900  # the frozen high expert only above it
    assert (r["run_dir"] / "samples" / "step-0000003.mp4").exists()
    lora = r["weights"]
    assert lora.name == "pytorch_lora_weights_low.safetensors"

    # high expert, full fine-tune: only `transformer` is loaded, exported as transformer/
    seen.clear()
    r = train(*args(data_dir, tmp_path, "high", "--expert", "high", "--training-type", "full", "--max-steps", "1",
                    "--lr", "1e-3", "--warmup-steps", "0", model=wan22_i2v_dir))
    assert [s for s, _ in seen] == ["transformer"] and min(seen[0][1]) >= 900
    assert r["weights"] == r["run_dir"] / "transformer"
    trained = load_transformer(r["weights"]).state_dict()
    high, low = (load_transformer(wan22_i2v_dir, subfolder=s).state_dict() for s in ("transformer", "transformer_2"))
    d_high = max((trained[k] - high[k]).abs().max().item() for k in high)
    d_low = max((trained[k] - low[k]).abs().max().item() for k in low)
    assert 0 < d_high < 0.05 < d_low  # it moved, and it started from the high expert, not the low one

    # reload: the full export in place of the model's high expert, sampling with both experts
    pipe = A2Pipeline.from_pretrained(wan22_i2v_dir, transformer=load_transformer(r["weights"]))
    assert all(torch.equal(v, trained[k]) for k, v in pipe.transformer.state_dict().items())
    assert pipe.transformer_2 is not None and pipe.boundary_ratio == 0.9

    # infer.py with --lora-low: the adapter lands on transformer_2 only, and changes the output
    pipes = []
    real_from_pretrained = A2Pipeline.from_pretrained.__func__
    monkeypatch.setattr(A2Pipeline, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pipes.append(real_from_pretrained(cls, *a, **k)) or pipes[-1]))
    base = dict(model=str(wan22_i2v_dir), elements=els, height=32, width=32, num_frames=21, steps=3, device="cpu",
                decode="none", guidance_scale_2=3.0)
    assert infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "plain.pt"))) == 0
    assert infer.main(infer.InferConfig.from_flags(**base, lora_low=str(lora), compare=str(tmp_path / "plain.pt"))) == 1
    p = pipes[-1]
    assert "low" in getattr(p.transformer_2, "peft_config", {}) and not getattr(p.transformer, "peft_config", None)
    with pytest.raises(ValueError, match="expert pair: give --lora-high and/or --lora-low, not --lora"):
        infer.main(infer.InferConfig.from_flags(**base, lora=str(lora)))


def test_wan22_t2v_training_and_bad_combinations(wan22_t2v_dir, wan22_i2v_dir, tiny_dir, data_dir, tmp_path,
                                                 monkeypatch):
    t2v_config = tmp_path / "t2v.json"
    t2v_config.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "dataset_type": "t2v",
                                                    "elements": [], "target_resolution": [32, 32]}]}))
    seen = record_loads(monkeypatch)
    flags = [f for f in args(data_dir, tmp_path, "t2v", "--dataset-config", str(t2v_config), "--num-frames", "17",
                             "--expert", "high", "--max-steps", "1", model=wan22_t2v_dir)
             if f not in ("--data-root", str(data_dir))]  # the file names the data
    r = train(*flags)
    assert [s for s, _ in seen] == ["transformer"] and min(seen[0][1]) >= 875
    assert r["weights"].name == "pytorch_lora_weights_high.safetensors"
    with pytest.raises(UnsupportedModel, match=r"two experts .*--expert high or --expert low"):
        train(*args(data_dir, tmp_path, "a", model=wan22_i2v_dir))
    with pytest.raises(UnsupportedModel, match=r"Wan2.2 I2V A14B\) has no CLIP image branch: E2V there uses the VAE"):
        train(*args(data_dir, tmp_path, "b", "--expert", "low", "--e2v-type", "dual", model=wan22_i2v_dir))
    with pytest.raises(UnsupportedModel, match=r"Wan2.2 T2V A14B\): E2V would expand the trained expert"):
        train(*args(data_dir, tmp_path, "c", "--expert", "low", model=wan22_t2v_dir))
    with pytest.raises(UnsupportedModel, match=r"has one transformer; --expert is for Wan 2.2"):
        train(*args(data_dir, tmp_path, "d", "--expert", "low", model=tiny_dir))
    assert len(seen) == 1  # none of the bad runs loaded a transformer


def test_t2v_base_e2v_vae_only(tiny_t2v_dir, tiny_dir, data_dir, tmp_path, monkeypatch):
    """A T2V base for E2V without CLIP (--e2v-type vae): expanded to 36 channels with no image branch, output
    unchanged at init, and it trains; with --image-encoder, the branch gets that CLIP's width (tiny: 32)."""
    from a2.model.transformer import expand_to_e2v, load_transformer

    base = load_transformer(tiny_t2v_dir).eval()
    e2v = expand_to_e2v(base, image_dim=None).eval()
    assert e2v.config.in_channels == 36 and e2v.config.image_dim is None
    g = torch.Generator().manual_seed(0)
    x, cond, text = (torch.randn(*s, generator=g) for s in ((1, 16, 3, 8, 8), (1, 20, 3, 8, 8), (1, 512, 32)))
    with torch.no_grad():
        want = base(x, torch.tensor([500.0]), text, return_dict=False)[0]
        got = e2v(torch.cat([x, cond], 1), torch.tensor([500.0]), text, return_dict=False)[0]
    assert_rounding(got, want, 256)  # a 36-channel patch embedding: other conv kernels
    import train_a2

    made = []
    real = train_a2.expand_to_e2v
    monkeypatch.setattr(train_a2, "expand_to_e2v", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    full = ("--training-type", "full", "--max-steps", "1")
    train(*args(data_dir, tmp_path, "vae", "--e2v-type", "vae", *full, model=tiny_t2v_dir))
    run = train(*args(data_dir, tmp_path, "dual", "--image-encoder", str(tiny_dir), *full, model=tiny_t2v_dir))
    assert [m.config.image_dim for m in made] == [None, 32]
    # (a LoRA on the expanded base: tests/test_lora_expand.py)
    # the E2V fine-tune of the T2V base samples with elements through infer.py (--transformer, --image-encoder)
    import infer

    els = tuple(str(sorted(data_dir.glob(f"*{s}"))[0]) for s in ("_person.png", "_object.png", "_background.png"))
    out = tmp_path / "e2v.pt"
    assert infer.main(infer.InferConfig.from_flags(model=str(tiny_t2v_dir), transformer=str(run["weights"]),
                                                   image_encoder=str(tiny_dir), elements=els, height=32, width=32,
                                                   num_frames=21, steps=2, device="cpu", decode="none",
                                                   save_latents=str(out))) == 0
    assert torch.load(out)["condition"].shape[1] == 20  # mask | reference latents: the E2V path ran
    with pytest.raises(UnsupportedModel, match=r"is a T2V model: E2V training expands it and needs a CLIP"):
        train(*args(data_dir, tmp_path, "none", "--max-steps", "1", model=tiny_t2v_dir))


# ---------------------------------------------------------------- parity with diffusers' Wan 2.2 pipelines


def hook_experts(pipe):
    calls = {"high": [], "low": []}
    for name, m in (("high", pipe.transformer), ("low", pipe.transformer_2)):
        m.register_forward_pre_hook(lambda _m, _a, k, name=name: calls[name].append(int(k["timestep"][0])),
                                    with_kwargs=True)
    return calls


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_wan22_pair_matches_diffusers(kind, wan22_t2v_dir, wan22_i2v_dir):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from a2.images import pil_to_tensor
    from a2.pipeline import A2Pipeline

    h, w, f, steps = 48, 64, 9, 6
    d = wan22_t2v_dir if kind == "t2v" else wan22_i2v_dir
    ref = (WanPipeline if kind == "t2v" else WanImageToVideoPipeline).from_pretrained(d)
    ref.set_progress_bar_config(disable=True)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
    kw = dict(prompt="a hiker on a mountain", negative_prompt="blurry", height=h, width=w, num_frames=f,
              num_inference_steps=steps, guidance_scale=5.0, guidance_scale_2=3.0, output_type="latent")
    if kind == "i2v":
        kw["image"] = image
    expected = ref(**kw, generator=torch.Generator().manual_seed(7)).frames

    pipe = A2Pipeline.from_pretrained(d)
    calls = hook_experts(pipe)
    x = pil_to_tensor(image)[None, None] if kind == "i2v" else None
    out = pipe(kw["prompt"], x, x, layout=pipe.plan(f, (1,) if kind == "i2v" else ()), negative_prompt="blurry",
               height=h, width=w, num_inference_steps=steps, guidance_scale=5.0, guidance_scale_2=3.0,
               generator=torch.Generator().manual_seed(7), decode="none", progress=False)  # the model's own sampler
    assert out["latents"].shape == expected.shape
    assert (out["latents"] - expected).abs().max().item() <= 1e-5
    # both experts ran, each on its side of the boundary (twice a step: CFG)
    boundary = 1000 * pipe.boundary_ratio
    assert calls["high"] and calls["low"] and len(calls["high"]) + len(calls["low"]) == 2 * steps
    assert min(calls["high"]) >= boundary > max(calls["low"])
    # not vacuous: the same run with the high expert throughout lands far away
    ref.register_to_config(boundary_ratio=None)
    one_expert = ref(**{**kw, "guidance_scale_2": None}, generator=torch.Generator().manual_seed(7)).frames
    assert (one_expert - expected).abs().max().item() > 1e-2
