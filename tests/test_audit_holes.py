"""Holes a fresh planned-mutation audit found (a realistic one-line bug the suite let pass, each test failing with
it planted), and the memory rule's terms checked one by one against a tiny dry run's trace. Each test holds the
behaviour against something outside a2's tables (a lab's file, the user's flag, the README's sentence, a trace or
a count of the model's own tensors) and captures what the entry point really did."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import drawn_person
from tests.spy import video_file

README = Path(__file__).resolve().parents[1] / "README.md"


def infer_run(argv, out):
    """infer.main on argv as its __main__ parses it, writing out.mp4 and out.pt: (the --save-latents file (final
    latents, the condition the transformer was given), the video file's (fps, frames, (height, width)))."""
    import infer
    from a2.cli import parse_cli
    from config import InferConfig

    cfg = parse_cli(InferConfig, args=[*argv, "--device", "cpu", "--out", f"{out}.mp4", "--save-latents",
                                       f"{out}.pt"])
    assert infer.main(cfg) == 0
    return torch.load(f"{out}.pt", weights_only=False), video_file(f"{out}.mp4")


@pytest.fixture(scope="module")
def a2_elements(tmp_path_factory):
    """SkyReels-A2's three elements (subject, object, background) as files of other aspects than the video's."""
    d = tmp_path_factory.mktemp("a2_elements")
    for name, size, bg in (("person", (40, 28), "white"), ("object", (23, 41), "white"), ("background", (30, 50),
                                                                                         "scene")):
        drawn_person(size, seed=len(name), background=bg).save(d / f"{name}.png")
    return [str(d / f"{n}.png") for n in ("person", "object", "background")]


def test_the_smoke_videos_frames_are_the_sequence_less_the_references(a2_elements, tmp_path):
    """README (the smoke block): infer.py's video of the tiny model, its default 33 frames and A2's three elements,
    has 21 frames: SkyReels-A2 decodes every latent and drops the reference frames, 4 pixel frames per reference
    latent (its own 81 = 12 reference frames + a 69-frame clip), so 33 - 12. The written file is counted."""
    said = re.search(r"infer\.py's video: \d+ pixels wide, \d+ high, (\d+) frames", README.read_text())
    assert said, "the README's smoke sentence about infer.py's video moved"
    _, (_, frames, _) = infer_run(["--model", "tiny", "--resolution", "32", "32", "--steps", "1", "--elements",
                                   *a2_elements], tmp_path / "smoke")
    assert frames == int(said[1]) == 33 - 12


def test_the_vae_sample_mode_flag_reaches_the_encode(a2_elements, tmp_path):
    """--vae-sample-mode (the user's flag) changes the condition infer.py hands the transformer: the tiny model is a
    Wan2.1 I2V model, which diffusers' WanImageToVideoPipeline encodes by the posterior's mode (pipeline_wan_i2v.py:
    retrieve_latents "argmax"); `sample` draws the posterior as SkyReels-A2 does (models/pipeline_a2.py:49-56). A flag
    dropped between the CLI and the pipeline leaves the condition bit-identical (the same ops on the same pixels).
    The tiny VAE's posterior is narrow (its log-variance clamped at -30: std 3e-7), so the draw moves the condition
    by a few float32 steps and the final latents not visibly: the condition is what is compared."""
    run = ["--model", "tiny", "--resolution", "32", "48", "--num-frames", "21", "--steps", "2", "--elements",
           *a2_elements]
    base, _ = infer_run(run, tmp_path / "mode")
    drawn, _ = infer_run([*run, "--vae-sample-mode", "sample"], tmp_path / "sample")
    assert base["condition"].shape == drawn["condition"].shape
    assert not torch.equal(base["condition"], drawn["condition"])


VACE_RUN = ["--model", "tiny-vace", "--resolution", "32", "48", "--num-frames", "9", "--steps", "2"]


@pytest.fixture(scope="module")
def vace_sources(tmp_path_factory):
    """A reference, a control video of 9 random frames at 32x96 (twice the video's 32x48 aspect) and the same frames'
    middle 32x48 (what a centre crop keeps), and box masks at the video's size: white (255) and grey 150."""
    from PIL import Image

    d = tmp_path_factory.mktemp("vace_sources")
    drawn_person((40, 28)).save(d / "ref.png")
    frames = (np.random.default_rng(7).random((9, 32, 96, 3)) * 255).astype(np.uint8)
    np.savez(d / "wide.npz", frames=frames)
    np.savez(d / "middle.npz", frames=np.ascontiguousarray(frames[:, :, 24:72]))
    for name, grey in (("white", 255), ("grey", 150)):
        m = np.zeros((32, 48), np.uint8)
        m[8:24, 12:36] = grey
        Image.fromarray(m).save(d / f"{name}.png")
    return d


def test_a_control_video_of_another_aspect_is_centre_cropped(vace_sources, tmp_path):
    """--control-video's help: its frames are "centre-cropped to the size and resized": a 32x96 video on a 32x48
    sample is its middle 32x48, so it samples bit for bit as a file of that middle alone (the same resize of the
    same pixels)."""
    d = vace_sources
    run = [*VACE_RUN, "--elements", str(d / "ref.png")]
    wide, _ = infer_run([*run, "--control-video", str(d / "wide.npz")], tmp_path / "wide")
    middle, _ = infer_run([*run, "--control-video", str(d / "middle.npz")], tmp_path / "middle")
    assert torch.equal(wide["latents"], middle["latents"])


def test_a_grey_mask_above_half_is_generated_as_white(vace_sources, tmp_path):
    """Wan's VACE reads --mask as a [0, 1] picture (wan/vace.py prepare_source: the src_mask image / 255) and
    generates where it is above 0.5 (vace_encode_frames / vace_encode_masks: torch.where(m > 0.5, 1, 0)): a box of
    grey 150 (0.59) samples bit for bit as the same box in white. A mask read on another scale puts the threshold
    elsewhere (grey 191 in [-1, 1]) and keeps the grey box."""
    d = vace_sources
    run = [*VACE_RUN, "--elements", str(d / "ref.png"), "--control-video", str(d / "middle.npz")]
    white, _ = infer_run([*run, "--mask", str(d / "white.png")], tmp_path / "white")
    grey, _ = infer_run([*run, "--mask", str(d / "grey.png")], tmp_path / "grey")
    assert torch.equal(white["latents"], grey["latents"])


def test_a_built_in_v3_renders_the_smoke_frames_not_v3s_five_seconds(tmp_path):
    """--num-frames' help: left out, "SkyReels-V3 121, its generate_video.py's 5 s; a built-in tiny model 33": the
    built-in tiny V3 model, sampled with no --num-frames, writes a 33-frame video (its references are latent slots
    after the video's, not frames of it), as every built-in model keeps its smoke-test frames."""
    from config import InferConfig

    said = re.search(r"a built-in tiny model (\d+)", InferConfig.__dataclass_fields__["num_frames"].metadata["help"])
    assert said, "the --num-frames help no longer says a built-in model's frames"
    person = tmp_path / "me.png"
    drawn_person((40, 28)).save(person)
    _, (_, frames, _) = infer_run(["--model", "tiny-v3", "--resolution", "32", "48", "--steps", "1", "--elements",
                                   str(person)], tmp_path / "v3")
    assert frames == int(said[1]) == 33


# ---------------------------------------------------------------- memory terms against the trace


@pytest.fixture(scope="module")
def dry_runs(data_dir, tmp_path_factory):
    """train_a2.py --dry-run on the tiny model (its real step traced on fake tensors, ~4 s each), by extra flags:
    the trace's bytes by phase and category and the rule's for the same plan."""
    from tests.conftest import args, train

    out, made = tmp_path_factory.mktemp("dry"), {}

    def run(*flags):
        if flags not in made:
            r = train(*args(data_dir, out, "dry", "--dry-run", "--max-memory-gb", "2", *flags))
            made[flags] = ({p: peak.by_category() for p, peak in r["tracer"].phases().items()}, r["rule"])
        return made[flags]
    return run


def test_the_ema_copy_is_in_the_rule_as_the_trace_holds_it(dry_runs):
    """--ema-decay keeps an fp32 copy of every trainable weight in the optimizer's state (a2/train/step.py): the traced
    step's "state" at the optimizer step grows by exactly those bytes, and the rule's by the same (both count whole
    fp32 tensors of the same weights; the tiny model's 219k LoRA weights give 0.9 MB, a term no per-phase tolerance
    of the real-size checks would see go)."""
    (traced, rule), (traced_ema, rule_ema) = dry_runs(), dry_runs("--ema-decay", "0.99")
    grown = traced_ema["step"]["state"] - traced["step"]["state"]
    assert grown > 0
    assert rule_ema["step"]["state"] - rule["step"]["state"] == grown


def test_swapped_blocks_on_the_gpu_are_the_two_the_trace_fetches(dry_runs):
    """--swap-blocks 2: the trace holds two swapped blocks' fp8 weights on the device at once (the one in use and
    the next, fetched ahead) in the forward and backward; the rule's "swapped" term is within 5% of that peak (its
    per-block bytes are the mean block's, the trace's each tensor rounded up to the allocator's 512-byte blocks:
    1.6% on the tiny model's small tensors), and one block's worth would be half."""
    traced, rule = dry_runs("--memory", "manual", "--swap-blocks", "2", "--fp8-base")
    peak = max(c["swapped"] for c in traced.values())
    assert peak > 0
    for phase in ("forward", "backward"):
        assert abs(rule[phase]["swapped"] / peak - 1) <= 0.05, (phase, rule[phase]["swapped"], peak)


def test_the_heads_kept_bytes_are_its_tensors(dry_runs):
    """What the rule adds at the forward's end (its "forward end" kept less its "forward" kept: the head, which a
    LoRA step keeps for the backward) is norm_out's input and proj_out's output (16 latent channels x a 1x2x2 patch
    per token) at 4 bytes a value: the element counts here are the tiny model's own tensors in a forward at the dry
    run's 24 tokens, not the rule's formula (the 4-byte width is the rule's fp32 accounting). Exact: whole tensors."""
    from a2.model.tiny import model_path
    from a2.model.transformer import load_transformer

    _, rule = dry_runs()
    model = load_transformer(model_path("tiny"), torch.float32)
    seen = {}
    model.norm_out.register_forward_pre_hook(lambda _m, a: seen.__setitem__("norm_in", a[0].numel()))
    model.proj_out.register_forward_hook(lambda _m, _a, out: seen.__setitem__("proj_out", out.numel()))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the dry run's shape: 32x32, 21 frames -> 6 latent frames of 4x4, 2x2 patches: 24 tokens
        model(hidden_states=torch.randn(1, 36, 6, 4, 4, generator=g), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
              encoder_hidden_states_image=torch.randn(1, 257, 32, generator=g))
    assert seen["proj_out"] == 24 * 64
    assert rule["forward end"]["kept"] - rule["forward"]["kept"] == 4 * (seen["norm_in"] + seen["proj_out"])


# ---------------------------------------------------------------- the data train_a2.main builds


def test_training_reads_a_grey_clip_mask_as_wan_thresholds_it(tmp_path, monkeypatch):
    """A VACE run's clip mask (<clip>_vace_mask.png, white where VACE generates) is read by the dataset
    train_a2.main builds as Wan's VACE reads a mask (the picture / 255, generated where above 0.5: wan/vace.py
    prepare_source, vace_encode_masks): a box of grey 150 (0.59) is all generated, grey 100 (0.39) all kept. The
    dataset is captured from main itself (one step at lr 0), its item read as the loader reads it."""
    from PIL import Image

    import train_a2
    from data import make_synthetic_dataset
    from tests.conftest import args, train

    data = make_synthetic_dataset(tmp_path / "e2v", num_samples=2, num_frames=9, size=(32, 32))
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 4:16], mask[8:24, 16:28] = 150, 100
    for clip in sorted(data.glob("*.mp4")):
        Image.fromarray(mask).save(data / f"{clip.stem}_vace_mask.png")
    built = []

    class Captured(train_a2.E2VDataset):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)

    monkeypatch.setattr(train_a2, "E2VDataset", Captured)
    train(*args(data, tmp_path, "run", "--num-frames", "9", "--max-steps", "1", "--lr", "0", model="tiny-vace"))
    (ds,) = built
    region = ds[0]["region"]  # (F, H, W), 1 where VACE generates
    want = torch.from_numpy(mask / 255 > 0.5).float().expand_as(region)
    assert torch.equal(region, want)


def test_vaces_mask_channels_are_wans_for_a_mask_off_the_8px_grid():
    """VACE's context of a control video and a mask whose edges do not fall on the 8x8 pixel cells (each pixel drawn
    at random): a2's (a2/kinds/vace.py encode) is Wan's (vace_encode_frames + vace_encode_masks, wan/vace.py:139-207,
    written out in tests/their_vace.py wan_context: each 8x8 cell row-major as 64 channels). A box on the cell grid
    makes every cell uniform, so the order of a cell's pixels in the channels shows only off it. Within 1e-5 of
    latents of size ~1: the same VAE encodes of the same pixels; the mask channels exact."""
    from a2.kinds import vace
    from a2.kinds.conditioning import encode_vae
    from a2.model.tiny import model_path
    from a2.pipeline import A2Pipeline
    from tests import their_vace as theirs

    vae = A2Pipeline.from_pretrained(model_path("tiny-vace")).vae
    g = torch.Generator().manual_seed(3)
    frames = torch.rand(1, 3, 9, 32, 48, generator=g) * 2 - 1
    mask = (torch.rand(1, 9, 32, 48, generator=g) > 0.5).float()
    ours, _ = vace.encode(lambda x: encode_vae(vae, x, "argmax"), frames.new_zeros(1, 0, 3, 32, 48), 9, frames,
                          mask)
    want = theirs.wan_context(vae, frames[0], mask, None)
    assert ours[0].shape == want.shape
    assert torch.equal(ours[0, 32:], want[32:])  # the 64 mask channels
    torch.testing.assert_close(ours[0], want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- LoRA files


def test_a_lora_dir_in_diffusers_bin_form_loads_as_its_safetensors(tmp_path):
    """diffusers writes and reads a LoRA dir's weights as pytorch_lora_weights.safetensors or, without safetensors,
    pytorch_lora_weights.bin (diffusers.loaders.lora_base LORA_WEIGHT_NAME / LORA_WEIGHT_NAME_SAFE): infer.py --lora
    takes the .bin dir, and the same weights in either form sample the same latents (the same ops on the same
    values), unlike the model without them."""
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME, LORA_WEIGHT_NAME_SAFE
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    weights = {f"transformer.blocks.{b}.attn1.{p}.lora_{ab}.weight": torch.randn(shape, generator=g) * 0.1
               for b in (0, 1) for p in ("to_q", "to_v") for ab, shape in (("A", (4, 128)), ("B", (128, 4)))}
    (tmp_path / "safe").mkdir()
    (tmp_path / "bin").mkdir()
    save_file(weights, tmp_path / "safe" / LORA_WEIGHT_NAME_SAFE)
    torch.save(weights, tmp_path / "bin" / LORA_WEIGHT_NAME)
    run = ["--model", "tiny-t2v", "--resolution", "32", "48", "--num-frames", "9", "--steps", "2", "--prompt", "a man"]
    safe, _ = infer_run([*run, "--lora", str(tmp_path / "safe")], tmp_path / "safe_run")
    binary, _ = infer_run([*run, "--lora", str(tmp_path / "bin")], tmp_path / "bin_run")
    assert torch.equal(safe["latents"], binary["latents"])
    base, _ = infer_run(run, tmp_path / "base_run")  # the LoRA acts: its weights were loaded, not skipped
    assert (base["latents"] - safe["latents"]).abs().max().item() > 1e-5
