"""Training and sampling frame the same element images alike, captured from the entry points themselves:
train_a2.main's dataset (what main hands the loader: the element specs, the layout, the framing it built) against
the references infer.py's main hands the pipeline for the same files; and a run's validation video (main's own,
end to end) against infer.py's for the same images. Nothing here calls the helpers main calls: a main that framed a
released model's references with SkyReels-A2's specs, or planned another layout, shows."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import args, drawn_person, train
from tests.spy import run_infer

# kind -> (model, the flags both CLIs take); each on its own default element specs (no --elements)
KINDS = {
    "prefix": ("tiny", ["--num-frames", "21"]),  # A2's three elements take 9 frames (repeats 1 / 4 / 4)
    "phantom": ("tiny-phantom", []),
    "v3": ("tiny-v3", []),
    "magref": ("tiny-magref", ["--resolution", "64", "128"]),  # three references on one canvas, each a token wide
    "refalign": ("tiny-refalign", []),
    "standin": ("tiny-t2v", ["--reference-layout", "standin"]),
    "vace": ("tiny-vace", []),
}
SIZE = ["--resolution", "32", "64", "--num-frames", "9"]  # non-square, and element images of other aspects


@pytest.fixture(scope="module")
def odd_data(data_dir, tmp_path_factory):
    """The synthetic dataset with its element images redrawn at three other aspects (tall, wide, odd sides), so
    that framings that agree on a square image (a fit, a pad, a crop) differ here."""
    d = tmp_path_factory.mktemp("odd") / "data"
    shutil.copytree(data_dir, d)
    for suffix, size in (("_person.png", (45, 27)), ("_object.png", (23, 41)), ("_background.png", (30, 50))):
        for i, p in enumerate(sorted(d.glob(f"*{suffix}"))):
            drawn_person(size, seed=i, background="white" if suffix != "_background.png" else "scene").save(p)
    return d


@pytest.mark.parametrize("kind", list(KINDS))
def test_main_trains_and_validates_as_infer_samples(kind, odd_data, tmp_path, monkeypatch):
    import a2.eval.evaluate
    import infer
    import train_a2

    model, flags = KINDS[kind]
    built, written = [], {}

    class Captured(train_a2.E2VDataset):  # the dataset main builds, as it builds it
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)

    def save(key):
        return lambda path, video, fps=15, references=None: written.setdefault(key, (video, fps)) and path

    n = 1 if kind == "standin" else 3
    first = sorted(odd_data.glob("*.mp4"))[0].stem
    files = [str(odd_data / f"{first}{s}") for s in ("_person.png", "_object.png", "_background.png")]
    monkeypatch.setattr(train_a2, "E2VDataset", Captured)
    monkeypatch.setattr(a2.eval.evaluate, "save_video", save("validation"))
    monkeypatch.setattr(infer, "save_video", save("infer"))
    r = train(*args(odd_data, tmp_path, "run", *SIZE, *flags, "--max-steps", "1", "--lr", "0", "--val-every", "1",
                    "--val-steps", "2", "--val-elements", *files[:n], model=model))
    assert r["step"] == 1
    (ds,) = built
    assert ds.layout.kind == kind
    index = next(i for i, s in enumerate(ds.samples) if s.id == first)
    item = ds[index]
    # the sample's element files, in the order main's specs read them, are the validation images
    assert [str(ds.samples[index].elements[name]) for name in item["element_names"]] == files[:n]
    # infer.py on the same files (named in order, as a user passes them), the same size and frames, 2 steps
    rec = run_infer(monkeypatch, ["--model", model, *SIZE, "--steps", "2", "--device", "cpu", "--out",
                                  str(tmp_path / "v.mp4"), "--elements", *files[:n], *flags])
    assert rec.layout.kind == kind
    assert rec.references[0].shape == item["ref_vae"].shape
    assert torch.equal(rec.references[0], item["ref_vae"])  # the same pixels: the same ops on the same file
    # main's validation video (after a step at lr 0: the weights as loaded, their LoRA's B still zero) is infer.py's
    # for the validation images (both CLIs' default prompt), bit for bit
    (video, fps), (want, want_fps) = written["validation"], written["infer"]
    assert fps == want_fps and video.shape == want.shape and torch.equal(video, want)


@pytest.fixture(scope="module")
def phantom_validation(odd_data, tmp_path_factory):
    """validate() of a tiny Phantom-Wan run planned from train_a2.py's flags (the model and encoders loaded once):
    returns a function of the extra flags -> the video validation writes."""
    import a2.eval.evaluate
    import train_a2
    from a2.train.step import Process
    from tests.conftest import train_config

    first = sorted(odd_data.glob("*.mp4"))[0].stem
    shared = [*SIZE, "--model", "tiny-phantom", "--data-root", str(odd_data), "--device", "cpu", "--val-every", "1",
              "--val-steps", "2", "--val-elements", *(str(odd_data / f"{first}{s}") for s in ("_person.png",
                                                                                            "_object.png"))]
    device = torch.device("cpu")
    cfg = train_config(shared)
    run = train_a2.plan_run(cfg, 1, train_a2.run_datasets(cfg), device)
    enc = train_a2.load_run_encoders(cfg, run, device, needed=True)
    transformer = train_a2.load_transformer(run.info.path, torch.float32, run.subfolder)
    out, made = tmp_path_factory.mktemp("validation"), {}

    def video(*flags):
        if flags in made:
            return made[flags]
        written = []
        real = a2.eval.evaluate.save_video
        a2.eval.evaluate.save_video = lambda path, v, fps=15, references=None: written.append(v) or path
        try:
            cfg = train_config([*shared, *flags])
            a2.eval.evaluate.validate(1, *train_a2.validation_sections(cfg), run, transformer, enc, out, {},
                                    Process(0, 0, 1, device), log=lambda *_: 0)
        finally:
            a2.eval.evaluate.save_video = real
        made[flags] = written[0]
        return written[0]
    return video


@pytest.mark.parametrize("flag", [["--val-steps", "3"], ["--val-guidance-scale", "2"], ["--val-flow-shift", "3"]])
def test_every_validation_flag_reaches_the_model(flag, phantom_validation):
    """docs/kinds.md: --val-steps, --val-guidance-scale and --val-flow-shift replace the kind's own for a run's
    validation video: each changes it against the same run without it (bit-identical when a flag is dropped)."""
    base = phantom_validation()
    assert (phantom_validation(*flag) - base).abs().max().item() > 1e-5
