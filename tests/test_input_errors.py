"""infer.py, data.py and bench.py as a newcomer meets them: each input mistake ends in one line (exit 2), a signal in
one line with what is kept (exit 128 + the signal), and a precompute says it resumes."""

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import infer
import train_a2
from a2.cli import run_cli
from a2.kinds.kinds import index_elements
from config import DataConfig, Validate
from tests.conftest import ROOT


def one_line_exit_2(capsys, cfg: dict) -> str:
    """infer.py's main on InferConfig(**cfg), as its __main__ runs it (a flag's own check, in the config, included):
    must exit 2 with one line on stderr and nothing else."""
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: infer.main(infer.InferConfig.from_flags(**cfg)))
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if line and not line.startswith("\r")]  # progress bars aside
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("mistake, want", [
    ("missing", "nope.png: element 'subject' image not found"),
    ("text", "notes.png: element 'subject' is not a readable image"),
    ("size", "--height 60 --width 60: height and width must be positive multiples of 16, got 60x60"),
    ("frames", "--num-frames 20: num_frames must be 4k+1 (e.g. 17, 49, 81), got 20; the nearest: 17 or 21"),
])
def test_infer_input_mistakes_are_one_line_exit_2(tmp_path, capsys, data_dir, mistake, want):
    (tmp_path / "notes.png").write_text("not a picture\n")
    good = [str(data_dir / f"000_{n}.png") for n in ("person", "object", "background")]
    cfg = dict(missing=dict(elements=(str(tmp_path / "nope.png"), *good[1:])),
               text=dict(elements=(str(tmp_path / "notes.png"), *good[1:])),
               size=dict(elements=tuple(good), height=60, width=60),
               frames=dict(elements=tuple(good), num_frames=20))[mistake]
    err = one_line_exit_2(capsys, dict(model="tiny", device="cpu", out=str(tmp_path / "o.mp4"), **cfg))
    assert want in err
    assert not (tmp_path / "o.mp4").exists()


@pytest.mark.parametrize("mistake, want", [
    ("no prompt", "Open-Domain_Eval.json: sample singleobj_1: no 'prompt'"),
    ("missing image", "Open-Domain_Eval.json: sample singleobj_1: {root}/Images/none.jpg: reference image not found"),
    ("corrupt image", "Open-Domain_Eval.json: sample singleobj_1: {root}/Images/notes.jpg: not a readable image"),
    ("too many images", "Open-Domain_Eval.json: sample singleobj_1: its img_paths: 4 images, but --model tiny "
                        "(Wan2.1 I2V) samples as the prefix kind, which takes at most 3 references"),
    ("paths not a list", "Open-Domain_Eval.json: sample singleobj_1: 'img_paths' must be a list of paths"),
    ("not a set", "Open-Domain_Eval.json: expected {sample id: {prompt, img_paths, ...}}, got list"),
    ("not JSON", "Open-Domain_Eval.json: cannot read an OpenS2V-Eval set (Expecting property name"),
    ("jsonl prompt not text", "eval.jsonl:2: no 'prompt' (or 'caption' / 'text') text"),
    ("jsonl seed not a number", "eval.jsonl:2: 'seed' must be an integer, got 'one'"),
    ("jsonl element not a path", "eval.jsonl:2: 'elements' must be {name: path} or [path, ...], got [1]"),
    ("jsonl missing", "eval.jsonl: no such file"),
])
def test_an_eval_set_with_a_bad_row_is_one_line_exit_2(tmp_path, capsys, monkeypatch, mistake, want):
    """infer.py --eval-set on an OpenS2V-Eval set as downloaded (a JSON object of samples beside Images/) or a2's
    .jsonl, one row wrong: one line naming the file and the sample or line, exit 2, before any weights load."""
    monkeypatch.setattr(infer.A2Pipeline, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    root = tmp_path / "OpenS2V-Eval"
    (root / "Images").mkdir(parents=True)
    Image.new("RGB", (40, 30), "red").save(root / "Images" / "a.jpg")
    (root / "Images" / "notes.jpg").write_text("not a picture\n")
    good = dict(img_paths=["Images/a.jpg"], prompt="a red thing")
    sample = dict(good)
    sample.update({"no prompt": dict(prompt=""), "missing image": dict(img_paths=["Images/none.jpg"]),
                   "corrupt image": dict(img_paths=["Images/notes.jpg"]), "too many images": dict(
                       img_paths=["Images/a.jpg"] * 4), "paths not a list": dict(img_paths="Images/a.jpg")}.get(
        mistake, {}))
    eval_set = root / "Open-Domain_Eval.json"
    eval_set.write_text("{" if mistake == "not JSON" else json.dumps(
        [sample] if mistake == "not a set" else {"singleface_1": good,
                                                  "singleobj_1": sample}))
    if mistake.startswith("jsonl"):
        eval_set = tmp_path / "eval.jsonl"
        row = {"prompt text": {"prompt": 5}, "seed": {"prompt": "a", "seed": "one"}, "element": {
            "prompt": "a", "elements": [1]}}.get(mistake.split(" ")[1], {})
        if mistake != "jsonl missing":
            eval_set.write_text('{"prompt": "fine"}\n' + json.dumps(row) + "\n")
    err = one_line_exit_2(capsys, dict(model="tiny", device="cpu", eval_set=str(eval_set), out_dir=str(tmp_path)))
    assert want.replace("{root}", str(root)) in err, err


def test_a_missing_file_or_gpu_is_one_line_before_any_weights_load(tmp_path, capsys, monkeypatch, data_dir):
    monkeypatch.setattr(infer.A2Pipeline, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    good = (str(data_dir / "000_person.png"),)
    for flag in ("lora", "compare"):
        value = (str(tmp_path / "x"),) if flag == "lora" else str(tmp_path / "x")
        err = one_line_exit_2(capsys, dict(model="tiny", device="cpu", elements=good, **{flag: value}))
        assert err == f"error: --{flag} {tmp_path / 'x'}: no such file or dir"
    (tmp_path / "file").write_text("")
    for flag, value in (("save_latents", "file/x.pt"), ("out", "file/x/v.mp4")):  # was a traceback after rendering
        err = one_line_exit_2(capsys, dict(model="tiny", device="cpu", elements=good, **{flag: str(tmp_path / value)}))
        assert err == f"error: --{flag.replace('_', '-')} {tmp_path / value}: {tmp_path / 'file'} is a file, not a " \
                      "dir to write into"
    if not torch.cuda.is_available():  # --device cuda where there is none (it was CUDA's own traceback)
        err = one_line_exit_2(capsys, dict(model="tiny", device="cuda", elements=good))
        assert err == "error: --device cuda: PyTorch sees no CUDA GPU here (--device cpu, or auto)"


@pytest.mark.parametrize("name, make, why", [
    ("notes.txt", lambda p: p.write_text("my notes\n"), "this file is not a LoRA (a .txt file)"),
    ("config.json", lambda p: p.write_text("{}"), "this file is not a LoRA (a .json file)"),
    ("empty.safetensors", lambda p: p.write_bytes(b""), "this file is not a LoRA (an empty file)"),
    ("text.safetensors", lambda p: p.write_text("hello\n"), "this file is not a LoRA (not a safetensors file: "),
    ("model.safetensors", lambda p: save_file({"blocks.0.attn1.to_q.weight": torch.zeros(2, 2)}, p),
     "this file is not a LoRA (1 tensors, none a LoRA weight (e.g. blocks.0.attn1.to_q.weight))"),
    ("text.ckpt", lambda p: p.write_text("x\n"), "this file is not a LoRA (not a PyTorch checkpoint of tensors"),
    ("run", lambda p: p.mkdir(), "this dir is not a LoRA (a dir without pytorch_lora_weights.safetensors or a "
                                 "peft adapter_config.json)"),
])
def test_a_lora_flag_at_no_lora_is_one_line_before_any_weights_load(tmp_path, capsys, monkeypatch, data_dir, name,
                                                                     make, why):
    """--lora at a text file, a config.json, an empty or truncated file, a model's weights or a dir of no adapter:
    one line naming the flag and the file, what it is, and what to give (it was safetensors' traceback)."""
    monkeypatch.setattr(infer.A2Pipeline, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    make(tmp_path / name)
    err = one_line_exit_2(capsys, dict(model="tiny", device="cpu", elements=elements(data_dir, "tiny"),
                                       lora=(str(tmp_path / name),)))
    assert err.startswith(f"error: --lora {tmp_path / name}: {why}"), err
    assert err.endswith("give a LoRA .safetensors (a2's pytorch_lora_weights.safetensors, a ComfyUI / musubi-tuner "
                        "file), a training run's dir, a peft adapter dir, or a Stand-In .ckpt"), err


@pytest.mark.parametrize("model, images, want", [
    ("tiny-v3", 5, "--elements: 5 images, but --model tiny-v3 (SkyReels-V3 R2V) samples as the v3 kind, which takes "
                   "at most 4 references: give at most 4"),
    ("tiny-magref", 9, "--elements: 9 images, but --model tiny-magref (MAGREF) samples as the magref kind, which "
                       "takes at most 8 references: give at most 8"),
    ("tiny-phantom", 5, "which takes at most 4 references: give at most 4"),
    ("tiny-vace", 5, "which takes at most 4 references: give at most 4"),
    ("tiny", 4, "--elements: 4 images, but --model tiny (Wan2.1 I2V) samples as the prefix kind, which takes at most "
                "3 references: give at most 3 (or --element-specs with up to 8 elements)"),
    ("tiny", 0, "--model tiny (Wan2.1 I2V) makes a video of reference images: give --elements IMAGE [IMAGE ...] "
                "(1 to 3)"),
    ("tiny-magref", 0, "--model tiny-magref (MAGREF) makes a video of reference images: give --elements"),
    ("tiny-v3", 0, "--model tiny-v3 (SkyReels-V3 R2V) makes a video of reference images: give --elements IMAGE "
                   "[IMAGE ...] (1 to 4)"),
])
def test_too_many_or_no_references_name_the_model_its_most_and_the_fix(tmp_path, capsys, monkeypatch, data_dir,
                                                                         model, images, want):
    """More element images than the model's kind takes (SkyReels-V3 and Phantom-Wan 4 by their code, MAGREF 8, A2's
    three roles), or none on a model that samples from references: one line naming the model, the kind, the most it
    takes and the fix, before any weights load."""
    monkeypatch.setattr(infer.A2Pipeline, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    err = one_line_exit_2(capsys, dict(model=model, device="cpu", resolution=(32, 32), num_frames=17,
                                       elements=(str(data_dir / "000_person.png"),) * images))
    assert want in err, err


def test_no_such_model_names_every_built_in_model(capsys):
    """--model at no dir, no Hub id and no built-in name: the line lists the built-in models (a2/model/tiny.py's
    registry, every one of them)."""
    from a2.model.tiny import TINY_MODELS

    err = one_line_exit_2(capsys, dict(model="tiny_v3", device="cpu", prompt="x"))
    assert err.endswith("or the name of a built-in model: " + ", ".join(TINY_MODELS) + ")"), err
    assert "tiny-vace-fun" in err and "tiny-refalign" in err


def test_a_missing_element_is_still_a_file_not_found_error(tmp_path, data_dir):
    """The one-line error keeps its kind: callers that catch FileNotFoundError still do."""
    with pytest.raises(FileNotFoundError, match="image not found"):
        infer.main(infer.InferConfig.from_flags(model="tiny", device="cpu", elements=(str(tmp_path / "nope.png"),)))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_in_one_line_with_what_is_kept(signum):
    code = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); from a2.cli import exit_on_signal; "
            "exit_on_signal('the videos written so far are kept; the same command renders again'); "
            f"print('ready', flush=True); os.kill(os.getpid(), {int(signum)}); time.sleep(30)")
    p = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signum
    name = signal.Signals(signum).name
    assert p.stderr == f"error: stopped by {name}: the videos written so far are kept; the same command renders again\n"


def test_precompute_says_it_resumes_and_a_signal_keeps_what_was_encoded(tmp_path, capsys):
    """write_cache: a stop mid-way keeps the finished samples (and says so in one line); the rerun names how many
    it keeps and encodes only the rest."""
    from data import write_cache

    class Samples:
        frame_sampling = "uniform"

        def __len__(self):
            return 4

        def __getitem__(self, key):
            return dict(video=None, index=key[0])

    encoded, stop_at = [], [2]

    def encode(batch):
        if len(encoded) == stop_at[0]:
            os.kill(os.getpid(), signal.SIGINT)  # during the third sample's encoding
        encoded.append(batch["index"])
        return dict(x=1)

    import data

    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        collate = data.collate
        data.collate = lambda items: items[0]
        with pytest.raises(SystemExit) as e:
            write_cache(tmp_path, Samples(), encode)
        assert e.value.code == 128 + signal.SIGINT
        err = capsys.readouterr().err  # the progress bar's, then the one line
        line = (f"error: stopped by SIGINT: the samples encoded so far are kept in {tmp_path}; the same command "
                "resumes the precompute\n")
        assert f"\r{line}" in err and err.count("error") == 1  # on its own line (the bar cleared)
        kept = sorted(p.name for p in (tmp_path / "samples").glob("*.pt"))
        assert kept == ["0.pt", "1.pt"]
        encoded.clear()
        stop_at[0] = None
        write_cache(tmp_path, Samples(), encode)
        assert f"precompute: resuming, 2 of 4 samples already encoded in {tmp_path}" in capsys.readouterr().out
        assert encoded == [2, 3]  # the missing samples only
    finally:
        data.collate = collate
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


# ---------------------------------------------------------------- LoRAs that know their base


def lora_of(model: str, out, data_dir, targets=("to_q", "to_k", "to_v", "to_out.0")):
    """A LoRA file on the built-in `model`, exported as train_a2.py exports it, with the metadata a run on it
    records (the kind: what infer.py plans for the demo's elements on it)."""
    from peft import LoraConfig

    from a2.model.tiny import model_path
    from a2.model.transformer import detect_model, load_transformer
    from a2.train.lora import base_metadata, export_lora

    info = detect_model(model_path(model))
    transformer = load_transformer(info.path)
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(targets)))
    cfg = infer.InferConfig.from_flags(model=model, height=32, width=32, num_frames=17, device="cpu")
    kind = infer.read_references(cfg, elements(data_dir, model), info)["layout"].kind
    out.mkdir(parents=True)
    return export_lora(out, transformer, metadata=base_metadata(transformer.config, info.name, kind,
                                                                 model))[0]


def elements(data_dir, model):
    """What each model takes at 32x32: TI2V a prompt alone, MAGREF one image on its canvas, A2 / Phantom three."""
    names = {"tiny-ti2v": (), "tiny-magref": ("person",)}.get(model, ("person", "object", "background"))
    return tuple(str(data_dir / f"000_{n}.png") for n in names)


@pytest.mark.parametrize("trained_on, loaded_into, says", [
    ("tiny-phantom", "tiny", "warning: --lora {lora} was trained on another base (tiny-phantom): model "
                             "'Phantom-Wan', here 'Wan2.1 I2V'; shapes 'layers 2, width 128, ffn 256, in 16, out 16, "
                             "text 32, image None, patch 1x2x2', here 'layers 2, width 128, ffn 256, in 36, out 16, "
                             "text 32, image 32, patch 1x2x2'; kind 'phantom', here 'prefix'"),
    ("tiny-magref", "tiny", "warning: --lora {lora} was trained on another base (tiny-magref): "),
    ("tiny", "tiny-magref", "warning: --lora {lora} was trained on another base (tiny): "),
    ("tiny-ti2v", "tiny", "warning: --lora {lora} was trained on another base (tiny-ti2v): "),
    ("tiny-ti2v", "tiny", "error: --lora {lora}: 1 of 17 LoRA pairs do not fit the transformer (proj_out: out "
                          "features 192, the model's 64): trained on another base; --force loads the pairs that fit"),
])
def test_a_lora_on_another_base_is_named_in_one_line(tmp_path, capsys, data_dir, trained_on, loaded_into, says):
    """A2 (tiny), Phantom-Wan (tiny-phantom), MAGREF (tiny-magref), TI2V-5B (tiny-ti2v): a LoRA loaded into a model
    other than its base is named in one line (warning: it loads; a LoRA whose pairs do not fit: refused, exit 2,
    --force loads what fits); on its own base it says nothing; the load line counts the file's pairs."""
    targets = ("to_q", "to_k", "to_v", "to_out.0") + (("proj_out",) if says.startswith("error") else ())
    lora = lora_of(trained_on, tmp_path / trained_on, data_dir, targets)  # proj_out: 48 channels out on TI2V
    cfg = dict(model=loaded_into, lora=(str(lora),), height=32, width=32, num_frames=17, steps=1, decode="none",
               device="cpu", elements=elements(data_dir, loaded_into), out=str(tmp_path / "o.mp4"))
    if says.startswith("error"):
        assert one_line_exit_2(capsys, cfg).startswith(says.format(lora=lora))
        assert infer.main(infer.InferConfig.from_flags(**cfg, force=True)) == 0
        assert "34 lora_A/lora_B weights, 16 modules of transformer adapted (32 weights matched), 1 pairs skipped" in \
            capsys.readouterr().out
        return
    assert infer.main(infer.InferConfig.from_flags(**cfg)) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning: --lora")]
    assert len(warnings) == 1 and warnings[0].startswith(says.format(lora=lora)), out
    assert "32 lora_A/lora_B weights, 16 modules of transformer adapted (32 weights matched)" in out
    own = dict(cfg, model=trained_on, elements=elements(data_dir, trained_on))
    assert infer.main(infer.InferConfig.from_flags(**own)) == 0
    assert "warning" not in capsys.readouterr().out


# ---------------------------------------------------------------- data.py validate: .npz rows and captions


def test_validate_reports_every_bad_npz_row_from_its_header_and_a_utf16_caption(tmp_path, capsys, monkeypatch):
    """The T2V workflow's planted faults (wrong key, float frames in [0, 1], channels-first, 3 frames, a missing
    file) are each reported before step 1, read from the .npy header alone (no frame array is loaded); a UTF-16
    caption is read right and reported as a warning."""
    import codecs
    import json

    import numpy as np

    import a2.data.media
    import data

    frames = (np.random.default_rng(0).random((17, 32, 32, 3)) * 255).astype(np.uint8)
    arrays = dict(good=dict(frames=frames), key=dict(video=frames), float=dict(frames=frames / 255.0),
                  first=dict(frames=frames.transpose(0, 3, 1, 2)), three=dict(frames=frames[:3]))
    for name, arr in arrays.items():
        np.savez(tmp_path / f"{name}.npz", **arr)
    rows = [dict(path=f"{n}.npz", prompt="a clip") for n in [*arrays, "missing"]]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(a2.data.media, "read_npz", lambda p: pytest.fail(f"{p}: frames read, not the header"))
    with pytest.raises(SystemExit) as e:
        data._cli(["validate", "--model", "tiny-t2v", "--dataset-type", "t2v", "--manifest",
                   str(tmp_path / "train.jsonl"), "--resolution", "32", "32", "--num-frames", "17"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for what in ("key.npz (train.jsonl line 2): unreadable video (ValueError: no 'frames' array (it has ['video']))",
                 "float.npz (train.jsonl line 3): unreadable video (ValueError: frames are float64; store uint8",
                 "first.npz (train.jsonl line 4): unreadable video (ValueError: frames are (F, 3, H, W)",
                 "three.npz (train.jsonl line 5): 3 frames, shorter than the smallest bucket (17)",
                 "missing.npz (train.jsonl line 6): video file not found"):
        assert what in err, what
    assert "error: 5 problem(s)" in err and "good.npz" not in err

    videos = data.make_synthetic_dataset(tmp_path / "e2v", num_samples=1, num_frames=17, size=(32, 32))
    caption = videos / "000.txt"
    caption.write_bytes(codecs.BOM_UTF16_LE + caption.read_text().encode("utf-16-le"))
    data._cli(["validate", "--data-root", str(videos), "--resolution", "32", "32", "--num-frames", "17"])
    out = capsys.readouterr()
    assert "000.txt: caption is UTF-16 (read as such)" in out.out + out.err


# ---------------------------------------------------------------- what the mutation audit found untested


@pytest.mark.parametrize("shape, size, keep", [((8, 12), (8, 8), (slice(0, 8), slice(2, 10))),
                                               ((12, 8), (8, 8), (slice(2, 10), slice(0, 8))),
                                               ((8, 13), (8, 8), (slice(0, 8), slice(2, 10)))])
def test_training_frames_centre_crop_takes_the_middle_pixels(shape, size, keep):
    """center_crop keeps the middle columns (rows) exactly: at the target's own scale the frame is the input's
    centre, pixel for pixel (a crop shifted by one pixel is another frame)."""
    import numpy as np

    from a2.images import resize_frames

    h, w = shape
    yy, xx = np.mgrid[0:h, 0:w]
    frame = np.stack([xx * 20, yy * 20, (xx + yy) * 7], -1).astype(np.uint8)[None]  # (1, H, W, 3): each pixel unique
    got = resize_frames(frame, "center_crop", size)  # (3, 1, 8, 8) in [-1, 1]
    want = torch.from_numpy(frame[0][keep]).permute(2, 0, 1).float() * (2 / 255) - 1
    assert torch.allclose(got[:, 0], want, atol=1e-6)


def test_resume_on_a_changed_dataset_says_so_and_finds_dropped_samples_by_path():
    """A checkpoint records its dataset (a hash of the samples' paths) and its dropped samples by path: resumed on
    the same data the dropped sample is named; on changed data (a clip added before the dropped one, or the dropped
    one gone) one line says the dataset changed, and the dropped sample is dropped again where it now is, or named
    as gone. tests/test_resume_data.py runs these through train_a2.main."""
    from a2.data.loader import LoadFailures

    before = LoadFailures(True, ["a.mp4 (a)", "b.mp4 (b)", "c.mp4 (c)"])
    before.dropped = {1: "b: b.mp4: unreadable video"}
    before.skipped_steps = 1
    state = before.state_dict()
    same = LoadFailures(True, ["a.mp4 (a)", "b.mp4 (b)", "c.mp4 (c)"])
    assert same.load_state_dict(state) == ["1 sample(s) dropped before the checkpoint stay dropped: b.mp4 (b)"]
    assert same.dropped == before.dropped and same.skipped_steps == 1
    grown = LoadFailures(True, ["0.mp4 (0)", "a.mp4 (a)", "b.mp4 (b)", "c.mp4 (c)"])
    lines = grown.load_state_dict(state)
    assert grown.dropped == {2: "b: b.mp4: unreadable video"}  # b where it is now, not position 1 (a)
    assert lines == ["the dataset changed since the checkpoint (3 samples then, 4 now): the data order from here, and "
                     "an --eval-split's draw of held-out clips, are not the uninterrupted run's",
                     "1 sample(s) dropped before the checkpoint stay dropped: b.mp4 (b)"]
    shrunk = LoadFailures(True, ["a.mp4 (a)", "c.mp4 (c)"])
    assert shrunk.load_state_dict(state)[1] == "dropped before the checkpoint, no longer in the dataset: b.mp4 (b)"
    assert shrunk.dropped == {}
    old = LoadFailures(True, ["x.mp4 (x)", "y.mp4 (y)"])  # a checkpoint of an older a2: by position, as it was, said
    assert old.load_state_dict(dict(dropped={"1": "y"}, skipped_steps=0)) == [
        "the checkpoint does not record its samples' paths: its 1 dropped sample(s) are taken by position, now "
        "y.mp4 (y)"] and old.dropped == {1: "y"}


def test_visualisation_of_every_dataset_runs_end_to_end(tmp_path, data_dir):
    """A JSON dataset config whose second dataset asks for visualisations (latents saved, frames decoded to PNG):
    a 2-step run writes them where and when that block says (not only the first dataset's block is read)."""
    import json

    from tests.conftest import args, train

    block = dict(enabled=True, output_dir="viz/{run_id}", frequency=2,
                 processors=[dict(type="latent_save", data=["input_latents"]),
                             dict(type="vae_decode", data=["predicted_latents"], frames=[0, -1])])
    (tmp_path / "train.json").write_text(json.dumps({"datasets": [
        dict(data_root=str(data_dir), dataset_type="t2v", target_resolution=[32, 32]),
        dict(data_root=str(data_dir), dataset_type="t2v", target_resolution=[32, 32], visualization=block)]}))
    flags = [f for f in args(data_dir, tmp_path, "viz", "--max-steps", "2", "--num-frames", "17", model="tiny-t2v")
             if f not in ("--data-root", str(data_dir))]
    train(*flags, "--dataset-config", str(tmp_path / "train.json"))
    out = tmp_path / "viz" / "viz" / "viz"
    assert sorted(p.name for p in out.iterdir()) == ["step0000002_input_latents.pt",
                                                     "step0000002_predicted_latents_f-1.png",
                                                     "step0000002_predicted_latents_f0.png"]
    from PIL import Image

    assert Image.open(out / "step0000002_predicted_latents_f0.png").size == (32, 32)


def test_a_short_clip_is_named_in_the_users_terms_and_a_warning_is_no_problem(data_dir, tmp_path, capsys):
    """--num-frames 33 with A2's three references: a 17-frame clip is refused naming the clip's frames, the frames
    a clip needs, and why (the references take 12 of the 33). An element image of no clip is a warning (the samples
    are kept): said after the problems, not counted among them."""
    import shutil

    import data

    d = tmp_path / "d"
    shutil.copytree(data_dir, d)
    shutil.copy(d / "000_person.png", d / "zzz_person.png")
    with pytest.raises(SystemExit):
        data._cli(["validate", "--data-root", str(d), "--resolution", "32", "32", "--num-frames", "33"])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "error: 4 problem(s) in the dataset, and 1 warning(s):" and len(lines) == 7, lines
    assert lines[1] == (f"  000: {d / '000.mp4'}: 17 frames, shorter than the smallest bucket (21): --num-frames 33 "
                        "less the 12 frames the references take")
    assert lines[5] == f"  warning: -: {d / 'zzz_person.png'}: no video 'zzz' for this element image"


def test_export_elements_of_no_index_is_one_line_exit_2(tmp_path, capsys):
    import data

    (tmp_path / "notes.txt").write_text("not an index\n")
    for manifest, says in ((tmp_path / "none.jsonl", "no such index"), (tmp_path / "notes.txt", "not an index")):
        with pytest.raises(SystemExit) as e:
            data._cli(["export-elements", "--manifest", str(manifest), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_every_built_in_model_is_listed_and_the_size_banner_is_true(capsys, monkeypatch):
    """--model's help (infer.py and train_a2.py, as --help prints it) names every built-in model and no other; the
    built-in model's banner says what it renders and why."""
    import re

    import tyro

    from a2.model.tiny import TINY_MODELS
    from config import InferConfig, TrainConfig
    from tests.test_cli import help_text, option_help

    for cls in (InferConfig, TrainConfig):
        said = option_help(help_text(capsys, monkeypatch, lambda a, cls=cls: tyro.cli(cls, args=a), []), "--model")
        names = set(re.findall(r"\b(?:tiny|random)(?:-[A-Za-z0-9.]*[A-Za-z0-9])+|\btiny\b", said))
        assert names == set(TINY_MODELS), (cls.__name__, names ^ set(TINY_MODELS))
    cfg, source = infer.resolve(infer.InferConfig.from_flags(model="tiny-t2v"))
    assert infer.size_banner(cfg, cfg.sampling.steps, source).startswith(
        "--model tiny-t2v: a built-in model, sampled at 64x64 (tiny model's default), 33 frames (tiny model's "
        "default), 10 steps (tiny model's default)")


@pytest.mark.parametrize("model, preset, latents, said", [
    ("tiny-v3", "v3-cfg", (105 - 1) // 4 + 1, "105 frames (--preset v3-cfg), 50 steps (--preset v3-cfg)"),
    ("tiny-vace", "diffusers", (33 - 1) // 4 + 1 + 1,
     "33 frames (tiny model's default), 50 steps (--preset diffusers)"),
])
def test_the_preset_banner_says_what_is_rendered(data_dir, tmp_path, capsys, monkeypatch, model, preset, latents,
                                                 said):
    """--preset on a built-in tiny model: the banner names the frames and steps the preset sets (SkyReels-V3's class
    defaults: 97 + 8 frames, 50 steps; diffusers' VACE sets no frames: the tiny model's), and those are the ones
    rendered (the latents' frames: VACE's reference latent on top of the video's; the steps the pipeline samples). A
    preset without frames was a traceback."""
    asked, generate = [], infer.generate

    def recorded(*a, **k):
        out = generate(*a, **k)
        asked.append(out["sampling"].steps)
        return out

    monkeypatch.setattr(infer, "generate", recorded)
    out = tmp_path / "v3.pt"
    assert infer.main(infer.InferConfig.from_flags(model=model, preset=preset, resolution=(32, 32), decode="none",
                                                   elements=elements(data_dir, model)[:1], save_latents=str(out))) == 0
    printed = capsys.readouterr().out
    assert f"--model {model}: a built-in model, sampled at 32x32, {said};" in printed, printed
    assert asked == [50] and torch.load(out)["latents"].shape[2] == latents


def test_eval_split_names_its_clips_and_each_eval_shows_progress_and_time(data_dir, tmp_path, capsys):
    """--eval-split: the run names the held-out clips; each eval says it starts and how long it took."""
    import re

    from tests.conftest import args, train

    train(*args(data_dir, tmp_path, "held", "--max-steps", "1", "--eval-split", "1", "--eval-every", "1",
                "--num-frames", "17"))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("held out for the eval loss"))
    assert re.fullmatch(rf"held out for the eval loss \(never trained on\): 1 sample\(s\) of 1 clip\(s\): "
                        rf"{re.escape(str(data_dir))}/00[0-3]\.mp4", line), line
    assert "step 1: eval loss of 1 held-out sample(s) ..." in out
    assert re.search(r"step 1: eval loss \d+\.\d{4} \(\d+\.\d s\)", out), out


@pytest.mark.parametrize("model, frames, refs", [("tiny", 5, 12), ("tiny-magref", 13, 4)])
def test_infer_says_how_long_the_video_is_and_why(tmp_path, capsys, data_dir, model, frames, refs):
    """--num-frames is the whole sequence, references first: the plan and the written video say the same number of
    video frames and what the references took (A2: 3 reference latents, 12 frames; MAGREF: its canvas's latent
    frame, decoded to 4 frames and dropped as MAGREF's sampler drops them)."""
    els = elements(data_dir, model)
    assert infer.main(infer.InferConfig.from_flags(model=model, elements=els, height=32, width=32, num_frames=17,
                                                   steps=1, device="cpu", out=str(tmp_path / "v.mp4"))) == 0
    out = capsys.readouterr().out
    assert f"video: {frames} frames: --num-frames 17 is the whole sequence, of which the references take {refs}" in out
    assert (f"wrote {tmp_path / 'v.mp4'} ({frames} frames, 32x32; --num-frames 17 less the {refs} the references "
            "take)") in out


def test_a_stand_in_export_records_its_base_and_still_loads(tmp_path):
    """Stand-In's .ckpt carries the base metadata beside its "state_dict" (their loader reads that key alone); a2
    reads both back."""
    from a2.kinds import standin
    from a2.train.lora import base_metadata, read_base_metadata
    from tests.test_standin import tiny_t2v

    model = tiny_t2v()
    meta = base_metadata(model.config, "Wan2.1 T2V", "standin", "tiny-t2v")
    path = standin.export_lora(tmp_path, model, metadata=meta)
    assert read_base_metadata(path) == meta
    assert set(torch.load(path, weights_only=True)) == {"state_dict", "a2_metadata"}
    other = tiny_t2v(seed=1)
    standin.load_lora(other, path)
    assert all(torch.equal(a, b) for a, b in zip(standin.lora_state_dict(model).values(),
                                                 standin.lora_state_dict(other).values()))


def test_bench_loader_input_mistake_is_one_line_exit_2(tmp_path, capsys):
    """bench.py --data-root on a dir that is not there: one line naming the flag, as training says it (bench reads
    its data flags as training does), exit 2 (as bench.py's __main__ runs it)."""
    import bench

    with pytest.raises(SystemExit) as e:
        run_cli(bench.bench_loader, bench.BenchConfig(data_root=str(tmp_path / "none")))
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: --data-root: data_root {tmp_path / 'none'} is not a directory\n"


def test_a_clip_magrefs_canvas_cannot_hold_is_named_by_validate_and_never_trained(tmp_path, media, capsys):
    """An OpenS2V-5M-shaped index (public_index.synthetic_opens2v's part, on tests/media's hiker clip) read by MAGREF at
    64x64: a clip's 168x112 background is 22x14 px in its 22x64 block of a 3-reference canvas, under a token (16 px).
    The sizes the scan reads are the images the loader makes; `data.py validate` names the clip (left out) and
    training leaves it out before step 1 (it stopped the run at the step that drew it); the clip without the
    background (2 references, 32x64 blocks) trains."""
    import a2.data.public_index as pi
    import a2.data.public_read as pr
    import data
    from a2.data import public_index as pf
    from a2.data.media import read_frames
    from tests.conftest import train

    f = read_frames(media / "hiker_tiny.mp4", list(range(20)))
    frames = np.stack([np.asarray(Image.fromarray(x).resize((184, 120))) for x in f])
    person = np.zeros((60, 30, 3), np.uint8)
    person[..., 0], person[10:50, 5:25, 2] = 200, 180
    pf.synthetic_opens2v(tmp_path, frames, person, num_clips=2)
    pi.index_opens2v(pi.IndexOpenS2V(str(tmp_path), str(tmp_path / "index")))
    index = tmp_path / "index" / "index.jsonl"
    lines = [json.loads(x) for x in index.read_text().splitlines()]
    del lines[1]["elements"]["background"]
    index.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = replace(train_a2.run_datasets(Validate(data=DataConfig(dataset_type="opens2v", manifest=str(index))))[0],
                  elements=index_elements("magref"))
    for s in pr.list_index(index, cfg, 0, [], most=8):
        pr.check_public_sample(s, cfg, 9, "uniform")
        _, images = pr.load_sample(s, [], list(s.refs))
        assert s.sizes == {name: image.size for name, image in images.items()}
    flags = ["--dataset-type", "opens2v", "--manifest", str(index), "--model", "tiny-magref", "--resolution", "64",
             "64", "--num-frames", "9"]
    data._cli(["validate", *flags])
    out = capsys.readouterr().out
    background = tmp_path / "Background" / "total_part1" / f"{lines[0]['key']}.png"
    assert (f"left out: {lines[0]['key']}: {lines[0]['video']} (index.jsonl line 1): {background}: a 168x112 "
            "reference is 22x14 px in its 22x64 block of MAGREF's 64x64 canvas (3 references), under 16 px") in out
    assert "bucket 8 frames 64x64 [ref0, ref1]: 1 samples" in out and out.count("left out:") == 1
    train(*flags, "--num-workers", "0", "--output-dir", str(tmp_path / "runs"), "--run-name", "magref",
          "--max-steps", "2", "--log-every", "1")
    out = capsys.readouterr().out
    logged = [json.loads(x) for x in (tmp_path / "runs" / "magref" / "metrics.jsonl").read_text().splitlines()]
    assert out.count("left out:") == 1 and [r["step"] for r in logged if "loss" in r] == [1, 2], out


def test_the_run_header_counts_the_references_the_data_holds(data_dir, tmp_path, capsys):
    """Phantom-Wan plans for its most references (4); the data's clips hold 3: the header's sequence says 3, the
    latents the step trains with (not the plan's maximum)."""
    from tests.conftest import args, train

    train(*args(data_dir, tmp_path, "phantom", "--max-steps", "1", "--num-frames", "17", model="tiny-phantom"))
    header = next(x for x in capsys.readouterr().out.splitlines() if "| sequence: " in x)
    assert "sequence: (then 3 reference latents, posterior means, Phantom-Wan's layout) a 17-frame clip" in header


@pytest.mark.parametrize("config, want", [
    ({"datasets": [{"data_root": "d", "target_resolutoin": [32, 32]}]},
     "datasets[0]: unknown key(s) ['target_resolutoin']; did you mean 'target_resolution' for 'target_resolutoin'?"),
    ({"dataset": []}, "unknown key(s) ['dataset']; did you mean 'datasets' for 'dataset'?"),
    ({"datasets": [{"data_root": "d", "elements": [{"name": "subject", "sufixes": ["_p.png"]}]}]},
     "elements[0]: unknown key(s) ['sufixes']; did you mean 'suffixes' for 'sufixes'?"),
])
def test_an_unknown_dataset_key_says_the_close_one(tmp_path, capsys, config, want):
    """A misspelt key of a dataset JSON: one line naming it and the key it is close to (difflib), exit 2."""
    import data

    (tmp_path / "d").mkdir()
    (tmp_path / "c.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        data._cli(["validate", "--dataset-config", str(tmp_path / "c.json"), "--num-frames", "17"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and want in err, err


def test_validate_prints_its_summary_also_when_it_finds_a_problem(data_dir, tmp_path, capsys):
    """docs/dataset.md: validate lists every problem, then the samples per element and per bucket. With an unreadable
    clip the summary of the others is printed too (it was not), and the problem is said once."""
    import shutil

    import data

    d = tmp_path / "d"
    shutil.copytree(data_dir, d)
    (d / "001.mp4").write_bytes(b"garbage")
    with pytest.raises(SystemExit) as e:
        data._cli(["validate", "--data-root", str(d), "--resolution", "32", "32", "--num-frames", "17"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and "001.mp4: unreadable video" in err and "001.mp4" not in out
    assert out.splitlines()[0] == "dataset: 3 samples from 1 dataset(s) besides the 1 with a problem (below)", out
    assert "  bucket 5 frames 32x32 [subject, object, background]: 3 samples" in out


@pytest.mark.parametrize("flags, refused", [(["--resolution", "64", "64"], True), (["--resolution", "32", "32"], False),
                                            ([], False)])
def test_a_typed_resolution_beside_a_dataset_config_of_another_size_is_refused(data_dir, tmp_path, capsys, flags,
                                                                                refused):
    """--dataset-config trains at its datasets' target_resolution: a --resolution typed beside it that differs is
    refused in one line naming both (it trained at the file's size, silently); the same size, or none typed (the
    recipe's), is no conflict."""
    import data

    (tmp_path / "c.json").write_text(json.dumps({"datasets": [
        {"data_root": str(data_dir), "target_resolution": [32, 32], "elements": [
            {"name": "subject", "suffixes": ["_person.png"]}]}]}))
    argv = ["validate", "--dataset-config", str(tmp_path / "c.json"), "--num-frames", "17", *flags]
    if not refused:
        data._cli(argv)
        assert "bucket 13 frames 32x32 [subject]: 4 samples" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit) as e:
        data._cli(argv)
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"error: --resolution 64 64: {tmp_path / 'c.json'}: datasets[0] trains at target_resolution [32, 32]; set "
        "the size in the file, or drop the flag\n")
    from tests.conftest import train  # train_a2.py: the same rule, before anything loads

    with pytest.raises(ValueError, match=r"^--resolution 64 64: .*c\.json: datasets\[0\] trains at target_resolution"):
        train("--model", "tiny", "--dataset-config", str(tmp_path / "c.json"), "--num-frames", "17", *flags,
              "--output-dir", str(tmp_path / "runs"))


def test_infer_help_names_vaces_defaults_and_what_its_frames_count(capsys, monkeypatch):
    """infer.py --help, as printed: --seed, --flow-shift and --fps name Wan VACE's own (vace_wan_inference.py
    --base_seed 2025, Wan2.1 generate.py --sample_shift 16, shared_config.py 16 fps), and the values A2Pipeline fills
    for a VACE model are those; --num-frames says VACE's references come on top; --mask takes a .npz."""
    import re

    import tyro

    from a2.kinds.kinds import kind_sampling
    from config import InferConfig
    from tests.test_cli import help_text, option_help

    said = help_text(capsys, monkeypatch, lambda a: tyro.cli(InferConfig, args=a), [])
    flat = {flag: re.sub(r"\s+", " ", option_help(said, flag)) for flag in ("--seed", "--flow-shift", "--fps",
                                                                          "--num-frames", "--mask")}
    assert "Wan VACE 2025" in flat["--seed"] and "Wan VACE 16" in flat["--flow-shift"], flat
    assert "Wan VACE 16" in flat["--fps"] and "Wan VACE's reference frames come on top" in flat["--num-frames"], flat
    assert ".npz" in flat["--mask"], flat
    own = kind_sampling("vace", "Wan2.1 VACE")
    assert (own.seed, own.flow_shift, own.fps) == (2025, 16.0, 16)


# ---------------------------------------------------------------- a newcomer's walk: each mistake one line, exit 2


@pytest.mark.parametrize("mistake, want", [
    ("elements dir", "{data}: element 'subject' is a dir, not an image: give image files (e.g. {data}/000_background"
                     ".png)"),
    ("out not a video", "--out {tmp}/out.txt: writes an H.264 video: name it .mp4 / .mkv / .mov (e.g. {tmp}/out.mp4)"),
    ("compare not latents", "--compare {tmp}/notes.txt: not a --save-latents file (UnpicklingError): give the file an "
                            "earlier `infer.py --save-latents FILE` wrote"),
    ("compare other torch file", "--compare {tmp}/other.pt: a torch file without the latents a --save-latents file "
                                 "holds: give the file an earlier `infer.py --save-latents FILE` wrote"),
    ("frames", "--num-frames 18: num_frames must be 4k+1 (e.g. 17, 49, 81), got 18; the nearest: 17 or 21"),
    ("size", "--resolution 30 30: height and width must be positive multiples of 16, got 30x30"),
])
def test_infer_newcomer_mistakes_are_one_line_before_any_weights_load(tmp_path, capsys, monkeypatch, data_dir,
                                                                      mistake, want):
    """What a first hour of infer.py meets: a dir given as an element image, an --out that is no video file (it was
    pyav's traceback after rendering), a --compare file that is not a --save-latents file (a KeyError after
    rendering), frames and a size the VAE cannot take (the line names the flag): one line, before any weights load."""
    monkeypatch.setattr(infer.A2Pipeline, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    (tmp_path / "notes.txt").write_text("my notes\n")
    torch.save({"step": 1}, tmp_path / "other.pt")
    cfg = {"elements dir": dict(elements=(str(data_dir),)), "out not a video": dict(out=str(tmp_path / "out.txt")),
           "compare not latents": dict(compare=str(tmp_path / "notes.txt")),
           "compare other torch file": dict(compare=str(tmp_path / "other.pt")), "frames": dict(num_frames=18),
           "size": dict(resolution=(30, 30))}[mistake]
    err = one_line_exit_2(capsys, {**dict(model="tiny", device="cpu", elements=elements(data_dir, "tiny"),
                                          resolution=(32, 32), num_frames=17), **cfg})
    assert err == "error: " + want.format(data=data_dir, tmp=tmp_path), err


@pytest.mark.parametrize("argv, want", [
    (["--resolution", "32"], "--resolution 32: expected INT INT"),
    (["--lr", "abc"], "--lr abc: expected FLOAT"),
    (["--micro-batch", "1.5"], "--micro-batch 1.5: expected a whole number"),
])
def test_a_bad_flag_value_says_what_the_flag_takes(capsys, argv, want):
    """A value of the wrong type: the flag, the value and what it takes, not tyro's type algebra ({None}|{INT INT})
    or Python's int() message."""
    from a2.cli import parse_cli
    from config import TrainConfig

    with pytest.raises(SystemExit) as e:
        parse_cli(TrainConfig, args=["--model", "tiny", *argv])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {want}\n"


def test_resume_at_a_dir_that_is_no_checkpoint_says_what_to_give(data_dir, tmp_path):
    """--resume at a dir that holds no run, and at a run dir instead of one of its checkpoints: one line saying what
    --resume takes (it said "incomplete: its writer was stopped", of a dir no writer wrote)."""
    from a2.train.runs import ResumeError
    from tests.conftest import args, train

    flags = args(data_dir, tmp_path, "r", "--max-steps", "1", "--num-frames", "17")
    (tmp_path / "notes").mkdir()
    with pytest.raises(ResumeError, match=r"^--resume \S+notes: not a checkpoint \(no manifest\.json\): give a run's "
                                          r"ckpt-<step> dir, or --resume auto with the run's --run-name$"):
        train(*flags, "--resume", str(tmp_path / "notes"))
    train(*flags, "--ckpt-every", "1")
    with pytest.raises(ResumeError, match=r"^--resume \S+/r: not a checkpoint \(no manifest\.json\): a run dir; give "
                                          r"one of its checkpoints \(ckpt-0000001\), or --resume auto with "
                                          r"--output-dir \S+ --run-name r$"):
        train(*flags, "--resume", str(tmp_path / "r"))


@pytest.mark.parametrize("argv, want", [
    (["valdate", "--data-root", "d"], "unknown command 'valdate' (did you mean validate?); the commands: make-sample, "
                                      "validate, index, export-elements"),
    (["make-sample", "--out", "d"], "--out: OUT is given without a flag name here (a positional argument): drop --out"),
    (["validate", "--data-root", "{data}", "--model", "tiny_v3", "--num-frames", "17"],
     "tiny_v3: not a directory (expected a diffusers-format Wan model dir, a Phantom-Wan checkpoint, a Hugging Face "
     "Hub id (org/name), or the name of a built-in model: tiny, "),
])
def test_data_newcomer_mistakes_are_one_line(data_dir, capsys, argv, want):
    """data.py: a misspelt command says the close one; a positional argument given as a --flag says to drop the flag
    name (tyro said "Missing value for argument 'out'" of a value that was there); a --model that is no dir, no Hub
    id and no built-in name is refused (validate went on with the elements' rule, as for a Hub id)."""
    import data

    with pytest.raises(SystemExit) as e:
        data._cli([a.format(data=data_dir) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {want}"), err


def test_a_hub_id_that_cannot_be_downloaded_reads_as_a_sentence(monkeypatch):
    """--model org/name that is no local dir and cannot be fetched: one line that says so in a sentence (it read
    "...as a Hugging Face Hub model it is could not be downloaded...")."""
    import huggingface_hub

    from a2.model.transformer import UnsupportedModel, hub_snapshot

    def refuse(repo, **kw):
        raise ConnectionError("Name or service not known")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(UnsupportedModel) as e:
        hub_snapshot("org/nosuchmodel")
    assert str(e.value) == ("org/nosuchmodel: no such local dir, and the Hugging Face Hub model could not be "
                            "downloaded (ConnectionError: Name or service not known); check the id and the network "
                            "(gated repos need `hf auth login`), or pass a local model dir")


def test_an_index_clip_is_checked_against_the_frames_its_video_holds(tmp_path, media):
    """An OpenS2V-5M-shaped index whose clip range (num_frames, from face_cut) runs past its video's end (a cut or
    replaced file): the clip is checked against the frames the file holds from its start, not the index's count, so
    a bucket longer than the file is refused before step 1 naming both (it passed, and failed at load), and a bucket
    the file fills trains on its own frames."""
    import a2.data.public_read as pr
    import train_a2
    from a2.data.media import read_frames
    from a2.data.public_index import index_opens2v, synthetic_opens2v
    from config import DataConfig, IndexOpenS2V

    f = read_frames(media / "hiker_tiny.mp4", list(range(20)))
    frames = np.stack([np.asarray(Image.fromarray(x).resize((64, 48))) for x in f])
    synthetic_opens2v(tmp_path, frames, np.full((20, 10, 3), 200, np.uint8), num_clips=1)
    index_opens2v(IndexOpenS2V(str(tmp_path), str(tmp_path / "index")))
    index = tmp_path / "index" / "index.jsonl"
    line = json.loads(index.read_text().splitlines()[0])
    own = 20 - int(line.get("start") or 0)  # the frames the video holds from the clip's start
    index.write_text(json.dumps({**line, "num_frames": 40}) + "\n")
    cfg = train_a2.run_datasets(Validate(data=DataConfig(dataset_type="opens2v", manifest=str(index))))[0]
    short, fits = (next(s for s in pr.list_index(index, cfg, 0, [])) for _ in range(2))
    pr.check_public_sample(short, cfg, own + 3, "uniform")
    assert [p.what for p in short.problems] == [
        f"{own} frames (from frame {line.get('start') or 0}; its index lists 40, past the video's end), shorter than "
        f"the smallest bucket ({own + 3})"]
    pr.check_public_sample(fits, cfg, 9, "uniform")
    assert fits.problems == [] and fits.num_frames == own
