"""Wan VACE (a2/kinds/vace.py, detection and loading in a2/model/transformer.py, its LoRA keys in a2/train/lora.py)
against Wan's own VACE sampler and ComfyUI's VACE model written out from their code (tests/their_vace.py) and diffusers'
WanVACEPipeline, on the tiny VACE model (a2/model/tiny.py: tiny-vace, its Wan2.2-VACE-Fun pair and their original-key
layouts)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tyro
from diffusers import UniPCMultistepScheduler, WanVACEPipeline, WanVACETransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from PIL import Image
from safetensors.torch import load_file, save_file

import infer
import train_a2
from a2.config.dataset_config import VaeProcessorConfig
from a2.elements import RELEASED_ELEMENTS
from a2.images import read_image, vace_frame
from a2.kinds import vace
from a2.kinds.kinds import WAN_NEGATIVE_PROMPT
from a2.model.parallel import UlyssesAttnProcessor, context_parallel
from a2.model.tiny import build_tiny, model_path, save_tiny, tiny_model_dir
from a2.model.transformer import (
    UnsupportedModel,
    configure_blocks,
    detect_model,
    diffusers_to_original,
    load_transformer,
    original_to_diffusers,
    preset_config,
    random_transformer,
)
from a2.plan import plan_layout
from a2.train.lora import export_lora, read_original
from config import LORA_TARGETS
from tests import their_vace as theirs
from tests.their_samplers import phantom_sigmas

HEIGHT, WIDTH, FRAMES = 64, 80, 9  # 3 latent frames; the references' odd sizes frame differently in the two samplers
PROMPT = "a man is holding a teddy bear in the forest"


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8))


REFERENCES = [image(61, 47, 1), image(50, 75, 2), image(33, 29, 3)]


@pytest.fixture(scope="module")
def parts():
    return build_tiny(t2v=True, vace=True)


@pytest.fixture(scope="module")
def pipe(parts):
    p = WanVACEPipeline(**parts)
    p.set_progress_bar_config(disable=True)
    return p


@torch.no_grad()  # as the pipelines encode it (UMT5's outputs with autograd on differ from them by 5e-7)
def text(pipe, prompt: str) -> torch.Tensor:
    return pipe.encode_prompt(prompt, do_classifier_free_guidance=False, device="cpu", max_sequence_length=512)[0]


def framed(images, size=(HEIGHT, WIDTH)):
    """The images as Wan frames them, back as PIL at the video's size: both samplers then take them as they are."""
    return [Image.fromarray(((theirs.wan_reference(i, size)[:, 0].permute(1, 2, 0) * 0.5 + 0.5) * 255).round()
                            .clamp(0, 255).byte().numpy()) for i in images]


# ---------------------------------------------------------------- the two public samplers


def test_wans_and_diffusers_samplers_agree_once_every_difference_is_matched(parts, pipe):
    """Wan's WanVace.generate (written out) and diffusers' WanVACEPipeline end far apart with their own defaults;
    with the sigma grid, the references' order, their framing, the shift, the negative prompt and the seed matched
    they agree to float32 rounding, and each difference alone moves the final video latents."""
    steps = 20
    args = (parts["transformer"], parts["vae"])
    cond, null = text(pipe, PROMPT), text(pipe, WAN_NEGATIVE_PROMPT)
    frames = framed(REFERENCES)
    wan = theirs.wan_sample(*args, REFERENCES, cond, null, FRAMES, HEIGHT, WIDTH, steps=steps)["video"]
    wan_framed = theirs.wan_sample(*args, frames, cond, null, FRAMES, HEIGHT, WIDTH, steps=steps)["video"]

    grid = phantom_sigmas(steps)

    def diffusers(refs, shift=theirs.WAN_SHIFT, negative=WAN_NEGATIVE_PROMPT, seed=theirs.VACE_SEED, sigmas=grid):
        pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=shift)
        return theirs.diffusers_sample(pipe, refs, PROMPT, negative, FRAMES, HEIGHT, WIDTH, seed, steps,
                                       sigmas)["video"]

    own = diffusers(REFERENCES, shift=3.0, negative=None, seed=0, sigmas=None)  # its dir's shift, "", another seed
    matched = diffusers(frames[::-1])  # it puts each reference before the ones before it: reversed in, Wan's order
    causes = {"sigma grid": diffusers(frames[::-1], sigmas=None), "reference order": diffusers(frames),
              "shift": diffusers(frames[::-1], shift=3.0), "negative prompt": diffusers(frames[::-1], negative=None),
              "seed": diffusers(frames[::-1], seed=0)}
    framing = diffusers(REFERENCES[::-1])  # diffusers resizes each to a multiple of 8 first: 47 px tall -> 40
    sizes = {k: (v - wan_framed).abs().max().item() for k, v in causes.items()}
    sizes["framing"] = (framing - wan).abs().max().item()
    print(f"defaults {(own - wan).abs().max().item():.3g}, matched {(matched - wan_framed).abs().max().item():.2g}, "
          + ", ".join(f"{k} {v:.2g}" for k, v in sizes.items()))
    assert (matched - wan_framed).abs().max().item() <= 1e-5
    assert (own - wan).abs().max().item() > 0.1
    assert all(v > 1e-4 for v in sizes.values()), sizes


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """What a user hands infer.py: the reference images as files, a control video (uint8 frames, .npz) and its mask
    (a png, white where VACE generates)."""
    d = tmp_path_factory.mktemp("vace_sources")
    for i, r in enumerate(REFERENCES):
        r.save(d / f"ref{i}.png")
    frames = (np.random.default_rng(5).random((FRAMES, HEIGHT, WIDTH, 3)) * 255).astype(np.uint8)
    np.savez(d / "control.npz", frames=frames)
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    mask[16:48, 24:56] = 255  # VACE generates inside the box
    Image.fromarray(mask).save(d / "mask.png")
    return d, frames, mask


@pytest.fixture(scope="module")
def tiny_vace():
    """The built-in tiny-vace model dir (a2/model/tiny.py) as diffusers' WanVACEPipeline loads it."""
    p = WanVACEPipeline.from_pretrained(model_path("tiny-vace"))
    p.set_progress_bar_config(disable=True)
    return p


@pytest.mark.parametrize("control", [False, True], ids=["r2v", "control"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("sampler", ["wan", "diffusers"])
def test_infer_samples_as_wans_vace_code_and_as_diffusers_with_its_preset(sources, tiny_vace, tmp_path, sampler, n,
                                                                          control):
    """`infer.py --model tiny-vace` as a user runs it, no sampling flag (the size and frames given, the tiny model's
    10 steps), ends within 1e-5 of Wan's VACE code (WanVace.generate written out: shift 16, its grid from 0.999,
    Wan's negative prompt, seed 2025, its framing, references in order) in the final latents, references' frames
    included; with --preset diffusers, of diffusers' WanVACEPipeline as its users call it (the dir's shift, its grid,
    no negative prompt, its Lanczos multiple-of-8 framing and reversed order, 50 steps; a random seed there, 2025
    handed to it). 1 and 3 references, R2V and with a control video and its mask (both samplers given the frames and
    mask infer.py read: its own loader is not theirs)."""
    d, frames, mask = sources
    files = [str(d / f"ref{i}.png") for i in range(n)]
    flags = ["--model", "tiny-vace", "--resolution", str(HEIGHT), str(WIDTH), "--num-frames", str(FRAMES),
             "--elements", *files, "--save-latents", str(tmp_path / "a2.pt"), "--decode", "none",
             "--out", str(tmp_path / "v.mp4")]
    flags += ["--control-video", str(d / "control.npz"), "--mask", str(d / "mask.png")] if control else []
    flags += ["--preset", "diffusers"] if sampler == "diffusers" else []
    assert infer.main(tyro.cli(infer.InferConfig, args=flags)) == 0
    got = torch.load(tmp_path / "a2.pt", weights_only=True)["latents"]
    images = [read_image(f) for f in files]
    video = torch.from_numpy(frames).permute(3, 0, 1, 2).float().mul(2 / 255).sub(1) if control else None
    m = torch.from_numpy(mask > 127).float().expand(1, FRAMES, -1, -1) if control else None
    if sampler == "wan":
        want = theirs.wan_sample(tiny_vace.transformer, tiny_vace.vae, images,
                                 text(tiny_vace, infer.InferConfig.prompt), text(tiny_vace, WAN_NEGATIVE_PROMPT),
                                 FRAMES, HEIGHT, WIDTH, steps=10, video=video, mask=m)["latents"]
    else:
        pil = (lambda x: [Image.fromarray(f) for f in x]) if control else (lambda x: None)
        want = theirs.diffusers_sample(tiny_vace, images, infer.InferConfig.prompt, None, FRAMES, HEIGHT, WIDTH,
                                       theirs.VACE_SEED, video=pil(frames),
                                       mask=pil(np.repeat(mask[None, ..., None], 3, -1).repeat(FRAMES, 0)))["latents"]
    d = (got - want).abs().max().item()
    print(f"{sampler}, {n} reference(s), {'control video' if control else 'R2V'}: infer.py vs theirs {d:.2g}")
    assert got.shape == want.shape and d <= 1e-5


def test_framing_is_each_samplers(pipe):
    """a2.vace_frame: Wan's prepare_source framing, and diffusers' with multiple=8 (its preprocess_conditions)."""
    video, _, diffusers_refs = pipe.preprocess_conditions(None, None, REFERENCES, 1, HEIGHT, WIDTH, FRAMES,
                                                          torch.float32, "cpu")
    for got, ref in zip(diffusers_refs[0], REFERENCES):
        assert (vace_frame(ref, (HEIGHT, WIDTH), multiple=8) - got).abs().max().item() <= 1e-6
        assert torch.equal(vace_frame(ref, (HEIGHT, WIDTH)), theirs.wan_reference(ref, (HEIGHT, WIDTH))[:, 0])
    wan, diffusers = vace_frame(REFERENCES[0], (HEIGHT, WIDTH)), vace_frame(REFERENCES[0], (HEIGHT, WIDTH), 8)
    assert (wan - diffusers).abs().max() > 0.1  # 47 px tall: Wan scales it to 61 rows, diffusers (40 first) to 57


# ---------------------------------------------------------------- the forward: diffusers', recomputed, split, LoRA


def _model(seed=1):
    """The tiny VACE transformer, every matrix random (the context blocks' output projections too, which Wan's code
    starts at zero): the hints act."""
    return random_transformer(preset_config("tiny-vace"), torch.float32, "cpu", seed=seed).requires_grad_(True)


def _inputs(frames=4, h=6, w=6):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(1, 16, frames, h, w, generator=g), torch.randn(1, 96, frames, h, w, generator=g),
            torch.tensor([700]), torch.randn(1, 512, 32, generator=g))


def test_forward_is_diffusers_and_recomputes(parts):
    """vace.forward (through the packed input of install) is WanVACETransformer3DModel.forward at scales 1 and 0.5
    (bit for bit), and with every block and context block recomputed (configure_blocks) it gives the same loss and
    gradients."""
    model = _model()
    x, c, t, text = _inputs()
    for scale in (1.0, 0.5):
        want = model(hidden_states=x, timestep=t, encoder_hidden_states=text, control_hidden_states=c,
                     control_hidden_states_scale=torch.full((2,), scale), return_dict=False)[0]
        assert torch.equal(vace.forward(model, x, t, text, c, scale), want)
    vace.install(model, 0.5)
    got = model(hidden_states=vace.pack(x, c), timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    assert torch.equal(got, want)

    def grads(m):
        m.zero_grad()
        m(hidden_states=vace.pack(x, c), timestep=t, encoder_hidden_states=text, return_dict=False)[0].square().mean() \
            .backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = grads(model)
    configure_blocks(model, 1.0, save_attention=True)
    assert all(b.recomputed for b in [*model.blocks, *model.vace_blocks])
    recomputed = grads(model)
    assert plain.keys() == recomputed.keys() and any(".vace_blocks.0.proj_in" in f".{n}" for n in plain)
    assert all(torch.allclose(plain[n], recomputed[n], rtol=1e-5, atol=1e-7) for n in plain)


def _cp_rank(rank: int, world: int, init: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        x, c, t, text = _inputs(frames=3)  # 27 tokens: padded over 2 ranks

        def run(split: bool):
            model = _model()
            if split:
                context_parallel(model, dist.group.WORLD)
            vace.install(model)  # the kind's prepare_model: it splits the context blocks of a split transformer
            assert isinstance(model.vace_blocks[1].attn1.processor, UlyssesAttnProcessor) == split
            out = model(hidden_states=vace.pack(x, c), timestep=t, encoder_hidden_states=text, return_dict=False)[0]
            out.square().mean().backward()
            return out.detach(), {n: p.grad for n, p in model.named_parameters()}

        out, got = run(True)
        for g in got.values():
            dist.all_reduce(g)
        if rank == 0:
            want_out, want = run(False)
            assert (out - want_out).abs().max() <= 1e-6 * max(1.0, want_out.abs().max())
            for name, g in want.items():
                assert (got[name] - g).abs().max() <= 1e-5 * g.abs().max().clamp_min(1e-30), name
    finally:
        dist.destroy_process_group()


def test_context_parallel_equals_one_process(tmp_path):
    """The context blocks under a 2-rank gloo split (their tokens split as the blocks', Ulysses attention): the
    forward and the summed gradients of every weight, the context blocks' included, are one process's."""
    mp.start_processes(_cp_rank, args=(2, f"file://{tmp_path}/init"), nprocs=2, start_method="fork")


@pytest.mark.parametrize("target", sorted(vace.LORA_BLOCKS))
def test_lora_targets_and_exports_load_in_comfyui(target, tmp_path):
    """A LoRA on the blocks, the context blocks or both: the adapted modules are those; its ComfyUI file (original
    Wan keys) has a key ComfyUI's VACE model maps for every weight (comfy/lora.py's rule, on the names of its
    VaceWanModel, which are Wan's: checked by diffusers' own single-file converter), loads with no key left, and the
    patched model's forward, run in ComfyUI's order, is a2's with the adapter within 1e-5; the diffusers file and the
    ComfyUI file read back (read_original) to the same tensors."""
    from peft import LoraConfig

    model = _model().requires_grad_(False)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=vace.lora_target(LORA_TARGETS, target)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(len(name)))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert any(n.startswith("vace_blocks.") for n in adapted) == (target != "base")
    assert any(n.startswith("blocks.") for n in adapted) == (target != "vace")
    x, c, t, text = _inputs()
    vace.install(model)
    with torch.no_grad():
        want = model(hidden_states=vace.pack(x, c), timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    diffusers_file, comfy_file = export_lora(tmp_path, model)
    comfy = load_file(comfy_file)

    original = diffusers_to_original(base_state)  # the weights as Wan's / ComfyUI's VaceWanModel names them
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert back.keys() == base_state.keys() and all(torch.equal(back[k], base_state[k]) for k in back)
    modules = {k.rsplit(".", 2)[0] for k in comfy}
    assert modules <= theirs.comfy_lora_keys(original), sorted(modules - theirs.comfy_lora_keys(original))[:4]
    patched, unloaded = theirs.comfy_patch(original, comfy)
    assert not unloaded
    plain = WanVACETransformer3DModel(**preset_config("tiny-vace"))
    plain.load_state_dict(original_to_diffusers(patched))
    got = theirs.comfy_forward(plain, x, t, text, c)
    d = (got - want).abs().max().item()
    base = theirs.comfy_forward(_model(), x, t, text, c)
    print(f"{target}: {len(comfy) // 2} LoRA pairs, ComfyUI vs a2 {d:.2g}, LoRA effect {(want - base).abs().max():.3f}")
    assert d <= 1e-5 and (want - base).abs().max().item() > 0.02
    assert read_original(comfy).keys() == load_file(diffusers_file).keys()
    assert all(torch.equal(v, load_file(diffusers_file)[k]) for k, v in read_original(comfy).items())


# ---------------------------------------------------------------- detection and loading


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("vace")
    return {"diffusers": tiny_model_dir("tiny-vace"),
            "fun-diffusers": tiny_model_dir("tiny-vace-fun"),
            "original": save_tiny(root / "original", t2v=True, released="vace"),
            "fun-original": save_tiny(root / "fun-original", t2v=True, wan22=True, released="vace-fun")}


def test_detection_and_loading_of_every_layout(layouts):
    """Wan2.1-VACE (diffusers dir; Wan-AI's original keys and config.json) and Wan2.2-VACE-Fun A14B (a diffusers
    pair; alibaba-pai's high_noise_model / low_noise_model dirs) are detected from their weights, load as
    WanVACETransformer3DModel with the same weights in every layout, and plan the vace kind, the references' latent
    frames before the clip's."""
    names = {"diffusers": "Wan2.1 VACE", "original": "Wan2.1 VACE", "fun-diffusers": "Wan2.2 VACE-Fun A14B",
             "fun-original": "Wan2.2 VACE-Fun A14B"}
    weights = {}
    for layout, d in layouts.items():
        info = detect_model(d)
        assert (info.name, info.native_kind, info.in_channels) == (names[layout], "vace", 16)
        assert info.boundary_ratio == (0.875 if "fun" in layout else None)
        assert bool(info.original_weights) == ("original" in layout)
        for expert in ("high", "low") if info.two_experts else (None,):
            model = load_transformer(d, torch.float32, info.subfolder(expert))
            assert isinstance(model, WanVACETransformer3DModel) and model.config.vace_layers == [0, 1]
            weights[layout, expert] = model.state_dict()
        layout = plan_layout(info, RELEASED_ELEMENTS[:2], VaeProcessorConfig(), 9)  # its weights choose the kind
        assert (layout.kind, layout.ref_latents, layout.clip_frames, layout.num_frames) == ("vace", 2, 9, 17)
    for a, b in (("diffusers", "original"), ("fun-diffusers", "fun-original")):
        for expert in ("high", "low") if "fun" in a else (None,):
            assert all(torch.equal(v, weights[b, expert][k]) for k, v in weights[a, expert].items())
    assert not torch.equal(weights["fun-original", "high"]["blocks.0.attn1.to_q.weight"],
                           weights["fun-original", "low"]["blocks.0.attn1.to_q.weight"])


def test_vace_checkpoints_that_do_not_fit_fail_in_one_line(layouts, tmp_path):
    """A config.json whose vace_layers do not fit the context blocks, and a Wan 2.2 expert pair without them."""
    import shutil

    d = shutil.copytree(layouts["original"], tmp_path / "bad")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vace_layers": [0]}))
    with pytest.raises(UnsupportedModel, match=r"2 VACE context blocks, but vace_layers \[0\]") as e:
        detect_model(d)
    assert "\n" not in str(e.value)
    pair = shutil.copytree(layouts["fun-original"], tmp_path / "pair")
    f = pair / "low_noise_model" / "diffusion_pytorch_model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if "vace" not in k}, f)
    cfg = json.loads((pair / "low_noise_model" / "config.json").read_text())
    (pair / "low_noise_model" / "config.json").write_text(json.dumps(
        {k: v for k, v in cfg.items() if "vace" not in k}))
    with pytest.raises(UnsupportedModel, match="without VACE's context blocks"):
        detect_model(pair)


# ---------------------------------------------------------------- the kind's sampler on the VACE-Fun pair, training


def test_the_vace_fun_pair_samples_with_videox_funs_sampler_and_both_experts(sources, tmp_path, monkeypatch):
    """infer.py on the tiny Wan2.2-VACE-Fun pair with no sampling flag samples as VideoX-Fun's predict_s2v.py: its
    FlowMatch Euler at shift 12 (config/wan2.2/wan_civitai_t2v.yaml), seed 43, Wan's negative prompt, guidance 5, 16
    fps; the high-noise expert at sigma >= 0.875, the low-noise one below, as its pipeline switches them."""
    from a2.pipeline import A2Pipeline

    calls, seen = {"high": 0, "low": 0}, {}
    call = A2Pipeline.__call__

    def spy(self, *a, **k):
        for name, model in (("high", self.transformer), ("low", self.transformer_2)):
            model.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        seen["out"] = call(self, *a, **k)
        return seen["out"]

    monkeypatch.setattr(A2Pipeline, "__call__", spy)
    d = sources[0]
    assert infer.main(tyro.cli(infer.InferConfig, args=[
        "--model", "tiny-vace-fun", "--resolution", str(HEIGHT), str(WIDTH), "--num-frames", str(FRAMES),
        "--elements", str(d / "ref0.png"), "--out", str(tmp_path / "v.mp4")])) == 0
    s = seen["out"]["sampling"]
    assert (s.scheduler, s.schedule, s.flow_shift, s.seed, s.guidance_scale, s.fps, s.steps) == \
        ("euler", "diffusers", 12.0, 43, 5.0, 16, 10)
    assert s.negative_prompt == WAN_NEGATIVE_PROMPT and calls["high"] > 0 and calls["low"] > 0
    assert (tmp_path / "v.mp4").stat().st_size > 0


@pytest.fixture(scope="module")
def vace_run_data(tmp_path_factory):
    from data import make_synthetic_dataset

    return make_synthetic_dataset(tmp_path_factory.mktemp("vace_data") / "e2v", num_samples=2, num_frames=9,
                                  size=(32, 32))


def test_training_adapts_the_context_blocks_by_default_and_exports_what_loads(vace_run_data, tmp_path):
    """A LoRA run on tiny-vace adapts VACE's context blocks alone by default, the transformer blocks alone with
    --vace-lora-target base; its files load back through infer.py's loader (diffusers and ComfyUI keys); a full
    fine-tune of Wan-AI's original-key release exports a VACE transformer dir and the same weights in its original
    keys, which a2 reads back as Wan2.1 VACE."""
    from safetensors import safe_open

    from a2.pipeline import A2Pipeline
    from a2.train.lora import load_lora
    from tests.conftest import args, train

    base = ["--num-frames", "9", "--max-steps", "1", "--text-dropout", "0"]
    for blocks, want in ((None, "vace_blocks."), ("base", "blocks.")):
        flags = base + ([] if blocks is None else ["--vace-lora-target", blocks])
        run = train(*args(vace_run_data, tmp_path, f"lora-{blocks}", *flags, model="tiny-vace"))["run_dir"]
        with safe_open(run / "pytorch_lora_weights.safetensors", "pt") as f:
            modules = {k.removeprefix("transformer.").split(".lora_")[0] for k in f.keys()}
        assert modules and all(m.startswith(want) for m in modules), sorted(modules)[:3]
        for file in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfy.safetensors"):
            said = load_lora(A2Pipeline.from_pretrained("tiny-vace"), str(run / file))
            assert f"{len(modules)} modules of transformer adapted ({2 * len(modules)} weights matched)" in said, said
    released = save_tiny(tmp_path / "Wan2.1-VACE", t2v=True, released="vace")  # Wan-AI's original keys
    run = train(*args(vace_run_data, tmp_path, "full", *base, "--training-type", "full", model=released))["run_dir"]
    trained = WanVACETransformer3DModel.from_pretrained(run / "transformer")  # the run's transformer/
    original = run / "transformer_original"
    assert (original / "diffusion_pytorch_model.safetensors").is_file()
    info = detect_model(original, None, released)  # (its Wan parts: the release's)
    assert (info.name, info.native_kind) == ("Wan2.1 VACE", "vace")
    back = load_transformer(original, torch.float32).state_dict()
    assert all(torch.equal(v, back[k]) for k, v in trained.state_dict().items())


def test_vace_mistakes_are_one_line_before_any_weights_load(sources, vace_run_data, tmp_path, monkeypatch):
    """A control video or mask for a model without context blocks, a mask without its video, --vace-scale off VACE,
    --vace-lora-target off VACE, reference dropout on VACE (its guidance keeps the references), a preset VACE does not
    have: each a ConfigError / InputError of one line, before a transformer is loaded."""
    from a2.cli import InputError
    from tests.conftest import train_config

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the mistake was said")

    monkeypatch.setattr(infer, "load_transformer", no_weights)
    monkeypatch.setattr(train_a2, "load_transformer", no_weights)
    d = sources[0]
    ref, video, mask = str(d / "ref0.png"), str(d / "control.npz"), str(d / "mask.png")
    sample = ["--resolution", str(HEIGHT), str(WIDTH), "--num-frames", str(FRAMES), "--out", str(tmp_path / "v.mp4")]
    for flags, said in (
            (["--model", "tiny-phantom", "--elements", ref, "--control-video", video],
             "--control-video / --mask condition a VACE model; the phantom kind takes none"),
            (["--model", "tiny-vace", "--elements", ref, "--mask", mask],
             "--mask .*: it says where in --control-video"),
            (["--model", "tiny-vace", "--elements", ref, "--control-video", str(d / "none.npz")], "no such file"),
            (["--model", "tiny-phantom", "--elements", ref, "--vace-scale", "0.5"],
             "--vace-scale 0.5 scales the hints of VACE's context blocks; .* is no VACE model"),
            (["--model", "tiny-phantom", "--elements", ref, "--preset", "diffusers"],
             "--preset diffusers: the phantom kind samples in its own way")):
        with pytest.raises(InputError, match=said) as e:
            infer.main(tyro.cli(infer.InferConfig, args=[*flags, *sample]))
        assert "\n" not in str(e.value)
    run = ["--data-root", str(vace_run_data), "--resolution", "32", "32", "--num-frames", "9", "--device", "cpu"]
    for flags, said in ((["--model", "tiny-phantom", "--vace-lora-target", "base"],
                         "--vace-lora-target base: the phantom kind's model has no VACE context blocks"),
                        (["--model", "tiny-vace", "--reference-dropout", "0.1"],
                         "--reference-dropout: VACE samples with its references in both guidance branches")):
        cfg = train_config([*flags, *run])
        with pytest.raises(InputError, match=said) as e:
            train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
        assert "\n" not in str(e.value)


def test_wans_own_release_dir_names_its_missing_parts_and_fetches_them_alone(layouts, tmp_path, monkeypatch):
    """Wan2.1-VACE as Wan-AI ships it: the DiT in original keys with its config.json, the VAE and T5 as .pth files a2
    does not read. Offline without its Wan T2V parts: one line naming the dir, the parts (vae/, text_encoder/,
    tokenizer/) and --components, not a Hub id called "no such local dir". Online they are fetched alone
    (huggingface_hub's allow_patterns: not the 1.3B transformer it never reads); --components supplies them."""
    import shutil

    import huggingface_hub

    from a2.model.transformer import UnsupportedModel, detect_model

    d = tmp_path / "Wan2.1-VACE-1.3B"
    d.mkdir()
    for f in layouts["original"].iterdir():
        if f.is_file():  # the checkpoint and its config.json, none of the diffusers parts' dirs
            shutil.copy(f, d / f.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnsupportedModel) as e:
        detect_model(d)
    said = str(e.value)
    assert said.startswith(f"{d}: its Wan T2V parts (vae/, text_encoder/, tokenizer/ in diffusers format) are not "
                           "beside it: --components DIR names a dir holding them; else they come from "
                           "Wan-AI/Wan2.1-T2V-1.3B-Diffusers on the Hugging Face Hub, which is not in the Hugging Face "
                           "cache"), said
    assert "\n" not in said and "no such local dir" not in said
    assert detect_model(d, components=str(layouts["diffusers"])).components_dir == layouts["diffusers"]
    asked = {}
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: asked.update(kw, repo=repo) or str(layouts["diffusers"]))
    assert detect_model(d).components_dir == layouts["diffusers"]
    assert asked["repo"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert sorted(asked["allow_patterns"]) == ["scheduler/*", "text_encoder/*", "tokenizer/*", "vae/*"]
