"""a2/eval/evaluate.py with tiny random encoders built offline: reference similarity ranks the pasted reference above an
unrelated image, motion is zero when still and grows with displacement, shapes and a 1-frame video; infer.py
--eval-set writes its renders, metrics.csv/.jsonl and the base vs LoRA table."""

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from a2.elements import Element
from a2.eval.evaluate import evaluate_video, flat_metrics, load_evaluators, motion_magnitude, video_frames
from a2.eval.opens2v import flows, tiny_encoder_note
from a2.images import load_references
from config import EvalConfig, LoraSection


@pytest.fixture(scope="module")
def evaluators(tiny_dir, tmp_path_factory):
    """CLIP-I from the tiny A2 model dir's own image encoder (the default), tiny CLIPModel (CLIP-T), tiny DINOv2."""
    from a2.model.tiny import save_tiny_evaluators

    dirs = save_tiny_evaluators(tmp_path_factory.mktemp("evaluators"))
    return load_evaluators(EvalConfig(clip_text=str(dirs["clip_text"]), dino=str(dirs["dino"])), tiny_dir)


def disk(n=64):
    """A red disk on white (a cut-out reference, as A2's)."""
    yy, xx = np.mgrid[:n, :n] / n
    a = np.full((n, n, 3), 255, np.uint8)
    a[(yy - 0.5) ** 2 + (xx - 0.5) ** 2 < 0.1] = (200, 30, 30)
    return a


def stripes(n=64):
    a = np.zeros((n, n, 3), np.uint8)
    a[..., 1] = 120
    a[..., 2] = (np.sin(np.arange(n) / n * 40) > 0) * 255
    return a


def reference(tmp_path, array, name="subject"):
    """The element image through its own CLIP-path preprocessing (pad_white), as infer.py and validation load it."""
    path = tmp_path / f"{name}.png"
    Image.fromarray(array).save(path)
    element = Element(name, ("_x.png",), clip_preprocess="pad_white")
    _, clip, _, _ = load_references([(element, path)], (64, 96), (64, 64))
    return clip[0, 0]


def pasted(image, frames=5, step=2, seed=0):
    """`image` shrunk to 44 px and pasted into a noisy grey 64x96 background, moving `step` px right per frame."""
    bg = np.random.default_rng(seed).integers(80, 176, (64, 96, 3)).astype(np.uint8)
    small = np.asarray(Image.fromarray(image).resize((44, 44)))
    out = []
    for t in range(frames):
        f = bg.copy()
        f[10:54, 20 + step * t:64 + step * t] = small
        out.append(f)
    return torch.from_numpy(np.stack(out))


@pytest.mark.parametrize("ref,other", [(disk, stripes), (stripes, disk)])
def test_reference_in_the_frames_scores_higher_than_an_unrelated_image(evaluators, tmp_path, ref, other):
    el = {"subject": reference(tmp_path, ref())}
    same = flat_metrics(evaluate_video(pasted(ref()), el, "a red ball", evaluators))
    unrelated = flat_metrics(evaluate_video(pasted(other()), el, "a red ball", evaluators))
    frames_are_ref = flat_metrics(evaluate_video(torch.from_numpy(np.stack([ref()] * 3)), el, "x", evaluators))
    print(f"{ref.__name__} ref: pasted CLIP-I {same['clip_i']:.4f} DINO-I {same['dino_i']:.4f}; unrelated pasted "
          f"{unrelated['clip_i']:.4f} / {unrelated['dino_i']:.4f}; frames = the reference "
          f"{frames_are_ref['clip_i']:.5f}")
    for key in ("clip_i", "dino_i"):
        # not vacuous: the identical image scores 1, the unrelated one clearly less (random encoders map all
        # images close together; these two differ in colour, layout and frequency, margin measured >= 0.09)
        assert frames_are_ref[key] == pytest.approx(1.0, abs=1e-4)
        assert same[key] > unrelated[key] + 0.03
        assert same[f"subject/{key}_mean"] == same[key] <= same[f"subject/{key}_max"] <= 1 + 1e-5
    assert same["clip_t"] != unrelated["clip_t"]  # CLIP-T sees the frames


def test_motion_zero_when_still_and_growing_with_displacement():
    g = torch.Generator().manual_seed(0)
    texture = F.interpolate(torch.rand(1, 3, 16, 24, generator=g), size=(64, 96), mode="bicubic")[0].clamp(0, 1)
    texture = (texture.permute(1, 2, 0) * 255).byte()

    def moving(dx, n=6):
        return torch.stack([torch.roll(texture, dx * t, dims=1) for t in range(n)]).numpy()

    motion = {dx: motion_magnitude(flows(moving(dx))) for dx in (0, 1, 2, 4, 6)}
    print("motion (px/frame) by displacement:", {k: round(v, 3) for k, v in motion.items()})
    assert motion[0] < 0.01  # still: Farneback's polynomial fit leaves a residual (0.001 here)
    for dx in (1, 2, 4, 6):  # a uniform translation is recovered to within 10 % (the wrap-around seam excepted)
        assert motion[dx] == pytest.approx(dx, rel=0.1)
    # a 1-frame video has no pairs
    assert motion_magnitude(flows(moving(2, n=1))) == 0.0


def test_shapes_keys_and_one_frame(evaluators, tmp_path):
    el = {"subject": reference(tmp_path, disk()), "object": reference(tmp_path, stripes(), "object")}
    video = torch.rand(3, 5, 64, 96) * 2 - 1  # A2Pipeline's (3, F, H, W) in [-1, 1]
    assert video_frames(video).shape == (5, 64, 96, 3) and video_frames(video[None]).shape == (5, 64, 96, 3)
    assert np.array_equal(video_frames(torch.from_numpy(video_frames(video))), video_frames(video))
    r = evaluate_video(video, el, "a red ball", evaluators)
    assert set(r["video"]) == {"motion", "temporal_clip", "temporal_dino", "clip_i", "dino_i", "clip_t"}
    assert set(r["elements"]) == {"subject", "object"}
    for metrics in r["elements"].values():
        assert set(metrics) == {"clip_i_mean", "clip_i_max", "dino_i_mean", "dino_i_max"}
    assert r["video"]["clip_i"] == pytest.approx(np.mean([m["clip_i_mean"] for m in r["elements"].values()]))
    one = flat_metrics(evaluate_video(video[:, :1], el, "a red ball", evaluators))
    assert set(one) == set(flat_metrics(r)) and all(math.isfinite(v) for v in one.values())
    assert one["motion"] == 0.0 and one["temporal_clip"] == one["temporal_dino"] == 1.0
    assert set(evaluate_video(video, {}, "x", evaluators, max_frames=2)["video"]) == {
        "motion", "temporal_clip", "temporal_dino", "clip_t"}  # no elements: video metrics only
    with pytest.raises(ValueError, match=r"\(3, F, H, W\)"):
        video_frames(torch.rand(5, 3, 8, 8))


def test_missing_encoders_are_skipped_with_a_message(tmp_path, capsys):
    ev = load_evaluators(EvalConfig())
    out = capsys.readouterr().out
    assert "skipping CLIP-I" in out and "skipping DINO-I" in out and "skipping CLIP-T" in out and "face" in out
    r = evaluate_video(torch.rand(3, 3, 32, 32) * 2 - 1, {"subject": torch.zeros(3, 32, 32)}, "x", ev)
    assert set(r["video"]) == {"motion"} and r["elements"] == {"subject": {}}
    with pytest.raises(FileNotFoundError, match=r"nosuch \(--eval.dino\): no such model dir"):
        load_evaluators(EvalConfig(dino=str(tmp_path / "nosuch")))


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # deprecated; face models still ship in it
@pytest.mark.parametrize("fmt", ["model.pt2", "model.pt"])
def test_face_similarity_with_an_exported_model(evaluators, tmp_path, fmt):
    """The face interface: model.pt2 (torch.export) / model.pt (TorchScript) maps (B, 3, H, W) in [0, 1] to
    embeddings, NaN rows where it finds no face. This stand-in 'finds a face' in mostly red images and embeds their
    mean colour."""
    from a2.eval.evaluate import load_embedder

    class Face(torch.nn.Module):
        def forward(self, x):
            colour = x.mean((2, 3))
            found = (colour[:, 0] > colour[:, 1] + 0.05)[:, None]
            return torch.where(found, colour, torch.full_like(colour, float("nan")))

    (tmp_path / "face").mkdir()
    if fmt == "model.pt2":
        from torch.export import Dim

        dims = {"x": {0: Dim("b", min=1), 2: Dim("h"), 3: Dim("w")}}
        torch.export.save(torch.export.export(Face(), (torch.rand(2, 3, 64, 64),), dynamic_shapes=dims),
                          tmp_path / "face" / fmt)
    else:
        torch.jit.script(Face()).save(tmp_path / "face" / fmt)
    evaluators.face = load_embedder(tmp_path / "face", "--eval.face")
    try:
        frames = torch.from_numpy(np.stack([disk()] * 2 + [stripes()] * 2))  # a face in 2 of 4 frames
        r = evaluate_video(frames, {"subject": reference(tmp_path, disk()), "object": reference(tmp_path, stripes(),
                                    "object")}, "x", evaluators, faces=("subject",))
    finally:
        evaluators.face = None
    subject = r["elements"]["subject"]
    assert subject["face_frames"] == 0.5 and subject["face_sim_mean"] == pytest.approx(1.0, abs=1e-5)
    assert "face_sim_mean" not in r["elements"]["object"] and r["video"]["face_sim"] == subject["face_sim_mean"]


# ---------------------------------------------------------------- infer.py --eval-set


def test_eval_set_writes_renders_metrics_and_the_delta_table(tiny_dir, tmp_path, monkeypatch, capsys):
    import tyro

    import infer
    from a2.model.tiny import save_tiny_evaluators
    from a2.train.lora import export_weights
    from config import LORA_TARGETS
    from tests.test_lora import adapted_pipe

    lora = export_weights(tmp_path / "lora", adapted_pipe(tiny_dir, LORA_TARGETS).transformer, LoraSection(), None)
    dirs = save_tiny_evaluators(tmp_path / "evaluators")
    (tmp_path / "set" / "img").mkdir(parents=True)
    for name, array in (("me", disk()), ("bear", stripes()), ("forest", stripes(32)[::-1].copy())):
        Image.fromarray(array).save(tmp_path / "set" / "img" / f"{name}.png")
    rows = [dict(prompt="A man is holding a teddy bear in the forest.", seed=3,
                 elements={"subject": "img/me.png", "object": "img/bear.png", "background": "img/forest.png"}),
            dict(prompt="a red ball", elements=["img/me.png"])]  # by position: the subject; seed: --seed
    eval_set = tmp_path / "set" / "eval.jsonl"
    eval_set.write_text("".join(json.dumps(r) + "\n" for r in rows))
    written, real_save = {}, infer.save_video  # what is scored is the tensor, not the (lossy) mp4

    def save_video(path, video, *args):
        written[Path(path).name] = video
        return real_save(path, video, *args)

    monkeypatch.setattr(infer, "save_video", save_video)
    out = tmp_path / "eval"
    argv = ["--model", str(tiny_dir), "--height", "32", "--width", "48", "--num-frames", "17", "--steps", "2",
            "--device", "cpu", "--seed", "5", "--eval-set", str(eval_set), "--lora", str(lora), "--out-dir", str(out),
            "--eval.dino", str(dirs["dino"]), "--eval.clip-text", str(dirs["clip_text"])]
    assert infer.main(tyro.cli(infer.InferConfig, args=argv)) == 0
    printed = capsys.readouterr().out
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    with open(out / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    # per model: row 0 = video + 3 elements, row 1 = video + subject; then means per (model, element)
    keys = [(r["index"], r["model"], r["element"]) for r in jsonl]
    per_row = [(i, m, e) for i, els in ((0, ["subject", "object", "background"]), (1, ["subject"]))
               for m in ("base", "lora") for e in [""] + els]
    means = [("mean", m, e) for m in ("base", "lora") for e in ("", "subject", "object", "background")]
    assert keys == per_row + means
    assert [(r["index"], r["model"], r["element"]) for r in table] == [tuple(map(str, k)) for k in keys]
    assert [r["seed"] for r in jsonl[:12]] == [3] * 8 + [5] * 4
    video_row = jsonl[0]
    assert {"clip_t", "motion", "temporal_clip", "temporal_dino", "clip_i", "dino_i"} <= set(video_row)
    assert {"clip_i_mean", "clip_i_max", "dino_i_mean", "dino_i_max"} <= set(jsonl[1])
    # the scores are those of the rendered video: recompute row 0's base half from the written tensor
    both = written[video_row["file"]]
    assert both.shape == (3, 5, 32, 96)  # 17 frames - 12 reference frames; base | LoRA
    refs = infer.read_references(infer.InferConfig.from_flags(height=32, width=48, num_frames=17), infer.read_rows(
        str(eval_set))[0]["images"])
    again = evaluate_video(both[..., :48], refs["elements"], rows[0]["prompt"],
                           load_evaluators(EvalConfig(dino=str(dirs["dino"]), clip_text=str(dirs["clip_text"])),
                                           tiny_dir))
    assert again["video"] == pytest.approx({k: v for k, v in video_row.items() if isinstance(v, float)}, abs=1e-5)
    assert again["elements"]["object"]["dino_i_max"] == pytest.approx(jsonl[2]["dino_i_max"], abs=1e-5)
    # base and LoRA are different renders, and the means and the printed deltas follow from the rows
    assert video_row["clip_t"] != jsonl[4]["clip_t"]
    base_mean = next(r for r in jsonl if r["index"] == "mean" and r["model"] == "base" and r["element"] == "")
    lora_mean = next(r for r in jsonl if r["index"] == "mean" and r["model"] == "lora" and r["element"] == "")
    assert base_mean["clip_t"] == pytest.approx((jsonl[0]["clip_t"] + jsonl[8]["clip_t"]) / 2)
    line = next(s for s in printed.splitlines() if s.startswith("clip_t "))
    assert line.split()[1:] == [f"{base_mean['clip_t']:.4f}", f"{lora_mean['clip_t']:.4f}",
                                f"{lora_mean['clip_t'] - base_mean['clip_t']:+.4f}"]
    assert "delta" in printed and "subject/clip_i_mean" in printed and "skipping face similarity" in printed
    # tiny random encoders (the tiny model's CLIP, these DINO and CLIP): said beside the table, and when loaded
    notes = [s for s in printed.splitlines() if s.startswith("note: ")]
    assert [n.split(" come from a 2-layer encoder")[0] for n in notes] == [
        "note: CLIP-I and temporal_clip", "note: DINO-I and temporal_dino", "note: CLIP-T"], notes
    assert printed.rstrip().endswith(notes[-1]) and printed.count("evaluate: note: ") == 3
    real = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(num_hidden_layers=32),
                                                  text_config=SimpleNamespace(num_hidden_layers=24)))
    assert tiny_encoder_note(real, "CLIP-T", "x") is None and tiny_encoder_note(torch.nn.Linear(2, 2), "f", "x") is None
    assert sorted(p.name for p in out.glob("*.mp4")) == sorted({r["file"] for r in jsonl[:12]})
    # a bad row is named before any model loads
    eval_set.write_text(json.dumps(dict(prompt="x", elements={"subject": "img/none.png"})) + "\n")
    with pytest.raises(FileNotFoundError, match=r"eval.jsonl:1: .*none.png: element 'subject' image not found"):
        infer.main(tyro.cli(infer.InferConfig, args=argv))


# ---------------------------------------------------------------- validation during training


def test_validation_logs_the_metrics_next_to_the_loss(tiny_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from a2.model.tiny import save_tiny_evaluators
    from data import make_synthetic_dataset
    from tests.conftest import args, train

    data = make_synthetic_dataset(tmp_path / "data", num_samples=2, num_frames=17, size=(32, 32))
    dino = save_tiny_evaluators(tmp_path / "evaluators")["dino"]
    images = [str(data / f"000_{name}.png") for name in ("person", "object", "background")]
    result = train(*args(data, tmp_path / "runs", "val", "--max-steps", "4", "--val-every", "2", "--val-steps", "1",
                         "--val-elements", *images, "--eval.dino", str(dino), "--tensorboard", model=tiny_dir))
    rows = [json.loads(line) for line in (result["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val/motion" in r]
    assert [r["step"] for r in val] == [2, 4] and [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    for r in val:  # CLIP-I from the model's own image encoder, DINO-I from --eval.dino; per element and per video
        assert {"val/clip_i", "val/dino_i", "val/temporal_clip", "val/temporal_dino", "val/subject/clip_i_mean",
                "val/background/dino_i_max"} <= set(r)
        assert all(math.isfinite(v) for k, v in r.items() if k != "step")
    assert val[0]["val/clip_i"] != val[1]["val/clip_i"]  # the second video is the trained model's
    tb = EventAccumulator(str(result["run_dir"] / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("val/subject/clip_i_mean")] == [2, 4]
