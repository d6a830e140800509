"""The kaleido kind against Kaleido's own code (zai-org/Kaleido @ 4c6c757, written out in tests/their_kaleido.py) on
tiny-kaleido, the tiny T2V model in the release's SAT layout: its converted weights' forward, infer.py's sampling as
their sample_video.py samples, and a2's training loss as their RFLoss."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import their_kaleido as theirs
import torch
from PIL import Image

from a2 import kaleido
from a2.model.tiny import model_path

# float32 rounding of their numerics against diffusers' (the float64 sinusoid, float32 RoPE angles, their own
# LayerNorm / RMSNorm order) on values of size ~1: a few float32 steps, relative
FORWARD_RTOL = 1e-5


@pytest.fixture(scope="module")
def kaleido_dir():
    return model_path("tiny-kaleido")


@pytest.fixture(scope="module")
def sat(kaleido_dir):
    """The release's tensors as their load_checkpoint reads them: the `module` dict of <latest>/mp_rank_00."""
    return torch.load(kaleido_dir / "model" / "1" / "mp_rank_00_model_states.pt", weights_only=True)["module"]


def test_release_layout_is_detected_and_its_fused_tensors_split(kaleido_dir, sat):
    """The tiny release holds SAT's names as their converter writes them (fused q|k|v of 3·dim rows, k|v of 2·dim),
    and a2 reads the dir as Kaleido with those tensors split back into the blocks' own."""
    from a2.model.transformer import detect_model, load_transformer

    assert (kaleido_dir / "model" / "latest").read_text() == "1"
    qkv = sat["model.diffusion_model.transformer.layers.0.attention.query_key_value.weight"]
    kv = sat["model.diffusion_model.transformer.layers.0.cross_attention.key_value.weight"]
    dim = sat["model.diffusion_model.transformer.layers.0.attention.dense.weight"].shape[0]
    assert qkv.shape[0] == 3 * dim and kv.shape[0] == 2 * dim
    info = detect_model(kaleido_dir)
    assert (info.name, info.native_kind) == ("Kaleido", "kaleido")
    m = load_transformer(kaleido_dir)
    a = m.blocks[0].attn1
    assert torch.equal(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]), qkv)
    assert torch.equal(torch.cat([m.blocks[0].attn2.to_k.weight, m.blocks[0].attn2.to_v.weight]), kv)
    assert torch.equal(kaleido.original_to_sat(kaleido.sat_to_original(dict(sat)))[
        "model.diffusion_model.transformer.layers.0.attention.query_key_value.weight"], qkv)


@pytest.mark.parametrize("n", [1, 3])
def test_converted_weights_forward_as_their_model(kaleido_dir, sat, n):
    """a2's transformer loaded from the release, given the kind's model input (the references before the video,
    prepare_model's RoPE), against their DiffusionTransformer.forward on the SAT tensors themselves: the video's
    velocity within FORWARD_RTOL of its size, for 1 and 3 references and two timesteps in one batch."""
    from a2.kinds.conditioning import Conditioning, make_layout, model_input, prepare_model, video_prediction
    from a2.model.transformer import load_transformer

    m = load_transformer(kaleido_dir)
    heads = m.config.num_attention_heads
    g = torch.Generator().manual_seed(n)
    b, t, c, h, w = 2, 3, 16, 4, 6
    x, refs = torch.randn(b, t, c, h, w, generator=g), torch.randn(b, n, c, h, w, generator=g)
    text, timestep = torch.randn(b, 512, m.config.text_dim, generator=g), torch.tensor([700.0, 250.0])
    them = theirs.forward(sat, heads, x, timestep, text, refs)
    layout = make_layout("kaleido", 4 * (t - 1) + 1, (1,) * n)
    cond = Conditioning("kaleido", ref_latents=refs.transpose(1, 2))
    prepare_model(m, layout)
    x_in, ts = model_input(x.transpose(1, 2), cond, timestep)
    with torch.no_grad():
        ours = video_prediction(m(hidden_states=x_in, timestep=ts, encoder_hidden_states=text,
                                  return_dict=False)[0], cond).transpose(1, 2)
    assert ours.shape == them.shape
    assert (ours - them).abs().max() <= FORWARD_RTOL * them.abs().max()


def reference_images(tmp_path, sizes):
    images = []
    for i, (w, h) in enumerate(sizes):
        rng = np.random.RandomState(20 + i)
        images.append(Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)))
        images[-1].save(tmp_path / f"ref{i}.png")
    return images


def test_infer_samples_as_their_sample_video(kaleido_dir, tmp_path, monkeypatch):
    """infer.py on the tiny release (by path, with only what their prompt file and yaml say: prompt, references,
    size, frames; no sampling flag) against their sample_video.py sampler at its configs' defaults (50 Euler steps on
    the float64 shifted linspace, guidance 6 with the references in both branches, their negative prompt, seed 1234,
    the CPU noise drawn frames first): the reference latents and the initial noise equal, the final latents within
    1e-5 of theirs (float32: the forward's rounding, FORWARD_RTOL, over 50 steps). Both get the same text states
    (a2's encode_prompt on the tiny UMT5)."""
    import infer
    from a2.pipeline import A2Pipeline, encode_prompt

    images = reference_images(tmp_path, [(301, 97), (97, 301), (96, 64)])
    prompt, height, width, frames = "a hiker on a mountain", 32, 48, 9
    seen, call = [], A2Pipeline.__call__

    def recorded(self, *a, **kw):  # the first forward's input, through infer.py's own pipeline
        handle = self.transformer.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs["hidden_states"]), with_kwargs=True)
        try:
            return call(self, *a, **kw)
        finally:
            handle.remove()

    monkeypatch.setattr(A2Pipeline, "__call__", recorded)
    cfg = infer.InferConfig.from_flags(model=str(kaleido_dir),
                                       elements=tuple(str(tmp_path / f"ref{i}.png") for i in range(3)),
                                       prompt=prompt, height=height, width=width, num_frames=frames, device="cpu",
                                       decode="none", save_latents=str(tmp_path / "a2.pt"))
    assert infer.main(cfg) == 0
    ours = torch.load(tmp_path / "a2.pt")
    pipe = A2Pipeline.from_pretrained(kaleido_dir)
    text, null = (encode_prompt(pipe.tokenizer, pipe.text_encoder, [p]) for p in (prompt, theirs.NEGATIVE))
    sat = torch.load(kaleido_dir / "model" / "1" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    them = theirs.sample(sat, pipe.transformer.config.num_attention_heads, pipe.vae, images, text, null,
                         (frames - 1) // 4 + 1, height, width)
    assert len(seen) == 2 * theirs.STEPS  # two passes a step (text CFG), 50 steps
    assert seen[0].shape[2] == 3 + them["initial"].shape[2]  # the three references first
    assert torch.equal(seen[0][:, :, 3:], them["initial"])  # the noise: their draw, frames first
    # their pixels (x - 127.5) / 127.5 against a2's x * 2 / 255 - 1: the last bit, through the VAE encoder a few
    # float32 steps of the latents' size
    eps = torch.finfo(torch.float32).eps
    assert (seen[0][:, :, :3] - them["condition"]).abs().max() <= 16 * eps * them["condition"].abs().max()
    assert (ours["latents"] - them["latents"]).abs().max() <= 1e-5  # measured 1.9e-6 on latents of size 4.2


def test_negative_prompt_and_schedule_are_theirs():
    """The kind's sampling as their yaml and RFSampler say: the negative prompt is their yaml's (Wan's without
    "poorly drawn faces"), and the sigmas a2's Euler scheduler steps through (schedule kaleido, shift 7) are their
    make_hunyuan_timesteps' within float32 rounding, from 1 to exactly 0."""
    from a2.kinds.kinds import kind_sampling, schedule_sigmas
    from a2.pipeline import make_scheduler

    own = kind_sampling("kaleido")
    assert own.negative_prompt == theirs.NEGATIVE
    assert (own.steps, own.guidance_scale, own.seed, own.fps) == (theirs.STEPS, theirs.GUIDANCE, theirs.SEED, 16)
    sched = make_scheduler(own.scheduler, own.flow_shift)
    sched.set_timesteps(sigmas=schedule_sigmas(own.schedule, own.steps))
    ref = theirs.sigmas()
    assert sched.sigmas[0] == 1 and sched.sigmas[-1] == 0
    assert torch.allclose(sched.sigmas, ref, rtol=0, atol=2 ** -23)


def test_training_shift_is_their_schedule_shift():
    """config.rf_shift(h, w), which a kaleido run's recipe fills as --sigma-shift at its size, is RFLoss's exp(mu) as
    their time_shift applies it: the shift map at that shift equals their time_shift on the same sigmas (480x832: L =
    1560 tokens a frame; 64x64: 16)."""
    from config import rf_shift

    s = torch.tensor([0.1, 0.5, 0.93])
    for height, width in ((480, 832), (64, 64)):
        shift = rf_shift(height, width)
        ours = shift * s / (1 + (shift - 1) * s)
        assert torch.allclose(ours, theirs.shifted_sigma(s, height // 8, width // 8), rtol=1e-6, atol=0)


def test_tiny_release_config_is_the_tiny_t2v(kaleido_dir):
    wan = json.loads((kaleido_dir / "model" / "config.json").read_text())
    assert wan["_class_name"] == "WanModel" and wan["in_dim"] == 16


def test_training_loss_is_their_rfloss(kaleido_dir, sat):
    """a2's training loss (a2/train/step.py forward_loss) on tiny-kaleido with the objective its recipe fills
    (config.py: logit_normal_shifted at the 64x64 shift) against their RFLoss on the same clip, references, text and
    noise: each sample's sigma drawn by a2's sample_sigma from its generator and by their RFSampling (LogisticNormal)
    from the same seed, then shifted by each, and the loss within 1e-5 relative (float32: the forward's rounding)."""
    from contextlib import nullcontext

    from a2.kinds.conditioning import Conditioning, make_layout
    from a2.model.transformer import load_transformer
    from a2.train.flow import sample_sigma
    from a2.train.step import forward_loss
    from config import ReferencesConfig, from_flags

    objective = from_flags(model="tiny-kaleido").objective
    assert objective.sigma_sampling == "logit_normal_shifted"
    m = load_transformer(kaleido_dir)
    b, t, c, h, w, n = 3, 3, 16, 8, 8, 2  # 64x64 px: the tiny recipe's size
    g = torch.Generator().manual_seed(7)
    x0, refs = torch.randn(b, t, c, h, w, generator=g), torch.randn(b, n, c, h, w, generator=g)
    text, noise = torch.randn(b, 512, m.config.text_dim, generator=g), torch.randn(b, t, c, h, w, generator=g)
    seeds = [11, 12, 13]
    ours_sigma = torch.tensor([sample_sigma(objective, torch.Generator().manual_seed(s)) for s in seeds])
    raw = []
    for s in seeds:  # RFSampling: LogisticNormal(0, 1) on the global generator
        torch.manual_seed(s)
        raw.append(torch.distributions.LogisticNormal(torch.tensor([0.0]), torch.tensor([1.0])).sample((1,))[:, 0])
    raw = torch.cat(raw)
    assert torch.allclose(ours_sigma, theirs.shifted_sigma(raw, h, w), rtol=1e-5, atol=0)
    inputs = dict(x0=x0.transpose(1, 2), noise=noise.transpose(1, 2), sigmas=ours_sigma,
                  cond=Conditioning("kaleido", ref_latents=refs.transpose(1, 2)), text=text,
                  layout=make_layout("kaleido", 4 * (t - 1) + 1, (1,) * n), reference_images=None)
    with torch.no_grad():
        ours, _ = forward_loss(m, inputs, objective, ReferencesConfig(), None, nullcontext(), torch.float32)
        them = theirs.rf_loss(sat, m.config.num_attention_heads, x0, refs, text, raw, noise)
    assert abs(ours.item() - them.item()) <= 1e-5 * them.item()


def test_recipe_fills_their_shift_at_the_runs_size():
    """A kaleido run (the tiny's name, or a dir holding a Kaleido release) takes the shifted logit-normal, at the shift
    of its own size (RFLoss's shift follows the size), the training yaml's rate and size on the release; a
    --sigma-shift given stays."""
    from config import from_flags, rf_shift

    cfg = from_flags(model="tiny-kaleido")
    assert cfg.objective.sigma_shift == rf_shift(*cfg.data.resolution) and cfg.data.resolution == (64, 64)
    assert from_flags(model="tiny-kaleido", resolution=(32, 48)).objective.sigma_shift == rf_shift(32, 48)
    assert from_flags(model="tiny-kaleido", sigma_shift=3.0).objective.sigma_shift == 3.0
    release = from_flags(model=str(model_path("tiny-kaleido")))
    assert (release.optim.lr, release.data.resolution, release.objective.sigma_sampling) == (
        5e-6, (480, 832), "logit_normal_shifted")
    assert abs(release.objective.sigma_shift - 2.0559) < 1e-4


def kaleido_layout(data_dir, root):
    """The synthetic dataset's clips in Kaleido's training layout (data_video.py SFTDataset): videos/<id>.mp4,
    labels/<id>.txt, references/<id>/ref1.png.. (the person, object and background images, in that order); clip 001
    has two references only."""
    import shutil

    for sub in ("videos", "labels"):
        (root / sub).mkdir(parents=True)
    for video in sorted(data_dir.glob("*.mp4")):
        i = video.stem
        shutil.copy(video, root / "videos" / f"{i}.mp4")
        shutil.copy(data_dir / f"{i}.txt", root / "labels" / f"{i}.txt")
        (root / "references" / i).mkdir(parents=True)
        for n, suffix in enumerate(("_person.png", "_object.png", "_background.png")[: 2 if i == "001" else 3], 1):
            shutil.copy(data_dir / f"{i}{suffix}", root / "references" / i / f"ref{n}.png")
    return root


# their training yaml's optimizer (zai-org/Kaleido configs/training/video_wanx_14B_concat.yaml): deepspeed's AdamW
# betas [0.9, 0.95], eps 1e-8, weight_decay 1e-4 (:89-91), gradient_clipping 0.1 (:65)
THEIR_ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=1e-4)
THEIR_GRAD_CLIP = 0.1


def index_their_layout(data_dir, tmp_path) -> Path:
    """kaleido_layout through `data.py index kaleido ROOT OUT` (its CLI, as a user runs it): OUT/index.jsonl."""
    import data

    root = kaleido_layout(data_dir, tmp_path / "kaleido-data")
    data._cli(["index", "kaleido", str(root), str(tmp_path / "index")])
    return tmp_path / "index" / "index.jsonl"


def spy_optimizer(monkeypatch) -> dict:
    """What train_a2.main builds: the optimizer of its make_optimizer and the max_norm of each clip_grad_norm_."""
    import train_a2
    from a2.train import step

    built = {"clip": []}

    def make_optimizer(*a, **kw):
        built["opt"], guard = step.make_optimizer(*a, **kw)
        return built["opt"], guard

    def clip(params, max_norm, *a, **kw):
        built["clip"].append(max_norm)
        return clip_grad_norm(params, max_norm, *a, **kw)

    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(train_a2, "make_optimizer", make_optimizer)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    return built


@pytest.mark.parametrize("training", ["lora", "full"])
def test_trains_on_their_data_layout(kaleido_dir, data_dir, tmp_path, training, monkeypatch):
    """Kaleido's data layout through `data.py index kaleido` (the caption: labels' first line; the references:
    ref1.. in order, as ref0..), then train_a2.py on the tiny release in its kind: the run is the kaleido kind with
    the clips' references before the video (3, and 2 for the clip that has two), its recipe's shifted logit-normal
    and their yaml's AdamW and gradient clipping, and the loss falls over the steps on one clip (the same draws every
    step, --overfit-batches 1)."""
    from tests.conftest import args, train

    manifest = index_their_layout(data_dir, tmp_path)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert [r["id"] for r in rows] == sorted(p.stem for p in data_dir.glob("*.mp4"))
    assert rows[0]["caption"] == (data_dir / f"{rows[0]['id']}.txt").read_text().splitlines()[0]
    assert [k for k in rows[1] if k.startswith("ref")] == ["ref0", "ref1"]
    flags = args(data_dir, tmp_path, training, "--manifest", str(manifest), "--num-frames", "9", "--max-steps", "6",
                 "--warmup-steps", "0", "--lr", "1e-3" if training == "lora" else "1e-4", "--overfit-batches", "1",
                 "--val-every", "0", *(["--training-type", "full"] if training == "full" else []),
                 model=str(kaleido_dir))
    built = spy_optimizer(monkeypatch)
    r = train(*flags)
    run = json.loads((r["run_dir"] / "run.json").read_text())
    assert run["layout"]["kind"] == "kaleido" and run["layout"]["ref_latents"] in (2, 3)
    config = json.loads((r["run_dir"] / "config.json").read_text())
    assert config["sigma_sampling"] == "logit_normal_shifted"
    losses = [json.loads(line)["loss"] for line in (r["run_dir"] / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 6 and losses[-1] < losses[0]
    group = built["opt"].param_groups[0]
    assert {k: group[k] for k in THEIR_ADAMW} == THEIR_ADAMW and built["clip"] == [THEIR_GRAD_CLIP] * 6
    if training == "full":  # the trained DiT also as Kaleido's SAT load dir, which a2 (and their --load) reads back
        from a2.model.transformer import detect_model, load_transformer

        original = r["run_dir"] / "transformer_original"
        assert (original / "latest").read_text() == "1"
        assert detect_model(original, components=kaleido_dir).native_kind == "kaleido"
        trained, back = load_transformer(r["weights"]).state_dict(), load_transformer(original).state_dict()
        assert trained.keys() == back.keys() and all(torch.equal(trained[k], back[k]) for k in trained)


class Built(Exception):
    """Stops train_a2.main once its optimizer is built: what follows is the training the test above runs."""


def test_a_typed_optimizer_flag_wins_over_the_recipe(kaleido_dir, data_dir, tmp_path, monkeypatch):
    """--adam-betas, --weight-decay and --max-grad-norm typed on a kaleido run are the optimizer main builds (the
    recipe fills only what is left out); every other kind left out keeps what a2 had before the recipe held them:
    torch's AdamW betas, no weight decay, clipping at 1 (main 2b54b6f: a2/train/step.py:202, a2/config/sections.py
    OptimConfig)."""
    import inspect

    import train_a2
    from a2.train import step
    from config import from_flags
    from tests.conftest import args, train_config

    def make_optimizer(optim, *a, **kw):
        built["opt"] = step.make_optimizer(optim, *a, **kw)[0]
        built["clip"] = optim.max_grad_norm  # the value optimizer_step clips at, read from the same section
        raise Built

    built = {}
    monkeypatch.setattr(train_a2, "make_optimizer", make_optimizer)
    manifest = index_their_layout(data_dir, tmp_path)
    flags = args(data_dir, tmp_path, "typed", "--manifest", str(manifest), "--num-frames", "9", "--adam-betas", "0.8",
                 "0.99", "--weight-decay", "0.01", "--max-grad-norm", "2", model=str(kaleido_dir))
    with pytest.raises(Built):
        train_a2.main(train_config(flags))
    group = built["opt"].param_groups[0]
    assert (group["betas"], group["weight_decay"], built["clip"]) == ((0.8, 0.99), 0.01, 2.0)
    torch_betas = inspect.signature(torch.optim.AdamW).parameters["betas"].default
    for model in ("tiny", "tiny-t2v", "Skywork/SkyReels-A2"):
        o = from_flags(model=model).optim
        assert (o.adam_betas, o.weight_decay, o.max_grad_norm) == (torch_betas, 0.0, 1.0), model


def test_index_says_what_it_cannot_read(data_dir, tmp_path):
    """Their layout gone wrong, one report line each naming the clip and the file: a video without a label and one
    with an empty label (dropped: a2 trains no empty caption), a video without any reference (dropped), ref2.png
    missing before ref3.png (kept, the references present in order), a label and a references dir of no video."""
    import shutil

    root = kaleido_layout(data_dir, tmp_path / "kaleido-data")
    ids = sorted(p.stem for p in (root / "videos").glob("*.mp4"))
    video = root / "videos" / f"{ids[0]}.mp4"
    for i in ("900", "901", "902"):
        shutil.copy(video, root / "videos" / f"{i}.mp4")
    shutil.copytree(root / "references" / ids[0], root / "references" / "900")  # 900: no label
    shutil.copytree(root / "references" / ids[0], root / "references" / "901")
    (root / "labels" / "901.txt").write_text("\n")  # 901: an empty first line
    (root / "labels" / "902.txt").write_text("a clip without references\n")  # 902: no references/902
    (root / "labels" / "903.txt").write_text("a label of no video\n")
    shutil.copytree(root / "references" / ids[0], root / "references" / "904")  # a references dir of no video
    gap = root / "references" / ids[2] / "ref2.png"
    gap.unlink()
    from a2.config.sections import IndexKaleido
    from a2.data.public_index import index_kaleido

    counts = index_kaleido(IndexKaleido(str(root), str(tmp_path / "index")))
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "index" / "index.jsonl").read_text().splitlines())}
    assert sorted(rows) == ids and counts["clips read"] == len(ids) + 3 and counts["clips kept"] == len(ids)
    refs = root / "references" / ids[2]
    assert (rows[ids[2]]["ref0"], rows[ids[2]]["ref1"]) == (str(refs / "ref1.png"), str(refs / "ref3.png"))
    assert "ref2" not in rows[ids[2]]
    report = (tmp_path / "index" / "report.txt").read_text().splitlines()
    problems = report[report.index("problems (one line each: clip key: file: problem):") + 1:]
    want = {"900": root / "labels" / "900.txt", "901": root / "labels" / "901.txt",
            "902": root / "references" / "902" / "ref1.png", ids[2]: gap,
            "903": root / "labels" / "903.txt", "904": root / "references" / "904"}
    assert len(problems) == len(want), problems
    for key, file in want.items():
        assert sum(line.startswith(f"{key}: {file}: ") for line in problems) == 1, (key, problems)


def test_fsdp_and_context_parallel_train_as_one_process(kaleido_dir, data_dir, tmp_path):
    """Full fine-tuning of tiny-kaleido on 2 gloo ranks, sharded (--fsdp) and with its sequence split
    (--context-parallel 2, one sample over both ranks), against one process with the same global batch: the same
    losses (float32: the summation order of the reduced gradients and of the split attention, 1e-5)."""
    from tests.conftest import args, launch

    common = ["--training-type", "full", "--num-frames", "9", "--max-steps", "2", "--warmup-steps", "0",
              "--lr", "1e-4", "--val-every", "0"]
    procs = {name: launch(args(data_dir, tmp_path, name, *common, *extra, model=str(kaleido_dir)), nproc=n)
             for name, n, extra in (("one", 1, ["--grad-accum", "2"]), ("fsdp", 2, ["--fsdp"]),
                                    ("cp", 2, ["--context-parallel", "2", "--grad-accum", "2"]))}
    losses = {}
    for name, p in procs.items():
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, log[-4000:]
        rows = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
        losses[name] = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses["one"]) == [1, 2]
    for name in ("fsdp", "cp"):
        assert losses[name].keys() == losses["one"].keys()
        assert max(abs(losses[name][s] - losses["one"][s]) for s in losses["one"]) <= 1e-5, (name, losses)


def test_memory_plans_train_alike(kaleido_dir, data_dir, tmp_path):
    """LoRA on tiny-kaleido with every block recomputed (the CPU default), with their self-attention kept
    (--save-attention) and with none recomputed: the same losses (the recompute replays the forward Kaleido's RoPE
    module gave, whose per-call reference count prepare_model sets before it)."""
    from tests.conftest import args, train

    losses = {}
    for name, extra in (("all", ()), ("sac", ("--save-attention",)), ("none", ("--no-gradient-checkpointing",))):
        r = train(*args(data_dir, tmp_path, name, "--num-frames", "9", "--max-steps", "3", "--val-every", "0",
                        *extra, model=str(kaleido_dir)))
        losses[name] = r["losses"]
    assert len(losses["all"]) == 3 and losses["sac"] == losses["all"]
    assert max(abs(a - b) for a, b in zip(losses["none"], losses["all"])) <= 1e-6, losses
