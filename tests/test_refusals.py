"""Every member of each flag combination infer.py refuses, and every side of each size rule: a refusal is one line
(an InputError, exit 2 under run_cli) that names what the user gave, said before any weights load. Sizes are
non-square with the height and the width each the wrong one in turn, so a rule that checks one side twice shows."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import drawn_person

COMBINED = ("--save-latents", "--compare", "--decode none", "--control-video", "--mask")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("refusals")
    drawn_person((40, 28)).save(d / "me.png")
    (d / "prompts.txt").write_text("a man\n")
    (d / "eval.jsonl").write_text('{"prompt": "a man"}\n')
    (d / "lora").mkdir()  # a run dir given as --lora: only its file's keys are read before the refusals
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32)},
              d / "lora" / "pytorch_lora_weights.safetensors")
    torch.save({"latents": torch.zeros(1, 16, 1, 2, 2)}, d / "saved.pt")  # a --save-latents file's shape of keys
    return d


def refused(monkeypatch, argv, match, capsys=None):
    """infer.py on argv refuses it in one line matching `match`: from main (an InputError), or (capsys given) from
    the parse, as its __main__ says a config error: `error: <line>` on stderr, exit 2."""
    import infer
    from a2.cli import InputError, parse_cli
    from config import InferConfig

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(infer, "load_transformer", no_weights)
    argv = [*argv, "--device", "cpu"]
    if capsys is not None:
        with pytest.raises(SystemExit) as e:
            parse_cli(InferConfig, args=argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and re.fullmatch(f"error: {match}\n", err), err
        return
    with pytest.raises(InputError, match=match) as e:
        infer.main(parse_cli(InferConfig, args=argv))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("many", ["--prompts-file", "--eval-set"])
@pytest.mark.parametrize("flag", COMBINED)
def test_many_videos_take_no_single_video_flag(many, flag, files, tmp_path, monkeypatch):
    value = {"--save-latents": [str(tmp_path / "x.pt")], "--compare": [str(files / "saved.pt")],
             "--decode none": [], "--control-video": [str(files / "me.png")], "--mask": [str(files / "me.png")]}
    rows = str(files / ("prompts.txt" if many == "--prompts-file" else "eval.jsonl"))
    refused(monkeypatch, ["--model", "tiny", "--resolution", "32", "48", many, rows, "--lora",
                          str(files / "lora"), "--out-dir", str(tmp_path / "out"), *flag.split(),
                          *value[flag]],
            "--prompts-file / --eval-set write videos from their rows' elements: they take no --save-latents / "
            "--compare / --decode none / --control-video / --mask")


@pytest.mark.parametrize("many", ["--prompts-file", "--eval-set"])
def test_a_first_frame_renders_one_video(many, files, tmp_path, monkeypatch):
    rows = str(files / ("prompts.txt" if many == "--prompts-file" else "eval.jsonl"))
    refused(monkeypatch, ["--model", "tiny-ti2v", "--resolution", "32", "64", "--image", str(files / "me.png"), many,
                          rows, "--out-dir", str(tmp_path / "out")],
            "--image renders one video; it takes no --prompts-file / --eval-set")


@pytest.mark.parametrize("flag", ["--lora-high", "--lora-low"])
def test_expert_loras_need_an_expert_pair(flag, files, monkeypatch):
    refused(monkeypatch, ["--model", "tiny", "--resolution", "32", "48", flag, str(files / "lora")],
            r"\(Wan2.1 I2V\) has one transformer: --lora-high/--lora-low are for Wan 2.2 A14B; use --lora")


def test_a_pair_takes_expert_loras(files, monkeypatch):
    refused(monkeypatch, ["--model", "tiny-wan22-t2v", "--resolution", "32", "48", "--lora",
                          str(files / "lora")],
            "expert pair: give --lora-high and/or --lora-low, not --lora")


def test_prompts_file_and_eval_set_not_both(files, tmp_path, monkeypatch):
    refused(monkeypatch, ["--model", "tiny", "--resolution", "32", "48", "--prompts-file", str(files / "prompts.txt"),
                          "--eval-set", str(files / "eval.jsonl"), "--lora", str(files / "lora"),
                          "--out-dir", str(tmp_path / "out")],
            "give --prompts-file .videos. or --eval-set .videos and metrics., not both")


@pytest.mark.parametrize("model,multiple,size", [
    ("tiny", 16, (32, 40)), ("tiny", 16, (40, 32)), ("tiny", 16, (24, 48)), ("tiny", 16, (48, 24)),
    ("tiny-ti2v", 32, (32, 48)), ("tiny-ti2v", 32, (48, 32)),  # TI2V-5B: 16x VAE x patch 2
])
def test_sizes_refused_on_either_side(model, multiple, size, files, monkeypatch, capsys):
    """The height and the width each checked against the model's multiple (the other side valid, and non-square):
    Wan 2.1's 16 when the flags are parsed, TI2V-5B's 32 once main has read the model dir."""
    argv = ["--model", model, "--height", str(size[0]), "--width", str(size[1]), "--elements", str(files / "me.png")]
    said = f"height and width must be positive multiples of {multiple}, got {size[0]}x{size[1]}"
    if model != "tiny-ti2v":  # refused as the flags are parsed, naming them
        said = f"--height {size[0]} --width {size[1]}: {said}"
    refused(monkeypatch, argv[:-2] if model == "tiny-ti2v" else argv, said, None if model == "tiny-ti2v" else capsys)
