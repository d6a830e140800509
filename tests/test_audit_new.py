"""Promises of the code that landed with the one planner, Kaleido and left_as_found that a planted-mutation audit
(/work/audit2) found unheld: each value is the user's flag, the lab's file or an independent count, not a2's table."""

from pathlib import Path

import pytest
import torch

from a2.cli import ConfigError
from a2.config.dataset_config import VaeProcessorConfig, check_sides
from a2.config.sections import ObjectiveConfig, OptimConfig, ReferencesConfig, ValidationConfig
from a2.model.transformer import preset_config
from a2.plan import check_extra_options, check_reference_options, plan_layout, preset_info, validation_layout
from tests.conftest import args, train_config


def ti2v_info():
    return preset_info("tiny-ti2v", preset_config("tiny-ti2v"))


@pytest.mark.parametrize("prefix, frames", [(9, 9), (13, 9)])
def test_ti2v_prefix_frames_leave_frames_to_generate(prefix, frames):
    """--prefix-frames N on TI2V-5B: N clean frames given, so a clip of N (or fewer) frames has nothing left to
    sample; the flag's help says "fewer than the clip's frames"."""
    vae = VaeProcessorConfig(frame_conditioning="prefix", prefix_frames=prefix)
    with pytest.raises(ConfigError, match="--prefix-frames"):
        plan_layout(ti2v_info(), (), vae, frames)
    assert plan_layout(ti2v_info(), (), VaeProcessorConfig(frame_conditioning="prefix", prefix_frames=5), 9)


def test_validation_of_a_prefix_run_samples_from_its_one_image():
    """A TI2V run trained with --prefix-frames 5 (two clean latent frames) validates from the one --val-elements image
    (validation_inputs takes exactly one): one clean latent frame, not the run's two."""
    layout = plan_layout(ti2v_info(), (), VaeProcessorConfig(frame_conditioning="prefix", prefix_frames=5), 9)
    assert layout.clean_frames == 5 and validation_layout(layout).clean_frames == 1


@pytest.mark.parametrize("text, ref, joint", [(0.5, 0.2, 0.4), (0.2, 0.5, 0.4), (0.2, 0.4, 0.5)])
def test_dropouts_over_one_are_refused_whichever_is_large(text, ref, joint):
    """--text-dropout, --reference-dropout, --joint-dropout are exclusive cases of one draw: each member can push
    the sum (here 1.1) over 1."""
    r = ReferencesConfig(text_dropout=text, reference_dropout=ref, joint_dropout=joint)
    with pytest.raises(ConfigError, match="summing to at most 1"):
        check_reference_options(r, None, None, None, None)


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5])
def test_ema_decay_outside_zero_one_is_refused(decay):
    """--ema-decay 1 would keep the EMA at the initial weights forever; the flag's help: a decay in [0, 1)."""
    with pytest.raises(ConfigError, match="--ema-decay"):
        check_extra_options(OptimConfig(ema_decay=decay), ValidationConfig(), ObjectiveConfig())
    check_extra_options(OptimConfig(ema_decay=0.999), ValidationConfig(), ObjectiveConfig())


def test_text_to_video_run_with_val_every_renders_validation(data_dir, tmp_path):
    """A T2V run given --val-every renders a validation video from the prompt alone (the flag's help); the Run
    train_a2.main plans from the user's flags says it validates."""
    import train_a2

    cfg = train_config(args(data_dir, tmp_path, "t", "--dataset-type", "t2v", "--num-frames", "17",
                            "--val-every", "2", model="tiny-t2v"))
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu"))
    assert run.layout.images == "none" and run.validates
    cfg = train_config(args(data_dir, tmp_path, "t", "--dataset-type", "t2v", "--num-frames", "17", model="tiny-t2v"))
    assert not train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), torch.device("cpu")).validates


@pytest.mark.parametrize("kind", ["incontext", "kaleido"])
def test_bench_refs_below_a_kinds_minimum_take_one_reference(kind):
    """bench.py --refs 0 with a kind whose every sample holds a reference (in-context, Kaleido: 1 to 3 subjects)
    benches one reference, not none."""
    from a2.plan import bench_plan
    from config import BenchConfig

    run, _, _ = bench_plan(BenchConfig(preset="tiny", frames=9, height=32, width=32, refs=0, layout=kind))
    assert len(run.elements) == 1


@pytest.mark.parametrize("sides", [(0, 64), (64, 0), (-16, 64), (64, -16), (48, 40), (40, 48)])
def test_sides_not_positive_multiples_are_refused(sides):
    """Both sides, each rule (positive, a multiple of 16), non-square: one ConfigError naming the flag."""
    with pytest.raises(ConfigError, match="--resolution"):
        check_sides("--resolution", sides)
    check_sides("--resolution", (48, 64))


def test_kaleido_release_recipe_is_their_training_yaml():
    """zai-org/Kaleido configs/training/video_wanx_14B_concat.yaml: lr 5e-6 and sat's warmup 0.01 of its 5000
    iterations (= 50 steps)."""
    from a2.model.tiny import model_path
    from config import from_flags

    release = from_flags(model=str(model_path("tiny-kaleido")))
    assert release.optim.lr == 5e-6 and release.optim.warmup_steps == round(0.01 * 5000)


def kaleido_index(root, out):
    """data.py index kaleido ROOT OUT's manifest rows."""
    import json

    from a2.config.sections import IndexKaleido
    from a2.data.public_index import index_kaleido

    index_kaleido(IndexKaleido(str(root), str(out)))
    return [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]


def kaleido_clip(root, label="a man walks a dog\n", refs=(1, 2, 3)):
    (root / "videos").mkdir(parents=True)
    (root / "videos" / "a.mp4").write_bytes(b"")
    (root / "labels").mkdir()
    (root / "labels" / "a.txt").write_text(label)
    (root / "references" / "a").mkdir(parents=True)
    for i in refs:
        (root / "references" / "a" / f"ref{i}.png").write_bytes(b"")


def test_kaleido_rows_read_all_three_references(tmp_path):
    """data_video.py SFTDataset reads references/<id>/ref1.png, ref2.png, ref3.png: three references, in order."""
    kaleido_clip(tmp_path / "root")
    (row,) = kaleido_index(tmp_path / "root", tmp_path / "index")
    assert [Path(row[f"ref{i}"]).name for i in range(3)] == ["ref1.png", "ref2.png", "ref3.png"]


def test_standin_lora_is_refused_on_a_36_channel_model_without_image_branch(tmp_path):
    """Stand-In is a LoRA on Wan T2V (16 input channels); Wan 2.2 I2V A14B takes 36 channels with no CLIP image
    branch and must be refused too, not only the models with one."""
    from diffusers import WanTransformer3DModel

    from a2.kinds import standin

    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=36,
                              out_channels=16, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, image_dim=None)
    rank, dim = 4, 16
    sd = {f"blocks.0.self_attn.{p}_loras.{part}.weight": torch.zeros((rank, dim) if part == "down" else (dim, rank))
          for p in "qkv" for part in ("down", "up")}
    torch.save({"state_dict": sd}, tmp_path / "standin.ckpt")
    with pytest.raises(ValueError, match="36 input channels"):
        standin.load_lora(m, tmp_path / "standin.ckpt")


def test_left_as_found_keeps_a_process_group_its_caller_made(tmp_path):
    """A caller (a notebook, torchrun's script) that made its process group before main keeps it after main."""
    import torch.distributed as dist

    from a2.cli import left_as_found

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with left_as_found():
            pass
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_kaleido_caption_is_the_label_files_first_line(tmp_path):
    """data_video.py SFTDataset takes labels/<id>.txt's first line as the caption, not the whole file."""
    kaleido_clip(tmp_path / "root", label="a man walks a dog\nshot on a phone\n")
    assert kaleido_index(tmp_path / "root", tmp_path / "index")[0]["caption"] == "a man walks a dog"


def test_face_embedder_feeds_the_exported_model_rgb_in_zero_one():
    """An exported face model takes (B, 3, H, W) RGB in [0, 1]: a white uint8 image (255) reaches it as 1.0, a
    black one as 0, channels in the image's order."""
    import numpy as np

    from a2.eval.opens2v import Embedder

    seen = []

    def model(x):
        seen.append(x)
        return torch.ones(len(x), 4)

    images = np.zeros((2, 8, 6, 3), np.uint8)
    images[0] = 255
    images[1, ..., 2] = 51
    Embedder(model)(images)
    (x,) = seen
    assert x.shape == (2, 3, 8, 6)
    assert x[0].min() == 1.0 and x[1, :2].max() == 0.0 and torch.allclose(x[1, 2], torch.full((8, 6), 0.2))


def test_infer_under_torchrun_refuses_a_list_of_videos(tmp_path):
    """infer.py under torchrun samples one video split over the ranks; a list of rows (--prompts-file, --eval-set:
    load_pipeline's repeats None) is refused before any weights load."""
    import torch.distributed as dist

    import infer
    from a2.config.dataset_config import ConditioningConfig
    from a2.plan import sampling_plan

    cfg, source, info, _ = infer.check_inputs(infer.InferConfig.from_flags(
        model="tiny", height=32, width=32, num_frames=9, steps=2, device="cpu"))
    row = {"layout": sampling_plan(info, (1,), ConditioningConfig(), 9), "elements": []}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="under torchrun"):
            infer.load_pipeline(cfg, info, source, [row, row], repeats=None)
    finally:
        dist.destroy_process_group()


def cache_run(use_clip):
    """The fields of a Run with_cache reads (a dataclass, as Run is, so that a cache taken gives a run back)."""
    from dataclasses import make_dataclass
    from types import SimpleNamespace

    layout = SimpleNamespace(use_clip=use_clip, clip_frames=9, e2v_type="dual", prefix_frames=0, kind="prefix")
    run = make_dataclass("CacheRun", ["info", "layout", "compute_dtype", ("cache", object, None)], frozen=True)
    return run(SimpleNamespace(image_encoder_dir=Path("enc"), parts_dir=Path("model")), layout, torch.float32)


def test_a_precompute_cache_without_done_is_not_used(tmp_path, monkeypatch):
    """A cache dir a --precompute left unfinished (no `done` file) is no cache: the run asks for --precompute; the
    key hashes the --image-encoder dir's files when the kind takes CLIP tokens, and not otherwise."""
    from a2 import plan
    from a2.config.dataset_config import DataConfig

    seen = []
    monkeypatch.setattr(plan, "cache_key", lambda model_dir, image_src, *a, **k: seen.append(image_src) or "key")
    (tmp_path / "key").mkdir()  # written up to its last sample, never finished
    data = DataConfig(data_root="unused", cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--precompute"):
        plan.with_cache(data, ReferencesConfig(), cache_run(True), None)
    with pytest.raises(FileNotFoundError, match="--precompute"):
        plan.with_cache(data, ReferencesConfig(), cache_run(False), None)
    assert seen == [Path("enc"), None]


@pytest.mark.parametrize("timestep", ["zero"])
def test_a_released_model_refuses_another_reference_timestep(timestep):
    """A released model (Kaleido, Phantom, ...) gives its references the sample's timestep: --reference-timestep
    zero asks for another layout and is refused, naming the flag."""
    from types import SimpleNamespace

    from a2.elements import Element
    from a2.plan import check_native_flags

    info = SimpleNamespace(native_kind="kaleido", path="kaleido-dir", name="Kaleido")
    with pytest.raises(ConfigError, match=f"--reference-timestep {timestep}"):
        check_native_flags(info, VaeProcessorConfig(reference_timestep=timestep), (Element("ref0", ("_r.png",)),),
                           "auto")


def test_ti2v_image_is_one_clean_first_frame():
    """infer.py --image on TI2V-5B: the image is the video's first frame (frame conditioning first: one clean latent
    frame), not a prefix of several."""
    from a2.config.dataset_config import ConditioningConfig
    from a2.plan import sampling_plan

    layout = sampling_plan(ti2v_info(), (), ConditioningConfig(), 9, first_frame=True)
    assert (layout.frame_conditioning, layout.clean_frames) == ("first", 1)


@pytest.mark.parametrize("flag, device, on", [(None, "cuda", True), (None, "cpu", False), (False, "cuda", False),
                                              (True, "cpu", True)])
def test_compile_flag_wins_over_the_device(flag, device, on):
    """--compile / --no-compile as the user gives it; left out, on with CUDA only."""
    from a2.config.sections import resolve_compile

    assert resolve_compile(flag, device) is on


def standin_state(rank=4, dim=16, layers=1):
    return {f"blocks.{i}.self_attn.{p}_loras.{part}.weight":
            torch.randn((rank, dim) if part == "down" else (dim, rank)) for i in range(layers) for p in "qkv"
            for part in ("down", "up")}


def test_a_legacy_torch_pickle_is_read(tmp_path):
    """A torch file saved in the legacy (non-zip) format, as older releases are, cannot be memory-mapped and is read
    whole: the same tensors under "state_dict"."""
    from a2.model.transformer import weights_in

    sd = standin_state()
    torch.save({"state_dict": sd}, tmp_path / "old.ckpt", _use_new_zipfile_serialization=False)
    got = weights_in(tmp_path / "old.ckpt")
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


def test_a_standin_lora_as_safetensors_installs_its_reference_lora(tmp_path):
    """infer.py --lora with Stand-In's keys in a .safetensors file (is_lora_file takes both) installs Stand-In's
    reference LoRA, as its .ckpt does, not an ordinary LoRA."""
    from types import SimpleNamespace

    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from a2.kinds import standin
    from a2.train import lora

    model = WanTransformer3DModel(**preset_config("tiny", e2v=False)).eval()
    width = model.config.num_attention_heads * model.config.attention_head_dim
    save_file(standin_state(dim=width, layers=len(model.blocks)), tmp_path / "standin.safetensors")
    said = lora.load_lora(SimpleNamespace(transformer=model), str(tmp_path / "standin.safetensors"))
    assert said.startswith("Stand-In LoRA") and standin.installed(model)
