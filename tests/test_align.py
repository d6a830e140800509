"""RefAlign's reference-alignment loss (a2/kinds/align.py), reference augmentation (a2/kinds/align.py too) and the joint
dropout: the loss against a hand computation, the DINOv3 targets on the DiT's grid (a tiny random DINOv3ViTModel), where
each kind's reference tokens are, and in training: weight 0 trains bit for bit as without it, the loss reaches only the
chosen blocks and the projectors, DDP == one process, resume == uninterrupted, the cache == the pixels, the export has
no projector."""

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import train_a2
from a2.cli import ConfigError
from a2.kinds import align
from tests.conftest import args, assert_rounding, launch, losses, max_diff, params, train, train_config

FIT = ("subject=_person.png:vae=fit_pad_white", "object=_object.png:vae=fit_pad_white",
       "background=_background.png:vae=fit_pad_white")


@pytest.fixture(scope="module")
def phantom_dir():
    from a2.model.tiny import model_path

    return model_path("tiny-phantom")


def phantom(data_dir, out, run, *extra):
    """A tiny Phantom-Wan run's flags (its layout: references after the video)."""
    return args(data_dir, out, run, "--num-frames", "9", "--elements", *FIT, *extra, model="tiny-phantom")


def align_flags(dino_dir, *blocks):
    return ["--align-loss", "--align-model", str(dino_dir), "--align-blocks", *(blocks or ("0", "1"))]


# ---------------------------------------------------------------- the loss, the targets, the token positions


def test_loss_equals_a_hand_computation():
    """pos = mean relu(1 - cos) at the same position, neg = mean relu(cos) over pairs of different references
    (student of one, target of the other), per block, averaged over blocks, gated by sigma^3 (RefAlign's), 0 for a
    sample whose references were dropped; computed here with Python floats, token by token."""
    g = torch.Generator().manual_seed(0)
    b, n, tokens, d = 2, 3, 4, 5
    feats = {0: torch.randn(b, n, tokens, d, generator=g), 3: torch.randn(b, n, tokens, d, generator=g)}
    targets = torch.randn(b, n, tokens, d, generator=g)
    sigmas, kept = torch.tensor([0.8, 0.3]), torch.tensor([1.0, 1.0])

    def cos(u, v):
        u, v = u.tolist(), v.tolist()
        dot = sum(x * y for x, y in zip(u, v))
        return dot / max(math.sqrt(sum(x * x for x in u)), 1e-12) / max(math.sqrt(sum(y * y for y in v)), 1e-12)

    def hand(f, t):
        pos = sum(max(0.0, 1 - cos(f[a, i], t[a, i])) for a in range(n) for i in range(tokens)) / (n * tokens)
        pairs = [(a, c, i, j) for a in range(n) for c in range(n) if a != c for i in range(tokens)
                 for j in range(tokens)]
        neg = sum(max(0.0, cos(f[a, i], t[c, j])) for a, c, i, j in pairs) / len(pairs)
        return pos + neg

    want = sum(float(sigmas[s]) ** 3 * sum(hand(feats[k][s], targets[s]) for k in feats) / len(feats)
               for s in range(b)) / b
    got = align.align_loss(feats, targets, sigmas, kept)
    assert abs(got.item() - want) <= 1e-6 * abs(want), (got.item(), want)
    # a dropped sample counts 0; one reference has no negatives
    one = align.align_loss(feats, targets, sigmas, torch.tensor([1.0, 0.0]))
    assert abs(one.item() - 0.8 ** 3 * sum(hand(feats[k][0], targets[0]) for k in feats) / 4) < 1e-6
    single = align.block_loss(feats[0][:, :1], targets[:, :1])[0].item()
    pos = sum(max(0.0, 1 - cos(feats[0][0, 0, i], targets[0, 0, i])) for i in range(tokens)) / tokens
    assert abs(single - pos) < 1e-6
    # the gate's flags: RefAlign's (t/1000)^3, or with a floor
    assert torch.allclose(align.gate(torch.tensor([0.5])), torch.tensor([0.125]))
    assert torch.allclose(align.gate(torch.tensor([0.5]), 0.1, 3.0), torch.tensor([0.1 + 0.9 * 0.125]))


def test_gated_loss_is_refaligns_training_loss(data_dir, dino_dir, monkeypatch):
    """A training step on a RefAlign checkpoint with --align-loss and no other alignment flag (its gate, projectors
    and targets at train_a2.py's defaults; --align-blocks 0 1: the tiny model has two blocks): the alignment term it
    adds equals RefAlign's training loss on the same projected reference tokens and targets (tests/their_refalign.py:
    training_align_loss, from diffsynth/pipelines/wan_video_new6.py, whose training_loss gates it with
    gate_from_timestep(timestep, 0, 1000, beta=3.0), min_val 0: (t/1000)^3) within 1e-4 relative, per sample."""

    from a2.data.loader import collate
    from data import E2VDataset
    from tests.their_refalign import training_align_loss

    cfg = train_config(args(data_dir, data_dir.parent / "unused", "r", "--num-frames", "9",
                                          *align_flags(dino_dir), "--text-dropout", "0", model="tiny-refalign"))
    device = torch.device("cpu")
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), device)
    enc = train_a2.load_run_encoders(cfg, run, device, needed=True)
    model, _ = train_a2.build_transformer(cfg, run, 0)
    ds = E2VDataset(run.datasets, num_frames=9, verbose=False,
                    layout=run.layout)
    seen = []
    ours = align.align_loss
    monkeypatch.setattr(align, "align_loss", lambda *a: seen.append((a, ours(*a))) or seen[-1][1])
    for step in range(2):  # two steps: two sigmas
        inputs = train_a2.model_inputs(collate([ds[step]]), step, 0, cfg.optim, cfg.objective, cfg.references, run,
                                       enc, 0, device)
        with torch.no_grad():
            train_a2.forward_loss(model, inputs, cfg.objective, cfg.references, run, train_a2.nullcontext(),
                                  torch.float32)
    assert len(seen) == 2
    for (features, targets, sigmas, kept, *_), got in seen:
        assert kept.item() == 1 and targets.shape[1] == 3  # the three references, kept
        want = training_align_loss({k: f[0] for k, f in features.items()}, targets[0], sigmas * 1000)
        assert abs(got.item() - want.item()) <= 1e-4 * abs(want.item()), (got.item(), want.item(), sigmas)


def test_dino_targets_are_the_last_layer_patch_tokens_on_the_dit_grid(dino_dir):
    """The reference resized to the DiT grid x 16 px (no resize when the video's size is already that, as RefAlign's
    480x832 -> 30x52), normalised as DINOv3's processor, CLS and the 4 registers dropped, the last layer before the
    final norm (RefAlign's hidden_states[-1])."""
    target = align.load_target_model(dino_dir, "cpu")
    model = target[0]
    g = torch.Generator().manual_seed(1)
    images = torch.rand(1, 2, 3, 32, 48, generator=g) * 2 - 1  # (B, N, 3, H, W)
    got = align.dino_targets(target, images, (2, 3))
    assert got.shape == (1, 2, 6, 24)
    x = ((images[0] + 1) / 2 - torch.tensor(align.IMAGENET_MEAN).view(1, 3, 1, 1)) / \
        torch.tensor(align.IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        want = model(pixel_values=x, output_hidden_states=True).hidden_states[-1][:, 5:]
    assert torch.allclose(got[0], want, atol=1e-6)
    assert not torch.allclose(got[0], model(pixel_values=x).last_hidden_state[:, 5:], atol=1e-3)  # not post-norm
    assert align.dino_targets(target, images, (1, 1)).shape == (1, 2, 1, 24)  # another grid: resized to 16x16
    with pytest.raises(ValueError, match="not a DINOv3 model dir"):
        align.target_dim(dino_dir.parent / "missing")


@pytest.mark.parametrize("kind", ["phantom", "v3", "incontext", "standin"])
def test_reference_spans_find_each_kinds_reference_tokens(kind):
    """In a block output laid out as each kind's model input (video frames, then reference frames or tokens), the
    spans pick exactly the tokens of each reference: token ids written in by frame and reference."""
    from a2.kinds.conditioning import make_layout

    repeats = {"phantom": (1, 1, 1), "v3": (1, 1), "incontext": (1, 5, 1), "standin": (1,)}[kind]
    layout = make_layout(kind, 9, repeats)
    grid = (2, 3)
    starts, tokens, ref_grid = align.reference_spans(layout, grid)
    video = 3 * 6  # 3 latent frames of 2x3 tokens
    if kind == "standin":
        assert (tokens, ref_grid) == (32 * 32, (32, 32))  # Stand-In's 512x512 reference: 64x64 latents, patch 2
        ids = torch.cat([torch.zeros(video), torch.ones(tokens)])
        want = [1.0]
    else:
        latents = {"phantom": [1, 1, 1], "v3": [1, 1, 1, 1], "incontext": [1, 2, 1]}[kind]  # slot frames
        ids = torch.cat([torch.zeros(video)] + [torch.full((f * 6,), float(r + 1)) for r, f in enumerate(latents)])
        want = [float(r + 1) for r in range(len(repeats))]  # v3: the real references, not the empty slots
    hidden = ids[None, :, None].expand(1, -1, 4)  # (1, L, 4)
    got = align.reference_tokens(hidden, starts, tokens)
    assert got.shape == (1, len(want), tokens, 4)
    assert [got[0, r].unique().tolist() for r in range(len(want))] == [[w] for w in want]
    with pytest.raises(ValueError, match="no reference tokens"):
        align.reference_spans(make_layout("prefix", 9, (1,)), grid)


# ---------------------------------------------------------------- in training


def test_weight_zero_trains_bit_identically_and_the_loss_matters(data_dir, tmp_path, dino_dir):
    """--align-loss --align-weight 0 trains the LoRA as a run without it, to rounding (the projectors train beside,
    with zero gradients); weight 1 changes the loss and the LoRA, and its projectors move; the exported LoRA files hold
    no projector."""
    steps = ("--max-steps", "2", "--reference-dropout", "0.3", "--text-dropout", "0.3")
    plain = train(*phantom(data_dir, tmp_path, "plain", *steps))
    zero = train(*phantom(data_dir, tmp_path, "zero", *steps, *align_flags(dino_dir), "--align-weight", "0"))
    one = train(*phantom(data_dir, tmp_path, "one", *steps, *align_flags(dino_dir)))
    p, z, o = (params(r["run_dir"] / "ckpt-0000002") for r in (plain, zero, one))
    projector_keys = {k for k in z if k.startswith(align.ATTRIBUTE + ".")}
    assert projector_keys == {f"{align.ATTRIBUTE}.mlps.{i}.{j}.weight" for i in (0, 1) for j in (0, 2)}
    assert z[f"{align.ATTRIBUTE}.mlps.0.0.weight"].shape == (64, 128)  # dim 128 -> 64 -> 24 (DINOv3's width)
    assert z[f"{align.ATTRIBUTE}.mlps.0.2.weight"].shape == (24, 64)
    lora = {k: v for k, v in z.items() if k not in projector_keys}
    assert lora.keys() == p.keys()
    # The same update to rounding, not bit for bit: the clip's global norm also sums the projectors' four zero
    # squares, and a vectorized sum of another length adds in another order (on this box's CPU, 70 of the lengths
    # 1..399 round differently with 4 zeros appended), so the clip scale can move by one float32 step.
    for k in p:
        assert_rounding(lora[k], p[k], 8)
    lz, lp = losses(zero["run_dir"]), losses(plain["run_dir"])
    assert lz.keys() == lp.keys() and all(abs(lz[s] - lp[s]) <= 1e-6 * abs(lp[s]) for s in lp), (lz, lp)
    assert losses(one["run_dir"])[1] > losses(plain["run_dir"])[1]  # the alignment term adds to the same step
    assert max(max_diff({k: o[k] for k in p}, p), 0) > 1e-6
    assert max_diff({k: o[k] for k in projector_keys}, {k: z[k] for k in projector_keys}) > 1e-6
    for f in one["run_dir"].glob("*.safetensors"):
        assert not any(align.ATTRIBUTE in k or "input_mlp" in k for k in load_file(f)), f


def test_the_loss_reaches_only_the_chosen_blocks_and_projectors(data_dir, dino_dir):
    """The alignment loss of block 0 alone: gradients in block 0, the patch embedding and time/text embedders before
    it, and its projector; none in block 1 nor the output head (the model's later weights are the flow loss's)."""

    from a2.data.loader import collate
    from data import E2VDataset

    cfg = train_config(phantom(data_dir, data_dir.parent / "unused", "g",
                                             "--training-type", "full", *align_flags(dino_dir, "0"),
                                             "--no-gradient-checkpointing", "--text-dropout", "0"))
    device = torch.device("cpu")
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), device)
    enc = train_a2.load_run_encoders(cfg, run, device, needed=True)
    model, _ = train_a2.build_transformer(cfg, run, 0)
    batch = collate([E2VDataset(train_a2.run_datasets(cfg), num_frames=9, verbose=False)[0]])
    inputs = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0, device)
    flow_only, _ = train_a2.forward_loss(model, inputs, cfg.objective, replace(cfg.references, align_loss=False), run,
                                         train_a2.nullcontext(), torch.float32)
    both, _ = train_a2.forward_loss(model, inputs, cfg.objective, cfg.references, run, train_a2.nullcontext(),
                                    torch.float32)
    (both - flow_only).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads[f"{align.ATTRIBUTE}.mlps.0.2.weight"].abs().max() > 0
    assert all(g is not None and g.abs().max() > 0 for n, g in grads.items() if n.startswith("blocks.0.ffn"))
    assert grads["patch_embedding.weight"].abs().max() > 0
    later = [n for n in grads if n.startswith(("blocks.1.", "proj_out", "scale_shift_table"))]
    assert later and all(grads[n] is None or grads[n].abs().max() == 0 for n in later)
    assert not any(n.startswith(f"{align.ATTRIBUTE}.mlps.1") for n in grads)


def test_ddp_equals_one_process(data_dir, tmp_path, dino_dir, phantom_dir):
    """2 ranks x micro 1 == 1 process x micro 2, the projectors included (they run inside the DDP forward)."""
    steps = ["--max-steps", "2", "--lr", "1e-2", "--adam-eps", "1e-4", *align_flags(dino_dir)]
    p = launch(phantom(data_dir, tmp_path, "ddp", "--micro-batch", "1", *steps),
               nproc=2)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    one = train(*phantom(data_dir, tmp_path, "one", "--micro-batch", "2", *steps))
    ddp, ref = params(tmp_path / "ddp" / "ckpt-0000002"), params(one["run_dir"] / "ckpt-0000002")
    assert any(k.startswith(align.ATTRIBUTE) for k in ref)
    assert max_diff(ddp, ref) <= 1e-6


def test_full_resume_equals_uninterrupted_and_export_has_no_projectors(data_dir, tmp_path, dino_dir, phantom_dir):
    """A full fine-tune with the loss, stopped after step 1 and resumed, ends where the uninterrupted run does
    (projectors and their Adam state restored from the checkpoint); the exported transformer dir, its ComfyUI file and
    Phantom's original-key file hold the model's keys alone."""
    from a2.model.transformer import diffusers_to_original, load_transformer

    steps = ["--training-type", "full", "--ckpt-every", "1", *align_flags(dino_dir)]
    whole = train(*phantom(data_dir, tmp_path, "whole", "--max-steps", "2", *steps))
    train(*phantom(data_dir, tmp_path, "cut", "--max-steps", "1", *steps))
    resumed = train(*phantom(data_dir, tmp_path, "cut", "--max-steps", "2", "--resume", "auto", *steps))
    a, b = params(whole["run_dir"] / "ckpt-0000002"), params(resumed["run_dir"] / "ckpt-0000002")
    assert any(k.startswith(align.ATTRIBUTE) for k in a)
    assert max_diff(a, b) <= 1e-6
    base = set(load_transformer(phantom_dir).state_dict())
    assert set(load_transformer(whole["weights"]).state_dict()) == base
    assert set(load_file(whole["weights"] / "diffusion_pytorch_model.safetensors")) == base
    comfy = load_file(whole["run_dir"] / "transformer_comfy.safetensors")
    assert comfy and not any("align" in k or "mlps" in k for k in comfy)
    original = torch.load(whole["run_dir"] / "transformer_original" / "Phantom-Wan.pth")
    assert set(original) == set(diffusers_to_original(load_transformer(phantom_dir).state_dict()))


def test_cache_holds_the_targets_and_equals_the_pixels(data_dir, tmp_path, dino_dir, monkeypatch):
    """On the refalign kind: --precompute stores each reference's DINOv3 targets; training from the cache (no DINOv3
    model loaded) equals training from the pixels; --reference-augment refuses the cache in one line."""
    cache = tmp_path / "cache"
    steps = ["--max-steps", "2", "--reference-dropout", "0.3", *align_flags(dino_dir)]

    def refalign(run, *extra):
        return args(data_dir, tmp_path, run, "--num-frames", "9", "--elements", *FIT, *extra, model="tiny-refalign")

    raw = train(*refalign("raw", *steps))
    train(*refalign("pre", "--cache-dir", str(cache), "--precompute", *steps))
    (key_dir,) = cache.iterdir()
    sample = torch.load(key_dir / "samples" / "0.pt")
    assert sample["align"].shape == (3, 4, 24)  # 3 references, a 2x2 token grid, DINOv3's 24 wide
    monkeypatch.setattr(align, "load_target_model", lambda *a, **k: pytest.fail("DINOv3 loaded with a cache"))
    cached = train(*refalign("cached", "--cache-dir", str(cache), *steps))
    assert losses(cached["run_dir"]) == losses(raw["run_dir"])
    assert max_diff(params(cached["run_dir"] / "ckpt-0000002"), params(raw["run_dir"] / "ckpt-0000002")) == 0.0
    with pytest.raises(ConfigError, match="--reference-augment augments the reference pixels") as e:
        train(*refalign("aug", "--cache-dir", str(cache), "--reference-augment", *steps))
    assert "\n" not in str(e.value)


def test_refusals_in_one_line(data_dir, tmp_path, dino_dir):
    """A kind without reference tokens, a missing target model, --fsdp, and dropouts that do not add up."""
    cases = [(args(data_dir, tmp_path, "a", *align_flags(dino_dir)), "the prefix kind has none"),
             (phantom(data_dir, tmp_path, "b", "--align-loss"), "needs --align-model"),
             (phantom(data_dir, tmp_path, "c", *align_flags(dino_dir), "--training-type", "full", "--fsdp"),
              "not tried with --fsdp"),
             (phantom(data_dir, tmp_path, "d", "--text-dropout", "0.5", "--reference-dropout", "0.3",
                      "--joint-dropout", "0.3"), "summing to at most 1"),
             (args(data_dir, tmp_path, "e", "--model", "tiny-t2v", "--reference-augment", "--dataset-type", "t2v"),
              "takes no reference images")]
    for argv, words in cases:
        with pytest.raises(ConfigError) as e:
            train(*argv)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not (tmp_path / argv[argv.index("--run-name") + 1]).exists()


# ---------------------------------------------------------------- augmentation and the joint dropout


def test_reference_augmentation_is_the_samples_own_and_fills_white(data_dir):
    """Augmentation draws from the sample's own stream (the same images at the same (seed, step, sample), others at
    another step), leaves the other draws (noise, sigma) unchanged, fills with white, and the VAE sees its result."""

    from a2.data.loader import collate
    from a2.kinds.align import augment_image, augment_references
    from a2.train.flow import sample_generator
    from data import E2VDataset

    # a white reference stays one flat colour whatever is drawn (the colour jitter may dim it): warps fill with white
    for step in range(8):
        out = augment_image(torch.ones(3, 16, 24), sample_generator(0, step, 0, stream=1))
        assert torch.allclose(out, out[:, :1, :1].expand_as(out), atol=1e-5), step

    refs = torch.rand(2, 3, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    gens = lambda step: [sample_generator(0, step, k, stream=1) for k in range(2)]  # noqa: E731
    a, b, c = augment_references(refs, gens(0)), augment_references(refs, gens(0)), augment_references(refs, gens(1))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, refs)
    assert a.shape == refs.shape and a.min() >= -1 and a.max() <= 1

    cfg = train_config(phantom(data_dir, data_dir.parent / "unused", "x"))
    device = torch.device("cpu")
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), device)
    enc = train_a2.load_run_encoders(cfg, run, device, needed=True)
    batch = collate([E2VDataset(train_a2.run_datasets(cfg), num_frames=9, verbose=False)[0]])
    plain = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective, cfg.references, run, enc, 0, device)
    augmented = train_a2.model_inputs(batch, 0, 0, cfg.optim, cfg.objective,
                                      replace(cfg.references, reference_augment=True), run, enc, 0, device)
    assert torch.equal(plain["noise"], augmented["noise"]) and torch.equal(plain["sigmas"], augmented["sigmas"])
    assert torch.equal(plain["x0"], augmented["x0"])
    assert not torch.equal(plain["cond"].ref_latents, augmented["cond"].ref_latents)


def test_joint_dropout_is_refaligns_three_exclusive_cases():
    """--joint-dropout > 0: one draw decides text alone [0, .1), references alone [.1, .2), both [.2, .3), neither
    after; 0: the two draws decide independently as before."""
    from types import SimpleNamespace

    from a2.train.step import dropouts

    cfg = SimpleNamespace(text_dropout=0.1, reference_dropout=0.1, joint_dropout=0.1)
    u = [0.05, 0.15, 0.25, 0.35]
    assert dropouts(cfg, u, [0.0] * 4) == ([True, False, True, False], [False, True, True, False])
    cfg.joint_dropout = 0.0
    assert dropouts(cfg, u, [0.05, 0.5, 0.05, 0.5]) == ([True, False, False, False],
                                                                [True, False, True, False])


def test_the_other_token_kinds_train_with_the_loss(data_dir, tmp_path, dino_dir):
    """incontext (an element of 5 frames: 2 latent frames, the first aligned) and v3 (2 references in 4 slots) train a
    step with the loss, augmentation and the joint dropout; Stand-In's positions are test_reference_spans' (its
    512x512 reference makes a run slow)."""
    flags = [*align_flags(dino_dir), "--max-steps", "1", "--reference-augment", "--joint-dropout", "0.2"]
    for run, extra, model in [("ic", ["--reference-layout", "incontext", "--num-frames", "9", "--elements",
                                      "subject=_person.png", "object=_object.png:repeat=5"], "tiny-t2v"),
                              ("v3", ["--num-frames", "9", "--elements", *FIT[:2]], "tiny-v3")]:
        r = train(*args(data_dir, tmp_path, run, *extra, *flags, model=model))
        assert math.isfinite(r["losses"][0])
        assert any(k.startswith(align.ATTRIBUTE) for k in params(r["run_dir"] / "ckpt-0000001"))


# ---------------------------------------------------------------- the refalign kind (RefAlign's weights and sampler)


def test_refalign_samples_as_its_code_through_infer_defaults(tmp_path, monkeypatch):
    """infer.py on a RefAlign checkpoint (tiny-refalign: one model.safetensors in original-Wan keys, told from
    Phantom-Wan's by its name) with no sampler flag against RefAlign's pipeline written out (tests/their_refalign.py:
    its DiT forward with the references after the video and outside the text cross-attention, Euler shift 5 on
    linspace(1, 0) for 50 steps, U + 5 (I - U) + 7.5 (C - I), seed 0, CPU noise for the video frames only), float32:
    the references' latents and the final latents within 1e-5, 3 passes x 50 steps at its timesteps."""
    import infer
    from a2.kinds.kinds import WAN_NEGATIVE_PROMPT
    from a2.model.tiny import model_path
    from a2.model.transformer import detect_model, load_transformer
    from a2.pipeline import A2Pipeline, encode_prompt
    from tests import their_refalign
    from tests.test_released_models import reference_files

    model = model_path("tiny-refalign")
    assert detect_model(model).native_kind == "refalign"
    assert detect_model(model_path("tiny-phantom")).native_kind == "phantom"  # the same tensors, another name
    images, items = reference_files(tmp_path, [(301, 97), (97, 301)])
    prompt, out = "a hiker on a mountain", tmp_path / "a2.pt"
    timesteps = []
    call = A2Pipeline.__call__

    def recorded(self, *a, **kw):  # every forward's timestep, through infer.py's own pipeline
        handle = self.transformer.register_forward_pre_hook(
            lambda m, args, kwargs: timesteps.append(kwargs["timestep"].clone()), with_kwargs=True)
        try:
            return call(self, *a, **kw)
        finally:
            handle.remove()

    monkeypatch.setattr(A2Pipeline, "__call__", recorded)
    assert infer.main(infer.InferConfig.from_flags(model=str(model), elements=tuple(str(f) for _, f in items),
                                                   prompt=prompt, height=32, width=48, num_frames=9, device="cpu",
                                                   out=str(tmp_path / "v.mp4"), save_latents=str(out),
                                                   decode="none")) == 0
    ours = torch.load(out)
    pipe = A2Pipeline.from_pretrained(model)
    text, null = (encode_prompt(pipe.tokenizer, pipe.text_encoder, [p]) for p in (prompt, WAN_NEGATIVE_PROMPT))
    theirs = load_transformer(model).eval()
    them = their_refalign.refalign_sample(theirs, pipe.vae, images, text, null, num_frames=9, height=32, width=48)
    want = (their_refalign.flowmatch_sigmas(50) * 1000).repeat_interleave(3)
    assert len(timesteps) == 150 and torch.allclose(torch.cat(timesteps), want, rtol=0, atol=1e-3)
    assert (ours["condition"] - them["condition"]).abs().max() <= 1e-5  # (its pixels * 2/255 - 1 vs a2's /127.5)
    diff = (ours["latents"] - them["latents"]).abs().max()
    assert diff <= 1e-5, diff
    # the layout is not Phantom's: with the references in the text cross-attention the prediction moves
    g = torch.Generator().manual_seed(0)
    x, refs = torch.randn(1, 16, 3, 4, 6, generator=g), torch.randn(1, 16, 2, 4, 6, generator=g)
    t = torch.tensor([700.0])
    with torch.no_grad():
        skip = their_refalign.forward(theirs, x, t, text, refs)
        plain = theirs(hidden_states=torch.cat([x, refs], 2), timestep=t, encoder_hidden_states=text,
                       return_dict=False)[0][:, :, :3]
    assert (skip - plain).abs().max() > 1e-4


def test_refalign_trains_lora_and_full_with_the_loss_and_round_trips(data_dir, tmp_path, dino_dir):
    """train_a2.py --model <RefAlign> --align-loss trains a LoRA and a full fine-tune in its layout; the full one's
    export in its own keys (transformer_original/refalign_model.safetensors, the safetensors its pipeline reads) is
    detected as RefAlign again and holds the exported transformer's weights, without projectors."""
    from a2.model.tiny import model_path
    from a2.model.transformer import detect_model, diffusers_to_original, load_transformer

    flags = ["--num-frames", "9", "--elements", *FIT[:2], *align_flags(dino_dir), "--max-steps", "1"]
    lora = train(*args(data_dir, tmp_path, "lora", *flags, model="tiny-refalign"))
    run = json.loads((lora["run_dir"] / "run.json").read_text())
    assert run["layout"]["kind"] == "refalign" and run["layout"]["ref_latents"] == 2
    assert lora["weights"].name == "pytorch_lora_weights.safetensors"
    import infer  # the LoRA samples in infer.py, in the kind's layout, and changes the video

    base = dict(model=str(model_path("tiny-refalign")), height=32, width=32, num_frames=9, steps=2, device="cpu",
                elements=tuple(str(data_dir / f"000{e}") for e in ("_person.png", "_object.png")),
                out=str(tmp_path / "v.mp4"))
    assert infer.main(infer.InferConfig.from_flags(**base, save_latents=str(tmp_path / "base.pt"))) == 0
    assert infer.main(infer.InferConfig.from_flags(**base, lora=str(lora["weights"]),
                                                   compare=str(tmp_path / "base.pt"))) == 1
    full = train(*args(data_dir, tmp_path, "full", *flags, "--training-type", "full", model="tiny-refalign"))
    original = full["run_dir"] / "transformer_original"
    assert detect_model(original, components=model_path("tiny-refalign")).native_kind == "refalign"
    want, got = load_transformer(full["weights"]).state_dict(), load_transformer(original).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert set(load_file(original / "refalign_model.safetensors")) == set(diffusers_to_original(want))
    # the dry run traces the step with the loss (the projectors built, the targets as a cache holds them)
    dry = train(*args(data_dir, tmp_path, "dry", *flags, "--dry-run", model="tiny-refalign"))
    assert dry["peak_gb"] > 0
