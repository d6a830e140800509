"""The released subject-to-video models' weights: Phantom-Wan (an original-Wan checkpoint) and SkyReels-V3 R2V (a
diffusers dir with its own transformer class name). The original-Wan <-> diffusers key map, detect_model on each
layout (and their Hub ids), one-line failures, their solver against diffusers' UniPC, their samplers written out
(tests/their_samplers.py) running on the tiny models, and an a2 LoRA in their model layouts."""

import copy
import json
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import train_a2
from a2.model.transformer import UnsupportedModel, detect_model, diffusers_to_original, original_to_diffusers
from tests import their_samplers as theirs
from tests.conftest import train_config


@pytest.fixture(scope="module")
def phantom_dir():
    from a2.model.tiny import model_path

    return model_path("tiny-phantom")


@pytest.fixture(scope="module")
def v3_dir():
    from a2.model.tiny import model_path

    return model_path("tiny-v3")


def one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


# ---------------------------------------------------------------- the key map


@pytest.mark.parametrize("e2v", [False, True])  # T2V (Phantom-Wan's shape), and I2V: the image branch's keys
def test_original_keys_round_trip(e2v):
    """diffusers -> original -> diffusers -> load -> original is the identity, every tensor bit for bit."""
    from diffusers import WanTransformer3DModel

    from a2.model.transformer import preset_config

    torch.manual_seed(0)
    model = WanTransformer3DModel(**preset_config("tiny", e2v=e2v))
    original = diffusers_to_original(model.state_dict())
    assert len(original) == len(model.state_dict())
    for key in ("blocks.1.self_attn.q.weight", "blocks.0.cross_attn.norm_k.weight", "blocks.0.norm3.bias",
                "blocks.0.ffn.2.weight", "blocks.0.modulation", "head.head.bias", "head.modulation",
                "time_projection.1.weight", "text_embedding.2.bias"):
        assert key in original, key
    if e2v:
        assert {"img_emb.proj.0.weight", "img_emb.proj.4.bias", "blocks.0.cross_attn.k_img.weight",
                "blocks.0.cross_attn.norm_k_img.weight"} <= set(original)
    fresh = WanTransformer3DModel(**preset_config("tiny", e2v=e2v))
    fresh.load_state_dict(original_to_diffusers(original), strict=True)
    back = diffusers_to_original(fresh.state_dict())
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    # the two norms that swap names: the original's norm3 is diffusers' (affine) cross-attention norm2
    assert torch.equal(original["blocks.0.norm3.weight"], model.blocks[0].norm2.weight)
    # a name diffusers' converter does not know keeps it: the strict load names it
    with pytest.raises(RuntimeError, match=r"blocks\.0\.attn1\.q_img\.weight"):
        fresh.load_state_dict(original_to_diffusers({**original, "blocks.0.self_attn.q_img.weight": torch.zeros(1)}))


# ---------------------------------------------------------------- detect_model and loading


def test_tiny_phantom_and_v3_are_detected_and_load_the_tiny_t2v_weights(phantom_dir, v3_dir, tiny_t2v_dir):
    from a2.model.transformer import load_transformer

    p = detect_model(phantom_dir)
    assert (p.name, p.native_kind, p.in_channels, p.image_branch) == ("Phantom-Wan", "phantom", 16, False)
    assert p.components_dir == phantom_dir and len(p.original_weights) == 2  # two shards of one index
    v = detect_model(v3_dir)
    assert (v.name, v.native_kind, v.in_channels, v.image_branch) == ("SkyReels-V3 R2V", "v3", 16, False)
    assert not v.original_weights
    want = load_transformer(tiny_t2v_dir).state_dict()
    for d in (phantom_dir, v3_dir):
        got = load_transformer(d).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), d
    assert detect_model(tiny_t2v_dir).native_kind is None  # a plain Wan T2V stays one


def original_sd(phantom_dir):
    sd = {}
    for f in sorted(phantom_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def test_phantom_checkpoint_as_released(phantom_dir, tmp_path):
    """Phantom-Wan-1.3B ships one .pth with no config (heads then default to Wan's 128 wide: with the tiny 32-wide
    heads the config.json is needed, and a wrong one is named); ComfyUI's files carry a `diffusion_model.` prefix;
    the Hub repo holds both sizes, so a dir with two checkpoints asks for one."""
    from a2.model.transformer import load_transformer

    sd = original_sd(phantom_dir)
    d = tmp_path / "release"
    d.mkdir()
    for part in ("vae", "text_encoder", "tokenizer", "scheduler"):
        shutil.copytree(phantom_dir / part, d / part)
    torch.save(sd, d / "Phantom-Wan-1.3B.pth")
    info = detect_model(d / "Phantom-Wan-1.3B.pth")  # the file itself; its dir has the Wan parts
    assert info.original_weights == (d / "Phantom-Wan-1.3B.pth",) and info.components_dir == d
    model = load_transformer(d / "Phantom-Wan-1.3B.pth")
    assert model.config.attention_head_dim == 128 and model.config.num_attention_heads == 1  # no config: Wan's
    shutil.copy(phantom_dir / "config.json", d / "config.json")
    model = load_transformer(d)
    assert model.config.num_attention_heads == 4
    assert torch.equal(diffusers_to_original(model.state_dict())["blocks.1.ffn.0.weight"], sd["blocks.1.ffn.0.weight"])

    save_file({f"diffusion_model.{k}": v.contiguous() for k, v in sd.items()}, d / "comfy.safetensors")
    with pytest.raises(UnsupportedModel) as e:
        detect_model(d)
    one_line(e, "2 original-Wan checkpoints", "Phantom-Wan-1.3B.pth", "comfy.safetensors", "pass one")
    assert detect_model(d / "comfy.safetensors").name == "Phantom-Wan"

    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_layers": 3}))
    with pytest.raises(UnsupportedModel) as e:
        detect_model(d / "comfy.safetensors")
    one_line(e, "config.json does not describe these weights", "num_layers")


@pytest.mark.parametrize("break_it,words", [
    (lambda sd: sd.pop("blocks.1.cross_attn.o.bias"), ["1 missing", "blocks.1.cross_attn.o.bias", "as released"]),
    (lambda sd: sd.update({"blocks.0.self_attn.alpha": torch.zeros(1)}), ["1 unexpected", "self_attn.alpha"]),
    (lambda sd: sd.update({"blocks.0.ffn.2.bias": torch.zeros(3)}), ["1 of another shape", "ffn.2.bias"]),
    (lambda sd: [sd.pop(k) for k in list(sd) if k.startswith("blocks.0.")], ["not an original Wan"]),
    # a key diffusers' converter reshapes as it renames (Wan-Animate's motion encoder): no Wan a2 reads
    (lambda sd: sd.update({"motion_encoder.enc.net_app.convs.1.conv1.1.bias": torch.zeros(1, 3, 1, 1)}),
     ["not a Wan / VACE checkpoint a2 reads"]),
])
def test_bad_phantom_checkpoints_fail_in_one_line_before_loading(phantom_dir, tmp_path, monkeypatch, break_it, words):
    sd = original_sd(phantom_dir)
    break_it(sd)
    f = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, f)
    shutil.copy(phantom_dir / "config.json", tmp_path / "config.json")
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("weights read by detect_model"))
    with pytest.raises(UnsupportedModel) as e:
        detect_model(tmp_path, components=phantom_dir)
    assert one_line(e, *words).startswith(str(f))


def test_other_checkpoints_fail_in_one_line(phantom_dir, tiny_dir, tmp_path):
    from a2.model.transformer import load_transformer

    f = tmp_path / "diffusers_named.safetensors"  # a diffusers transformer's file on its own
    save_file({k: v.contiguous() for k, v in load_transformer(tiny_dir).state_dict().items()}, f)
    with pytest.raises(UnsupportedModel) as e:
        detect_model(f)
    one_line(e, "diffusers key names", "transformer/")
    i2v = tmp_path / "i2v.safetensors"  # an original-Wan I2V model is read as MAGREF: it needs the Wan I2V parts
    save_file({k: v.contiguous() for k, v in diffusers_to_original(load_transformer(tiny_dir).state_dict()).items()},
              i2v)
    with pytest.raises(UnsupportedModel) as e:
        detect_model(i2v, components=phantom_dir)
    one_line(e, "Wan I2V parts dir", "Wan2.1-I2V-14B-480P-Diffusers")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModel) as e:
        detect_model(tmp_path / "empty")
    one_line(e, "no model_index.json", "Phantom-Wan checkpoint")


def test_v3_dir_of_another_shape_fails_in_one_line(v3_dir, tmp_path):
    d = tmp_path / "v3"
    shutil.copytree(v3_dir, d)
    cfg = json.loads((d / "transformer" / "config.json").read_text())
    (d / "transformer" / "config.json").write_text(json.dumps({**cfg, "in_channels": 36}))
    with pytest.raises(UnsupportedModel) as e:
        detect_model(d)
    one_line(e, str(d), "SkyReelsC1WanI2v3DModel", "16/16 and no image branch")


def hub_snapshot(cache, repo_id, src, files=None):
    """A Hub cache entry (models--org--name/{refs/main, snapshots/<rev>/}) holding `src`'s files."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / rev
    shutil.copytree(src, snap, ignore=None if files is None else lambda d, names: [
        n for n in names if d == str(src) and n not in files])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def test_hub_ids(phantom_dir, v3_dir, tiny_t2v_dir, tmp_path, monkeypatch):
    """bytedance-research/Phantom holds the checkpoints only: the Wan parts come from Wan2.1-T2V-1.3B-Diffusers,
    from the cache, or one line saying how to get them."""
    from a2.model.tiny import model_path

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    weights = [f.name for f in phantom_dir.iterdir() if f.is_file()]
    phantom = hub_snapshot(cache, "bytedance-research/Phantom", phantom_dir, weights)
    v3 = hub_snapshot(cache, "Skywork/SkyReels-V3-R2V-14B", v3_dir)
    assert detect_model(model_path("Skywork/SkyReels-V3-R2V-14B")).path == v3
    with pytest.raises(UnsupportedModel) as e:
        detect_model(model_path("bytedance-research/Phantom"))
    one_line(e, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "HF_HUB_OFFLINE")
    wan = hub_snapshot(cache, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", tiny_t2v_dir)
    info = detect_model(model_path("bytedance-research/Phantom"))
    assert info.path == phantom and info.components_dir == wan and info.native_kind == "phantom"



def test_components_flag_names_the_wan_parts(phantom_dir, tmp_path, monkeypatch):
    """A Phantom-Wan checkpoint alone in its dir (as bytedance-research/Phantom ships it) with the Wan parts offline
    elsewhere: --components names them, for infer.py and train_a2.py alike; without it, one line."""
    import infer

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = tmp_path / "Phantom-Wan-tiny.pth"
    torch.save(original_sd(phantom_dir), ckpt)
    shutil.copy(phantom_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(UnsupportedModel) as e:
        detect_model(ckpt)
    one_line(e, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "HF_HUB_OFFLINE")
    assert detect_model(ckpt, components=str(phantom_dir)).components_dir == phantom_dir
    element = tmp_path / "ref.png"
    Image.new("RGB", (40, 24), (200, 30, 30)).save(element)
    out = infer.main(infer.InferConfig.from_flags(model=str(ckpt), components=str(phantom_dir),
                                                  elements=(str(element),), height=32, width=32, num_frames=9, steps=1,
                                                  device="cpu", decode="none", save_latents=str(tmp_path / "x.pt")))
    assert out == 0 and (tmp_path / "x.pt").exists()


# ---------------------------------------------------------------- their solver and samplers


@pytest.mark.parametrize("steps", [3, 8, 50])
def test_their_unipc_is_diffusers_unipc_on_their_schedule(steps):
    """Their FlowUniPC step, written out, == diffusers' UniPCMultistepScheduler given their sigmas, bit for bit; so a2
    can run diffusers' solver on their schedule. The two labs' schedules differ only by Phantom's float32 0.999."""
    from diffusers import UniPCMultistepScheduler

    for unshifted in (theirs.phantom_sigmas, theirs.diffusers034_sigmas):
        sigmas, timesteps = theirs.shifted(unshifted(steps), 5.0)
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
        sched.set_timesteps(sigmas=unshifted(steps))  # an ndarray: a list fails in diffusers
        assert torch.equal(sched.sigmas, sigmas) and torch.equal(sched.timesteps, timesteps), unshifted.__name__
        g = torch.Generator().manual_seed(steps)
        x = a = torch.randn(2, 16, 3, 4, 4, generator=g)
        solver = theirs.FlowUniPC(sigmas)
        for t in timesteps:
            v = torch.randn(x.shape, generator=g)
            x, a = solver.step(v, x), sched.step(v, t, a, return_dict=False)[0]
            assert torch.equal(x, a), (unshifted.__name__, int(t))
    (p, pt), (q, qt) = (theirs.shifted(f(steps), 5.0) for f in (theirs.phantom_sigmas, theirs.diffusers034_sigmas))
    assert torch.equal(pt, qt) and (p - q).abs().max() <= 2 ** -23


def synthetic(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def test_fit_pad_white_geometry():
    """Lanczos to fit (the long side exact, the other truncated), white bars split floor / ceil."""
    import numpy as np

    wide = np.asarray(theirs.fit_pad_white(synthetic(301, 97, 0), 48, 32))  # fits as 48 x int(48 / 3.103) = 15
    assert wide.shape == (32, 48, 3)
    assert (wide[:8] == 255).all() and (wide[23:] == 255).all() and not (wide[8] == 255).all()
    assert not (wide[22] == 255).all()
    tall = np.asarray(theirs.fit_pad_white(synthetic(97, 301, 1), 48, 32))  # 32 high, int(32 * 0.322) = 10 wide
    assert (tall[:, :19] == 255).all() and (tall[:, 29:] == 255).all() and not (tall[:, 19] == 255).all()
    same = synthetic(96, 64, 2)  # the target aspect: a plain Lanczos resize, no bar
    assert np.array_equal(np.asarray(theirs.fit_pad_white(same, 48, 32)),
                          np.asarray(same.resize((48, 32), Image.Resampling.LANCZOS)))


@pytest.fixture(scope="module")
def tiny_parts(tiny_t2v_dir):
    from diffusers import AutoencoderKLWan

    from a2.model.transformer import load_transformer

    g = torch.Generator().manual_seed(7)
    text, null = torch.randn(2, 1, 512, 32, generator=g)
    text[:, 12:], null[:, 5:] = 0, 0  # UMT5 states are zero past the prompt
    vae = AutoencoderKLWan.from_pretrained(tiny_t2v_dir, subfolder="vae").eval()
    return load_transformer(tiny_t2v_dir).eval(), vae, text, null


def test_reference_samplers_run_on_the_tiny_model(tiny_parts):
    """The written-out samplers themselves (not a parity claim): shapes, determinism, their layouts' invariants."""
    transformer, vae, text, null = tiny_parts
    refs = [synthetic(301, 97, 3), synthetic(97, 301, 4)]
    kw = dict(num_frames=9, height=32, width=48, steps=3)
    a = theirs.phantom_sample(transformer, vae, refs, text, null, seed=1, **kw)
    assert a["condition"].shape == (1, 16, 2, 4, 6) and a["initial"].shape == a["latents"].shape == (1, 16, 5, 4, 6)
    assert torch.equal(a["video"], a["latents"][:, :, :3]) and a["timesteps"].tolist()[0] == 999
    with torch.no_grad():  # each reference its own 1-frame clip, posterior mean
        one = vae.encode(theirs.pixels(theirs.fit_pad_white(refs[1], 48, 32))[None, :, None]).latent_dist.mean
    assert torch.equal(a["condition"][:, :, 1:], theirs.normalise(vae, one))
    assert torch.equal(a["initial"], torch.randn(1, 16, 5, 4, 6, generator=torch.Generator().manual_seed(1)))
    again = theirs.phantom_sample(transformer, vae, refs, text, null, seed=1, **kw)
    other = theirs.phantom_sample(transformer, vae, refs, text, null, seed=2, **kw)
    assert torch.equal(a["latents"], again["latents"]) and not torch.equal(a["video"], other["video"])
    assert torch.isfinite(a["latents"]).all()

    for guidance in (1.0, 5.0):  # the distilled preset's single pass; three passes
        b = theirs.v3_sample(transformer, vae, refs, text, null, seed=1, guidance=guidance, guidance_img=2.0, **kw)
        assert b["condition"].shape == (1, 16, 4, 4, 6) and b["latents"].shape == b["initial"].shape == (1, 16, 3, 4, 6)
        assert (b["condition"][:, :, 2:] == 0).all() and (b["condition"][:, :, :2] != 0).all()
        g = torch.Generator().manual_seed(1)  # the noise first, then each reference's posterior sample
        assert torch.equal(b["initial"], torch.randn(1, 16, 3, 4, 6, generator=g))
        with torch.no_grad():
            dist = vae.encode(theirs.pixels(theirs.fit_pad_white(refs[0], 48, 32))[None, :, None]).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g)
        assert torch.equal(b["condition"][:, :, :1], theirs.normalise(vae, z))
        assert torch.equal(b["latents"], theirs.v3_sample(transformer, vae, refs, text, null, seed=1,
                                                          guidance=guidance, guidance_img=2.0, **kw)["latents"])
        assert torch.isfinite(b["latents"]).all()
    with pytest.raises(ValueError, match="at most 4"):
        theirs.v3_sample(transformer, vae, refs * 3, text, null, seed=1, **kw)


# ---------------------------------------------------------------- an a2 LoRA in their model layouts


def merged_original(model_dir, comfy_file, as_state_dict=False):
    """A released original-Wan checkpoint (Phantom-Wan's, MAGREF's: the dir's safetensors shards) with an original-key
    (ComfyUI) LoRA merged in as W + up·down, as Wan and ComfyUI loaders apply it: that state dict in original keys
    (as_state_dict), or converted into WanTransformer3DModel (Phantom's WanModel needs CUDA flash-attn; its forward
    was checked against this conversion outside the suite, see the spec; MAGREF's: tests/test_magref.py)."""
    from a2.model.transformer import load_transformer

    merged, lora = original_sd(model_dir), load_file(comfy_file)
    for key in [k for k in lora if k.endswith(".lora_down.weight")]:
        module = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
        merged[f"{module}.weight"] = merged[f"{module}.weight"] + lora[key.replace("down", "up")] @ lora[key]
    if as_state_dict:
        return merged
    model = load_transformer(model_dir)
    model.load_state_dict(original_to_diffusers(merged), strict=True)
    return model


def test_a2_lora_in_their_model_layouts(phantom_dir, v3_dir, tmp_path):
    """A LoRA trained in a2 (peft on diffusers names) and exported by a2/train/lora.py:
    - Phantom-Wan: its code loads no LoRA; the original-key file (ComfyUI's / Wan's loaders) merged into the
      original-Wan checkpoint as W + up·down, that checkpoint converted into WanTransformer3DModel (Phantom's WanModel
      needs CUDA flash-attn; its forward was checked against this conversion outside the suite, see the spec), gives
      a2's forward up to the rounding of the merge; diffusers' loader of the same file gives it bit for bit.
    - SkyReels-V3: its pipeline is a WanLoraLoaderMixin and its transformer class has WanTransformer3DModel's module
      names (their class needs their repo: the tiny-v3 dir is loaded as WanTransformer3DModel here); the diffusers
      file loads into it and gives a2's forward bit for bit."""
    from diffusers.loaders import WanLoraLoaderMixin
    from peft import LoraConfig

    from a2.model.transformer import load_transformer
    from a2.train.lora import export_lora

    model = load_transformer(phantom_dir)
    torch.manual_seed(0)
    target = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out"]
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=target))  # scale 1: the loaders' convention
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    g = torch.Generator().manual_seed(0)
    x, t, text = torch.randn(1, 16, 5, 4, 6, generator=g), torch.tensor([700]), torch.randn(1, 512, 32, generator=g)

    def forward(m):
        with torch.no_grad():
            return m(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    want = forward(model)
    diffusers_file, comfy_file = export_lora(tmp_path, model)

    got = forward(merged_original(phantom_dir, comfy_file))
    # merging re-associates (W + BA)x vs Wx + B(Ax) in float32: a few ulps per product, through 2 blocks
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert (got - forward(load_transformer(phantom_dir))).abs().max() > 1e-3  # the LoRA matters

    for base, file in ((phantom_dir, comfy_file), (v3_dir, diffusers_file)):
        # from_pretrained (the V3 dir) leaves the weights in the safetensors' memory map, at addresses MKL's float32
        # GEMM sums in another order (6e-7 here); a copy owns aligned storage as the converted checkpoint's does
        m = copy.deepcopy(load_transformer(base))
        m.load_lora_adapter(WanLoraLoaderMixin.lora_state_dict(file), prefix="transformer")
        assert torch.equal(forward(m), want), base


# ---------------------------------------------------------------- a2's sampler against theirs, step by step


def reference_files(tmp_path, sizes):
    """Synthetic reference photos of several aspects as PNG files, and the elements that frame them as both labs do
    (each one frame, Lanczos fit then white pad)."""
    from a2.elements import Element

    images, items = [], []
    for i, (w, h) in enumerate(sizes):
        images.append(synthetic(w, h, 10 + i))
        images[-1].save(tmp_path / f"ref{i}.png")
        element = Element(f"ref{i}", (".png",), position=i, vae_preprocess="fit_pad_white")
        items.append((element, tmp_path / f"ref{i}.png"))
    return images, items


def record_forwards(transformer, seen: list):
    """Each forward's (hidden_states, timestep, encoder_hidden_states) appended to `seen`; returns the hook's handle."""
    return transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append({k: kw[k] for k in ("hidden_states", "timestep", "encoder_hidden_states")}),
        with_kwargs=True)


@pytest.mark.parametrize("kind", ["phantom", "v3", "v3-cfg"])
def test_a2_samples_as_their_code_bit_for_bit(kind, phantom_dir, v3_dir, tmp_path, monkeypatch):
    """infer.py on the tiny released-layout models (their dirs by path: a model as released, not the built-in name's
    smoke-test defaults) with only the flags their scripts take, against their samplers written out
    (tests/their_samplers.py) at their scripts' defaults, float32 on the CPU: the reference latents, the initial
    noise, every forward's input (hidden states with the reference slots, int64 timestep, text) and the final video
    latents are equal bit for bit. Both are fed the same text-encoder outputs (a2's encode_prompt on the tiny UMT5).
    Phantom (generate.py: its prompt, references, size, frames and --base_seed, whose default is random): three passes
    at 7.5 / 5, 50 steps, Wan's negative prompt, the noise for T + L frames; V3 (generate_video.py: prompt,
    references, size, frames; seed 42): its entry point with no sampling flag, a2's default (8 steps, one pass, empty
    negative prompt), and its pipeline class's own defaults (--preset v3-cfg: 50 steps, three passes at 7.5 / 5)."""
    import infer
    from a2.pipeline import A2Pipeline, encode_prompt

    model = phantom_dir if kind == "phantom" else v3_dir
    images, items = reference_files(tmp_path, [(301, 97), (97, 301), (96, 64)])
    prompt, frames, seed = "a hiker on a mountain", 9, 3 if kind == "phantom" else theirs.V3_SEED
    seen, call = [], A2Pipeline.__call__

    def recorded(self, *a, **kw):  # every forward's inputs, through infer.py's own pipeline
        handle = record_forwards(self.transformer, seen)
        try:
            return call(self, *a, **kw)
        finally:
            handle.remove()

    monkeypatch.setattr(A2Pipeline, "__call__", recorded)
    cfg = infer.InferConfig.from_flags(model=str(model), elements=tuple(str(f) for _, f in items), prompt=prompt,
                                       height=32, width=48, num_frames=frames, seed=3 if kind == "phantom" else None,
                                       device="cpu", decode="none", save_latents=str(tmp_path / "a2.pt"),
                                       preset="v3-cfg" if kind == "v3-cfg" else None)
    assert infer.main(cfg) == 0
    ours, a2_calls, seen[:] = torch.load(tmp_path / "a2.pt"), list(seen), []
    pipe = A2Pipeline.from_pretrained(model)
    negative = theirs.WAN_NEGATIVE if kind == "phantom" else ""
    text, null = (encode_prompt(pipe.tokenizer, pipe.text_encoder, [p]) for p in (prompt, negative))
    handle = record_forwards(pipe.transformer, seen)
    kw = dict(num_frames=frames, height=32, width=48, seed=seed)
    if kind == "phantom":
        them = theirs.phantom_sample(pipe.transformer, pipe.vae, images, text, null, steps=theirs.PHANTOM_STEPS,
                                     shift=theirs.PHANTOM_SHIFT, **kw)
        video, steps, passes = them["video"], theirs.PHANTOM_STEPS, 3
    elif kind == "v3":
        them = theirs.v3_sample(pipe.transformer, pipe.vae, images, text, null, steps=theirs.V3_DISTILLED_STEPS, **kw)
        video, steps, passes = them["latents"], theirs.V3_DISTILLED_STEPS, 1
    else:
        them = theirs.v3_sample(pipe.transformer, pipe.vae, images, text, null, steps=theirs.V3_STEPS,
                                guidance=theirs.V3_GUIDE, guidance_img=theirs.V3_GUIDE_IMG, **kw)
        video, steps, passes = them["latents"], theirs.V3_STEPS, 3
    handle.remove()
    assert len(a2_calls) == len(seen) == passes * steps
    assert torch.equal(ours["condition"], them["condition"])  # the reference latents (V3: with its zero slots)
    t = (frames - 1) // 4 + 1
    assert torch.equal(a2_calls[0]["hidden_states"][:, :, :t], them["initial"][:, :, :t])  # the initial noise
    for i, (a, b) in enumerate(zip(a2_calls, seen)):  # every forward: noisy latents + reference slots, t, text
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (i, key)
    assert torch.equal(ours["latents"], video)
    if kind == "phantom":  # the references each fill one slot after the video; the unconditional pass zeroes them
        assert a2_calls[0]["hidden_states"].shape[2] == t + 3 and not a2_calls[2]["hidden_states"][:, :, t:].any()
    else:
        assert a2_calls[0]["hidden_states"].shape[2] == t + 4 and not ours["condition"][:, :, 3:].any()


def test_native_kinds_refuse_other_layouts_in_one_line(phantom_dir, v3_dir, tiny_t2v_dir, tmp_path):
    """A released model takes its own layout: another one, text alone, or a 5th V3 reference fails in one line naming
    the model dir, the kind and the fix, before any weights load; sampling refuses the same."""
    from a2.cli import ConfigError
    from a2.config.dataset_config import ConditioningConfig, VaeProcessorConfig
    from a2.elements import A2_ELEMENTS, Element
    from a2.plan import plan_layout, sampling_plan

    five = tuple(Element(f"e{i}", (f"_{i}.png",), position=i) for i in range(5))
    p, v = detect_model(phantom_dir), detect_model(v3_dir)
    vae = VaeProcessorConfig()
    assert plan_layout(p, A2_ELEMENTS, vae, 9).kind == "phantom" and plan_layout(v, A2_ELEMENTS, vae, 9).kind == "v3"
    lay = plan_layout(p, five, vae, 9)
    assert (lay.ref_latents, lay.repeats, lay.latent_frames) == (5, (1,) * 5, 3 + 5)
    assert plan_layout(v, A2_ELEMENTS, vae, 9).latent_frames == 3 + 4
    with pytest.raises(ConfigError) as e:
        plan_layout(v, five, vae, 9)
    one_line(e, str(v3_dir), "v3 kind holds at most 4", "keep at most 4")
    with pytest.raises(ConfigError) as e:
        plan_layout(p, A2_ELEMENTS, VaeProcessorConfig(reference_layout="incontext"), 9)
    one_line(e, str(phantom_dir), "own phantom layout", "drop --reference-layout incontext")
    with pytest.raises(ConfigError) as e:
        plan_layout(v, (), vae, 9)
    one_line(e, str(v3_dir), "v3 layout", "element images")
    with pytest.raises(ConfigError) as e:
        plan_layout(p, A2_ELEMENTS, vae, 9, e2v_type="dual")
    one_line(e, str(phantom_dir), "no CLIP image branch", "--e2v-type vae")
    with pytest.raises(ConfigError, match="at most 4"):
        sampling_plan(v, (1,) * 5, ConditioningConfig(), 9)
    with pytest.raises(ConfigError, match="own phantom layout"):
        sampling_plan(p, (1,), ConditioningConfig(reference_layout="incontext"), 9)
    assert detect_model(tiny_t2v_dir).native_kind is None  # the kinds come from the weights, nothing else


# ---------------------------------------------------------------- training in their layouts

FIT = ("subject=_person.png:vae=fit_pad_white", "object=_object.png:vae=fit_pad_white",
       "background=_background.png:vae=fit_pad_white")  # their framing; each reference one frame in their kinds


@pytest.mark.parametrize("kind", ["phantom", "v3"])
def test_train_lora_export_infer_round_trip(kind, phantom_dir, v3_dir, data_dir, tmp_path):
    """train_a2.py LoRA on the released model in its own layout (validation samples in it too) -> the exported files ->
    infer.py on the same model: the LoRA changes the video, repeatably, and its ComfyUI-key file gives the same video
    as its diffusers file. Then the LoRA in their model layouts: Phantom-Wan's original-Wan checkpoint with the ComfyUI
    file merged in (W + up·down, as Wan/ComfyUI loaders apply it), and SkyReels-V3's transformer (diffusers' module
    names: its pipeline's load_lora_weights) with the diffusers file, give a2's forward with the LoRA."""
    import infer
    from a2.model.transformer import load_transformer
    from a2.pipeline import A2Pipeline
    from a2.train.lora import load_lora
    from tests.conftest import args, train

    model = str(phantom_dir if kind == "phantom" else v3_dir)
    els = tuple(f"{n}={data_dir / ('000' + s)}" for n, s in (("subject", "_person.png"), ("object", "_object.png"),
                                                            ("background", "_background.png")))
    r = train(*args(data_dir, tmp_path, kind, "--max-steps", "3", "--lr", "5e-2", "--warmup-steps", "0",
                    "--num-frames", "9", "--elements", *FIT, "--reference-dropout", "0.3", "--val-elements", *els,
                    "--val-steps", "2", "--no-val-metrics", model=model))
    run = json.loads((r["run_dir"] / "run.json").read_text())
    assert run["layout"]["kind"] == kind and run["layout"]["ref_latents"] == (3 if kind == "phantom" else 4)
    assert [v.name for v in (r["run_dir"] / "samples").glob("*.mp4")] == ["step-0000003.mp4"]
    diffusers_file, comfy_file = r["weights"], r["run_dir"] / "pytorch_lora_weights_comfy.safetensors"
    base = dict(model=model, elements=els, element_specs=FIT, height=32, width=32, num_frames=9, steps=2,
                device="cpu", out=str(tmp_path / "v.mp4"), preset=None)
    assert infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "base.pt"))) == 0
    saved = torch.load(tmp_path / "base.pt")
    assert saved["latents"].shape == (1, 16, 3, 4, 4) and saved["condition"].shape[2] == run["layout"]["ref_latents"]
    lora = dict(base, lora=str(diffusers_file))
    # the LoRA changes the video
    assert infer.main(infer.InferConfig.from_flags(**lora, save_latents=str(tmp_path / "lora.pt"),
                                                   compare=str(tmp_path / "base.pt"))) == 1
    for f in (diffusers_file, comfy_file):  # repeatably, from either file
        assert infer.main(infer.InferConfig.from_flags(**dict(lora, lora=str(f)), compare=str(tmp_path / "lora.pt"),
                                                       tolerance=0.0)) == 0

    pipe = A2Pipeline.from_pretrained(model)
    load_lora(pipe, str(diffusers_file))
    g = torch.Generator().manual_seed(0)
    x, t, text = torch.randn(1, 16, 7, 4, 6, generator=g), torch.tensor([700]), torch.randn(1, 512, 32, generator=g)

    def forward(m):
        with torch.no_grad():
            return m(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    want = forward(pipe.transformer)
    if kind == "phantom":
        downs = [k for k in load_file(comfy_file) if k.endswith(".lora_down.weight")]
        assert downs and all(k.startswith("diffusion_model.blocks.") for k in downs)  # ComfyUI's original-Wan names
        got = forward(merged_original(phantom_dir, comfy_file))
        # merging re-associates (W + BA)x vs Wx + B(Ax) in float32: a few ulps per product, through 2 blocks
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    else:
        from diffusers.loaders import WanLoraLoaderMixin

        m = copy.deepcopy(load_transformer(v3_dir))  # owned storage, as in test_a2_lora_in_their_model_layouts
        m.load_lora_adapter(WanLoraLoaderMixin.lora_state_dict(str(diffusers_file)), prefix="transformer")
        got = forward(m)
        assert torch.equal(got, forward(copy.deepcopy(pipe.transformer)))
    assert (got - forward(load_transformer(model))).abs().max() > 1e-4  # the LoRA matters


def test_full_fine_tuning_and_reference_dropout(v3_dir, phantom_dir, data_dir, tmp_path):
    """Full fine-tuning of the V3 model in its layout -> infer.py --transformer, of Phantom's -> its original-Wan
    checkpoint as well; reference dropout zeroes every slot
    (both papers' unconditional: the references' latents all zero, the video's untouched)."""

    import infer
    from a2.data.loader import collate
    from data import E2VDataset
    from tests.conftest import args, train

    r = train(*args(data_dir, tmp_path, "full", "--max-steps", "2", "--training-type", "full", "--num-frames", "9",
                    "--elements", *FIT, model=str(v3_dir)))
    assert (r["weights"] / "config.json").exists()
    els = tuple(str(data_dir / f"000{s}") for s in ("_person.png", "_object.png"))
    base = dict(model=str(v3_dir), elements=els, height=32, width=32, num_frames=9, steps=2, device="cpu",
                out=str(tmp_path / "v.mp4"), save_latents=str(tmp_path / "a.pt"))
    assert infer.main(infer.InferConfig.from_flags(**base)) == 0
    # the fine-tuned weights sample
    assert infer.main(infer.InferConfig.from_flags(**dict(base, transformer=str(r["weights"]), save_latents=None),
                                                   compare=str(tmp_path / "a.pt"))) == 1

    # Phantom: the full fine-tune also in original-Wan keys, as Phantom's code loads a checkpoint; a2 reads it back
    from a2.model.transformer import load_transformer

    r = train(*args(data_dir, tmp_path, "full-p", "--max-steps", "1", "--training-type", "full", "--num-frames", "9",
                    "--elements", *FIT, model=str(phantom_dir)))
    original = r["run_dir"] / "transformer_original"
    assert torch.load(original / "Phantom-Wan.pth").keys() == original_sd(phantom_dir).keys()
    assert detect_model(original, components=phantom_dir).native_kind == "phantom"
    want, got = load_transformer(r["weights"]).state_dict(), load_transformer(original).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(not torch.equal(want[k], v) for k, v in load_transformer(phantom_dir).state_dict().items())

    for model in (phantom_dir, v3_dir):
        cfg = train_config(["--model", str(model), "--data-root", str(data_dir), "--resolution", "32",
                                          "32", "--num-frames", "9", "--device", "cpu", "--elements", *FIT])
        run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
        batch = collate([E2VDataset(train_a2.run_datasets(cfg), num_frames=9, verbose=False)[0]])
        enc = train_a2.load_run_encoders(cfg, run, torch.device("cpu"), needed=True)
        for p, dropped in ((0.0, False), (1.0, True)):
            cfg.references.reference_dropout = p
            inputs = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0,
                                           torch.device("cpu"))
            refs = inputs["cond"].ref_latents
            assert refs.shape[2] == run.layout.ref_latents and (refs.abs().max() == 0) == dropped
            assert inputs["x0"].shape[2] == 3 and inputs["x0"].abs().max() > 0


def test_presets_and_fit_pad_white(phantom_dir, v3_dir, tiny_t2v_dir):
    """What infer.py leaves out is the kind's own sampler's (Phantom's 7.5 / 5 and Wan's negative prompt as its
    configs/shared_config.py has it, V3's empty one), filled by A2Pipeline: infer.py passes only the flags given; a
    --preset is another of the lab's own entry points (V3's pipeline class defaults) and no other model takes it; a2's
    fit_pad_white framing is both labs' (odd pads too), and it is an element preprocess mode the configs accept."""
    import numpy as np

    import infer
    from a2.elements import RELEASED_ELEMENTS, parse_elements
    from a2.images import preprocess_image
    from a2.kinds.kinds import kind_sampling
    from a2.model.transformer import detect_model

    def own(model, **flags):
        cfg = infer.resolve(infer.InferConfig.from_flags(model=str(model), elements=("a.png",), num_frames=9,
                                                         **flags))[0]
        info = detect_model(model)
        layout = infer.check_layout(cfg, info, RELEASED_ELEMENTS[:1], False)
        return cfg, layout, kind_sampling(layout.kind, info.name, cfg.sampling.preset)

    _, _, d = own(v3_dir)  # generate_video.py: 8 steps, guidance 1 (one pass: no reference guidance), 24 fps
    assert (d.steps, d.guidance_scale, d.guidance_scale_img, d.fps, d.negative_prompt) == (
        theirs.V3_DISTILLED_STEPS, 1.0, None, 24, "")
    frames = lambda model, **f: infer.own_frames(*infer.resolve(infer.InferConfig.from_flags(model=str(model), **f)),
                                                 detect_model(model))[0].num_frames
    assert frames(v3_dir) == 5 * 24 + 1  # generate_video.py: --duration 5 at 24 fps
    assert frames(v3_dir, num_frames=9) == 9 and frames(phantom_dir) == 81
    assert frames(v3_dir, preset="v3-cfg") == 97 + 8  # the class's num_frames default
    _, _, v = own(v3_dir, preset="v3-cfg")
    assert (v.steps, v.guidance_scale, v.guidance_scale_img, v.fps) == (theirs.V3_STEPS, theirs.V3_GUIDE,
                                                                        theirs.V3_GUIDE_IMG, 24)
    cfg, layout, p = own(phantom_dir, steps=3, fps=30)
    assert (p.steps, p.guidance_scale, p.guidance_scale_img, p.seed, p.fps) == (50, 7.5, 5.0, 42, 16)
    assert p.negative_prompt == theirs.WAN_NEGATIVE
    asked = {}
    infer.generate(cfg, lambda *a, **kw: asked.update(kw), "a prompt", None, None, layout)
    assert (asked["num_inference_steps"], asked["fps"]) == (3, 30)  # given: passed; the rest left to the pipeline
    assert all(asked[k] is None for k in ("guidance_scale", "guidance_scale_img", "negative_prompt", "seed",
                                          "scheduler", "schedule", "flow_shift", "sample_mode"))
    with pytest.raises(ValueError, match="--preset v3-cfg: the phantom kind samples in its own way"):
        own(phantom_dir, preset="v3-cfg")
    nine = infer.resolve(infer.InferConfig.from_flags(num_frames=9))[0]
    five = parse_elements([f"r{i}=_r{i}.png" for i in range(5)])  # infer.py takes any count the kind takes, no other
    with pytest.raises(ValueError, match="the phantom kind takes 1 to 4 element image.s. a sample, this one has 5"):
        infer.check_layout(nine, detect_model(phantom_dir), five, False)
    one = infer.check_layout(nine, detect_model(phantom_dir), five[:1], False)
    assert one.ref_latents == 1
    for i, (w, h) in enumerate([(301, 97), (97, 301), (96, 64), (50, 51)]):
        image = synthetic(w, h, 20 + i)
        assert np.array_equal(np.asarray(preprocess_image(image, "fit_pad_white", (32, 47))),
                              np.asarray(theirs.fit_pad_white(image, 47, 32))), (w, h)
    assert parse_elements(["a=_a.png:vae=fit_pad_white"])[0].vae_preprocess == "fit_pad_white"
