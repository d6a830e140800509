"""LoRA interop: the exported files (diffusers, original Wan / ComfyUI keys) and a musubi-tuner file load back into
the model with the in-memory adapter's output; T2V-only training on .npz clips + train.jsonl, then text-only
generation with and without the LoRA; infer.py --prompts-file writes one side-by-side video per prompt."""

import json
import re
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from config import LoraSection
from tests.conftest import train

# every Linear the diffusers converter maps back outside the blocks
TOP_TARGETS = (r"proj_out|condition_embedder\.(time_proj|text_embedder\.linear_[12]|time_embedder\.linear_[12]"
               r"|image_embedder\.ff\.net\.(0\.proj|2))")


def transformer_out(tr):
    """One transformer forward on fixed random E2V inputs (36 channels, 512 text + 257 image tokens)."""
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 36, 3, 4, 4, generator=g), torch.randn(1, 512, 32, generator=g)
    image = torch.randn(1, 257, 32, generator=g)
    with torch.no_grad():
        return tr(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                  encoder_hidden_states_image=image, return_dict=False)[0]


def adapted_pipe(tiny_dir, target):
    """The tiny E2V pipeline with a LoRA of rank 4, alpha 8 (scale 2: a lost alpha shows) and non-zero weights."""
    from peft import LoraConfig

    from a2.pipeline import A2Pipeline

    pipe = A2Pipeline.from_pretrained(tiny_dir)
    torch.manual_seed(0)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=target))
    for name, p in pipe.transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return pipe


def musubi_from_original(sd):
    """musubi-tuner keys (lora_unet_blocks_0_self_attn_q.lora_down.weight + .alpha), written from the original-key
    file independently of a2/train/lora.py; alpha = 2·rank with the down matrix halved, so the alpha must be applied."""
    out = {}
    for key, value in sd.items():
        module, kind = key.removeprefix("diffusion_model.").rsplit(".", 2)[0], key.split(".")[-2]
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.{kind}.weight"] = value / 2 if kind == "lora_down" else value
        if kind == "lora_down":
            out[f"{name}.alpha"] = torch.tensor(2.0 * value.shape[0])
    return out


def test_lora_round_trip_through_every_key_format(tiny_dir, tmp_path):
    from a2.pipeline import A2Pipeline
    from a2.train.lora import COMFY_NAME, export_weights, load_lora
    from config import LORA_TARGETS

    pipe = adapted_pipe(tiny_dir, LORA_TARGETS)  # the training default: block attention (+ image K/V) and FFN
    want = transformer_out(pipe.transformer)
    pipe.transformer.disable_lora()
    base = transformer_out(pipe.transformer)
    pipe.transformer.enable_lora()
    exported = export_weights(tmp_path, pipe.transformer, LoraSection(), None)
    comfy = tmp_path / COMFY_NAME
    original = load_file(comfy)
    assert all(k.startswith("diffusion_model.blocks.") for k in original)
    assert "diffusion_model.blocks.1.cross_attn.k_img.lora_down.weight" in original
    assert "diffusion_model.blocks.0.ffn.2.lora_up.weight" in original
    musubi = tmp_path / "musubi" / "lora.safetensors"
    musubi.parent.mkdir()
    save_file(musubi_from_original(original), musubi)
    sources = {"diffusers": exported, "run dir": tmp_path, "original/comfy": comfy, "musubi": musubi}
    formats = {"diffusers": "diffusers keys", "run dir": "diffusers keys", "original/comfy": "original Wan / ComfyUI "
               "keys", "musubi": "musubi-tuner keys"}
    n = len(load_file(exported)) // 2  # adapted modules
    for fmt, path in sources.items():
        loaded = A2Pipeline.from_pretrained(tiny_dir)
        said = load_lora(loaded, str(path))  # infer.py prints it
        assert said == (f"LoRA {path} ({formats[fmt]}): {2 * n} lora_A/lora_B weights, {n} modules of transformer "
                        f"adapted ({2 * n} weights matched), scale 1"), said
        d = (transformer_out(loaded.transformer) - want).abs().max().item()
        print(f"{fmt}: max|Δ| vs in-memory adapter {d:.2e}")
        assert d <= 1e-5, fmt
    assert (want - base).abs().max().item() > 0.05  # the adapter does change the output


def test_original_keys_cover_the_modules_outside_the_blocks(tiny_dir, tmp_path):
    from a2.pipeline import A2Pipeline
    from a2.train.lora import export_lora, load_lora, to_original

    pipe = adapted_pipe(tiny_dir, TOP_TARGETS + r"|blocks\.0\.attn1\.to_q")
    want = transformer_out(pipe.transformer)
    _, comfy = export_lora(tmp_path, pipe.transformer)
    names = {k.rsplit(".", 2)[0] for k in load_file(comfy)}
    assert {"diffusion_model.head.head", "diffusion_model.time_projection.1", "diffusion_model.img_emb.proj.3",
            "diffusion_model.text_embedding.0", "diffusion_model.time_embedding.2"} <= names
    loaded = A2Pipeline.from_pretrained(tiny_dir)
    load_lora(loaded, str(comfy))
    assert (transformer_out(loaded.transformer) - want).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="patch_embedding"):
        to_original({"transformer.patch_embedding.lora_A.weight": torch.zeros(1)})


@pytest.mark.parametrize("extra", [{}, {"alpha_pattern": {"proj_out": 2}, "use_rslora": True}])
def test_peft_save_pretrained_dir_loads(tiny_dir, tmp_path, extra):
    """The peft workflow trains with get_peft_model(transformer, LoraConfig(...)) and saves with save_pretrained:
    a dir of adapter_config.json + adapter_model.safetensors (keys base_model.model.*, alpha in the config)."""
    from peft import LoraConfig, get_peft_model

    from a2.pipeline import A2Pipeline
    from a2.train.lora import load_lora

    transformer = A2Pipeline.from_pretrained(tiny_dir).transformer
    torch.manual_seed(0)
    model = get_peft_model(transformer, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", **extra,
                                                   target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in",
                                                                   "proj_out"]))  # the document's list
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    want = transformer_out(transformer)
    model.save_pretrained(tmp_path / "lora_epoch_0")
    assert any(k.startswith("base_model.model.") for k in load_file(tmp_path / "lora_epoch_0" /
                                                                    "adapter_model.safetensors"))
    pipe = A2Pipeline.from_pretrained(tiny_dir)
    base = transformer_out(pipe.transformer)
    load_lora(pipe, str(tmp_path / "lora_epoch_0"))
    d = (transformer_out(pipe.transformer) - want).abs().max().item()
    print(f"peft dir {extra}: max|Δ| vs the peft model {d:.2e}, LoRA effect {(want - base).abs().max().item():.3f}")
    assert d <= 1e-5 and (want - base).abs().max().item() > 0.05


def test_unusable_lora_files_fail(tiny_dir, tmp_path):
    from a2.pipeline import A2Pipeline
    from a2.train.lora import load_lora

    pipe = A2Pipeline.from_pretrained(tiny_dir)
    save_file({"unet.down.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="no LoRA key matched the transformer"):
        load_lora(pipe, str(tmp_path / "other.safetensors"))  # diffusers alone only warns
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_lora(pipe, str(tmp_path / "nope.safetensors"))
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(ValueError, match=r"dora: a LORA \(DoRA\) adapter; only plain LoRA loads"):
        load_lora(pipe, str(tmp_path / "dora"))


# ---------------------------------------------------------------- T2V-only training on .npz clips


@pytest.fixture(scope="module")
def npz_data(tmp_path_factory):
    """The seed workflow's form: uint8 clips (F, H, W, 3) under `frames` in .npz files, prompts in train.jsonl."""
    d = tmp_path_factory.mktemp("npz")
    rng = np.random.default_rng(0)
    rows = []
    for n in range(2):
        frames = np.broadcast_to(rng.integers(0, 256, 3, dtype=np.uint8), (12, 40, 48, 3)).copy()
        for t in range(12):
            frames[t, 10:22, 3 * t:3 * t + 12] = 255  # a white square moving right
        np.savez(d / f"clip{n}.npz", frames=frames)
        rows.append({"path": f"clip{n}.npz", "prompt": f"a white square moving right, clip {n}"})
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def t2v_args(model, manifest, out, run, *extra):
    return ["--model", str(model), "--dataset-type", "t2v", "--manifest", str(manifest), "--resolution", "32", "32",
            "--num-frames", "9", "--num-workers", "0", "--output-dir", str(out), "--run-name", run, "--log-every",
            "1", "--warmup-steps", "0", "--lr", "5e-2", "--lora-rank", "4", "--lora-alpha", "8",
            "--no-gradient-checkpointing", *extra]


@pytest.fixture(scope="module")
def t2v_run(npz_data, tiny_t2v_dir, tmp_path_factory):
    return train(*t2v_args(tiny_t2v_dir, npz_data / "train.jsonl", tmp_path_factory.mktemp("runs"), "t2v",
                           "--max-steps", "3", "--val-every", "3", "--val-steps", "1"))


def t2v_infer(model, **kw):
    import infer

    base = dict(model=str(model), prompt="a white square moving right", height=32, width=32, num_frames=9, steps=2,
                device="cpu")
    return infer.main(infer.InferConfig.from_flags(**{**base, **kw}))


def test_t2v_only_training_then_text_only_generation(t2v_run, tiny_t2v_dir, tmp_path):
    from a2.train.lora import COMFY_NAME

    run_dir = t2v_run["run_dir"]
    assert t2v_run["step"] == 3 and all(np.isfinite(t2v_run["losses"]))
    # the validation video of a text-only run: the prompt alone, no reference frames beside it
    assert iio.imread(run_dir / "samples" / "step-0000003.mp4", plugin="pyav").shape == (9, 32, 32, 3)
    lora = load_file(t2v_run["weights"])
    # a T2V model trained as it is: attention/FFN LoRA only, no image K/V (there is no image branch)
    assert any(".attn1.to_q.lora_B" in k for k in lora) and not any("add_k_proj" in k for k in lora)
    assert all(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)  # every up matrix trained
    runs = {}
    for name, path in (("base", None), ("lora", t2v_run["weights"]), ("comfy", run_dir / COMFY_NAME)):
        runs[name] = tmp_path / f"{name}.pt"
        assert t2v_infer(tiny_t2v_dir, lora=None if path is None else str(path), out=str(tmp_path / f"{name}.mp4"),
                         save_latents=str(runs[name])) == 0
        assert iio.imread(tmp_path / f"{name}.mp4", plugin="pyav").shape == (9, 32, 32, 3)
    latents = {k: torch.load(v, weights_only=False)["latents"] for k, v in runs.items()}
    assert latents["base"].shape == (1, 16, 3, 4, 4)
    d_lora = (latents["lora"] - latents["base"]).abs().max().item()
    d_comfy = (latents["comfy"] - latents["lora"]).abs().max().item()
    print(f"latents: LoRA vs base max|Δ| {d_lora:.3e}; ComfyUI file vs diffusers file {d_comfy:.2e}")
    assert d_lora > 1e-2 and d_comfy <= 1e-5


def test_t2v_misuse_is_a_clear_error(npz_data, tiny_dir, tiny_t2v_dir, tmp_path):
    with pytest.raises(ValueError, match="takes 36 input channels .* T2V-only training .* needs a T2V model"):
        train(*t2v_args(tiny_dir, npz_data / "train.jsonl", tmp_path, "e2v", "--max-steps", "1"))
    with pytest.raises(ValueError, match="drop --elements"):
        train(*t2v_args(tiny_t2v_dir, npz_data / "train.jsonl", tmp_path, "el", "--elements", "subject=_p.png"))
    from PIL import Image

    Image.new("RGB", (16, 16)).save(tmp_path / "person.png")
    with pytest.raises(ValueError, match="is a T2V model .* or --elements with --reference-layout incontext"):
        t2v_infer(tiny_t2v_dir, elements=(str(tmp_path / "person.png"),))
    assert not list(tmp_path.glob("*/ckpt-*"))


# ---------------------------------------------------------------- evaluation: base | LoRA per prompt


def test_evaluate_writes_one_side_by_side_video_per_prompt(t2v_run, tmp_path, monkeypatch):
    import tyro

    import infer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a white square moving right"}) + "\n\n"
                       + json.dumps({"caption": "a red ball"}) + "\n")
    (tmp_path / "p.txt").write_text("first prompt\n\n  second prompt \n")
    assert [r["prompt"] for r in infer.read_rows(str(tmp_path / "p.txt"))] == ["first prompt", "second prompt"]
    # keep what is written, as tensors: the mp4 coding blurs small differences
    written, real_save = {}, infer.save_video

    def save_video(path, video, *args):
        written[Path(path).name] = video
        return real_save(path, video, *args)

    monkeypatch.setattr(infer, "save_video", save_video)
    out = tmp_path / "eval"
    lora = str(t2v_run["weights"])
    common = ["--model", "tiny-t2v", "--height", "32", "--width", "32", "--num-frames", "9", "--steps", "2",
              "--device", "cpu"]
    run = lambda *argv: infer.main(tyro.cli(infer.InferConfig, args=common + list(argv)))  # noqa: E731
    assert run("--prompts-file", str(prompts), "--lora", str(t2v_run["run_dir"]), "--out-dir", str(out)) == 0
    index = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in index] == ["a white square moving right", "a red ball"]
    assert sorted(p.name for p in out.glob("*.mp4")) == [row["file"] for row in index]
    assert index[0]["file"] == "000_a-white-square-moving-right.mp4"
    for row in index:  # (F, H, base | LoRA, 3)
        assert iio.imread(out / row["file"], plugin="pyav").shape == (9, 32, 64, 3)
    # left half == a plain render of the prompt (same seed) without the LoRA, right half == with it
    assert run("--prompt", index[0]["prompt"], "--out", str(tmp_path / "b.mp4")) == 0
    assert run("--prompt", index[0]["prompt"], "--out", str(tmp_path / "l.mp4"), "--lora", lora) == 0
    both = written[index[0]["file"]]
    assert both.shape == (3, 9, 32, 64)
    assert torch.equal(both[..., :32], written["b.mp4"]) and torch.equal(both[..., 32:], written["l.mp4"])
    d = (written["l.mp4"] - written["b.mp4"]).abs().max().item()
    print(f"evaluate: left half == base render, right half == LoRA render; LoRA vs base pixels max|Δ| {d:.3f}")
    assert d > 1e-2
    with pytest.raises(ValueError, match="give --lora"):
        run("--prompts-file", str(prompts))


# ---------------------------------------------------------------- ComfyUI: which file is for which loader, full models


def test_lora_files_say_which_loader_they_are_for(tiny_dir, tmp_path, capsys):
    """ComfyUI loads none of the diffusers-key file's keys, silently: both files name their loader in their
    safetensors metadata, and export prints the file for ComfyUI."""
    from safetensors import safe_open

    from a2.train.lora import export_lora

    pipe = adapted_pipe(tiny_dir, r"blocks\.\d+\.attn1\.to_q")
    diffusers_file, comfy = export_lora(tmp_path, pipe.transformer)
    meta = {}
    for fmt, path in (("diffusers", diffusers_file), ("comfyui", comfy)):
        with safe_open(path, "pt") as f:
            meta[fmt] = f.metadata()
    assert meta["diffusers"]["a2_format"] == "diffusers" and meta["comfyui"]["a2_format"] == "comfyui"
    assert meta["diffusers"]["format"] == meta["comfyui"]["format"] == "pt"  # what transformers/diffusers check
    assert "ComfyUI loads 0 of its keys: use the _comfy file" in meta["diffusers"]["a2_loader"]
    assert meta["comfyui"]["a2_loader"].startswith("ComfyUI LoraLoader")
    assert f"LoRA for ComfyUI (LoraLoader, original Wan keys): {comfy};" in capsys.readouterr().out


@pytest.mark.parametrize("target, why", [
    (r"patch_embedding|blocks\.\d+\.attn1\.to_q", "LoRA on 'patch_embedding': no original-Wan name"),
    (r"blocks\.\d+\.attn2\.add_k_proj", "reads image K/V LoRAs only as a pair")])
def test_lora_targets_that_cannot_be_exported_fail_before_training(data_dir, tmp_path, monkeypatch, target, why):
    """A --lora-target whose adapter has no original-Wan file that reads back (a conv input layer; image K without V,
    which diffusers' Wan converter only takes as a pair) is refused in one line before the first step."""
    import train_a2
    from a2.cli import ConfigError
    from tests.conftest import args

    def no_step(*a, **k):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(train_a2, "forward_loss", no_step)
    with pytest.raises(ConfigError, match=rf"^--lora-target {re.escape(repr(target))}: .*{why}") as e:
        train(*args(data_dir, tmp_path, "t", "--lora-target", target))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("t2v", [False, True])
def test_full_model_in_original_wan_keys(tiny_dir, tiny_t2v_dir, tmp_path, t2v):
    """A full fine-tune's single file (save_wan_checkpoint): bf16, original Wan names, read back to diffusers names by
    diffusers' own single-file converter (original_to_diffusers: a2's export map against diffusers' reading) with every
    tensor equal; and what ComfyUI's Wan detection
    (comfy/model_detection.py, detect_unet_config, read not run: ComfyUI is not a dependency) reads from it gives this
    model: `head.modulation` marks Wan, dim from it, out_dim from head.head, ffn_dim from blocks.0.ffn.0, layers
    counted over blocks.N, in_dim from patch_embedding, I2V iff img_emb.proj.0.bias is there."""
    from diffusers import WanTransformer3DModel

    from a2.model.transformer import diffusers_to_original, original_to_diffusers, save_wan_checkpoint

    model = WanTransformer3DModel.from_pretrained(tiny_t2v_dir if t2v else tiny_dir, subfolder="transformer")
    sd = model.state_dict()
    path = save_wan_checkpoint(sd, tmp_path / "transformer_comfy.safetensors")
    wan = load_file(path)
    assert wan.keys() == diffusers_to_original(sd).keys() and {v.dtype for v in wan.values()} == {torch.bfloat16}
    assert {"blocks.0.self_attn.q.weight", "blocks.1.cross_attn.norm_k.weight", "blocks.0.norm3.weight",
            "blocks.0.modulation", "head.head.weight", "time_projection.1.bias", "text_embedding.2.weight"} <= set(wan)
    back = original_to_diffusers(dict(wan))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k].bfloat16()) for k in sd)
    c = model.config
    blocks = {int(k.split(".")[1]) for k in wan if k.startswith("blocks.")}
    assert wan["head.modulation"].shape[-1] == c.num_attention_heads * c.attention_head_dim  # ComfyUI's dim
    assert wan["head.head.weight"].shape[0] // 4 == c.out_channels  # out_dim (patch 1x2x2)
    assert wan["blocks.0.ffn.0.weight"].shape[0] == c.ffn_dim and blocks == set(range(c.num_layers))
    assert wan["patch_embedding.weight"].shape[1] == c.in_channels
    assert ("img_emb.proj.0.bias" in wan) == (not t2v)  # ComfyUI's model_type i2v
