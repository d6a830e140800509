"""a2/eval/opens2v.py on OpenS2V-Eval v1.1's own material (tests/media/opens2v_eval/, Apache-2.0): motion_fb of the two
demo videos to the digits their JSON gives, their merge of the demo JSON files, the v1.1 merge output's total,
every published leaderboard row's TotalScore from its columns; the encoders' code paths on tiny random stand-ins
of their architectures (no weights are reachable here); the command on a video dir; infer.py --eval-set writing
an OpenS2V-Eval set's videos by sample id, resumably."""

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from a2.eval import opens2v
from tests.conftest import assert_their_motion, locked_opencv

MEDIA = Path(__file__).parent / "media" / "opens2v_eval"
THEIR_FILES = ("aesthetic_score", "motion_amplitude", "motion_smoothness", "facesim", "gmescore", "nexusscore",
               "naturalscore_1", "naturalscore_2", "naturalscore_3")


def their(name):
    return json.loads((MEDIA / f"{name}.json").read_text())


@pytest.fixture
def demo_json_dir(tmp_path):
    (tmp_path / "their_json").mkdir()
    for name in THEIR_FILES:
        shutil.copy(MEDIA / f"{name}.json", tmp_path / "their_json")
    return tmp_path / "their_json"


def test_motion_fb_is_zero_for_a_still_video_and_grows_with_motion():
    rng = np.random.default_rng(0)
    base = (rng.random((64, 96, 3)) * 255).astype(np.uint8)
    base = np.asarray(Image.fromarray(base).filter(ImageFilter.BLUR))
    still = np.stack([base] * 4)
    assert opens2v.motion_fb(still) < 0.01  # Farneback's polynomial fit leaves a small residual on noise
    moving = np.stack([np.roll(base, 2 * t, axis=1) for t in range(4)])
    assert opens2v.motion_fb(moving) > 0.5


def test_merge_of_the_demo_files_is_their_normalised_metrics_and_which_weights_made_0636(demo_json_dir):
    theirs = their("model_name_Open-Domain")
    metrics = opens2v.normalised_metrics(opens2v.merge_dir(demo_json_dir))
    for key, value in theirs.items():
        if key != "total_score":
            assert metrics[key] == pytest.approx(value, rel=1e-12), key
    # their demo output has no motion_amplitude; v1.1 has it: the mean of the two motion_fb, range [0, 1]
    assert metrics["motion_amplitude"] == pytest.approx((0.35025984048843384 + 0.038793787360191345) / 2)
    total, missing = opens2v.total_score(metrics, "Open-Domain")
    assert missing == [] and total == pytest.approx(0.5959962472265614, rel=1e-12)  # v1.1, not their 0.636
    # 0.6356867755593165 is the v1.0 weighting (one motion metric, 0.12) with the smoothness in the motion slot
    # v1.0's weights (the repository's first eval/v1.0_backup/merge_result.py), which no a2 code scores with
    v10 = dict(aes_score=0.12, motion=0.12, facesim_cur=0.20, gme_score=0.12, nexus_score=0.20, natural_score=0.24)
    old = sum(w * metrics["motion_smoothness" if m == "motion" else m] for m, w in v10.items())
    assert old == pytest.approx(theirs["total_score"], rel=1e-12)
    assert total != pytest.approx(theirs["total_score"], abs=0.01)


def test_the_v11_merge_output_total_is_its_metrics_under_the_v11_weights():
    board = their("leaderboard_model_name_Open-Domain")
    total, missing = opens2v.total_score({k: v for k, v in board.items() if k != "total_score"}, "Open-Domain")
    assert missing == [] and total == pytest.approx(board["total_score"], rel=1e-14)


@pytest.mark.parametrize("domain", opens2v.DOMAINS)
def test_total_score_reproduces_every_published_leaderboard_row(domain):
    rows = opens2v.read_leaderboard(opens2v.LEADERBOARDS / f"results_{domain}.csv")
    with open(opens2v.LEADERBOARDS / f"results_{domain}.csv", encoding="utf-8") as f:
        assert len(rows) == len(list(csv.DictReader(f))) >= 10
    for row in rows:
        total, missing = opens2v.total_score(row["metrics"], domain)
        assert missing == [], row["model"]
        assert abs(100 * total - row["total"]) <= 0.008, (row["model"], 100 * total, row["total"])
    assert ("nexus_score" in rows[0]["metrics"]) == (domain != "Human-Domain")


def test_partial_total_renormalises_the_weights_and_names_what_is_missing(demo_json_dir):
    for name in ("nexusscore", "naturalscore_1", "naturalscore_2", "naturalscore_3"):
        (demo_json_dir / f"{name}.json").unlink()
    result = opens2v.merge_result(demo_json_dir, "Open-Domain")
    assert result["partial"] and result["missing"] == ["nexus_score", "natural_score"]
    assert "missing NexusScore, NaturalScore" in result["label"] and "0.56 to 1" in result["label"]
    w = opens2v.WEIGHTS["Open-Domain"]
    kept = [m for m in w if m not in ("nexus_score", "natural_score")]
    expected = sum(w[m] * result[m] for m in kept) / sum(w[m] for m in kept)
    assert result["total_score"] == pytest.approx(expected)
    # their clipping: aes_score is clipped to [4, 7] before the mean, nexus_score 0 ("not found") is left out
    merged = {"a": dict(aes_score=9.0, nexus_score=0.0), "b": dict(aes_score=3.0, nexus_score=0.5)}
    assert opens2v.normalised_metrics(merged) == dict(aes_score=0.5, nexus_score=1.0)


def test_read_eval_sets_as_downloaded():
    for domain, n in (("Open-Domain", 180), ("Human-Domain", 60), ("Single-Domain", 90)):
        path = MEDIA / f"{domain}_Eval.json"
        assert opens2v.domain_of(path) == domain
        samples = opens2v.read_eval_set(path)
        assert len(samples) == n
    s = samples["singleface_1"] if "singleface_1" in samples else next(iter(samples.values()))
    assert s["images"][0] == MEDIA / s["img_paths"][0] and s["img_paths"][0].startswith("Images/")
    open_set = opens2v.read_eval_set(MEDIA / "Open-Domain_Eval.json")
    assert opens2v.face_reference(open_set["faceobj_14"]) is not None
    assert opens2v.face_reference(open_set["singleobj_1"]) is None
    with pytest.raises(ValueError, match="not an OpenS2V-Eval set name"):
        opens2v.domain_of("eval.json")


def command(*argv) -> int:
    """`python3 -m a2.eval.opens2v ARGV` as its __main__ runs it (parse_cli, run_cli): its exit status."""
    from a2.cli import parse_cli, run_cli
    from config import OpenS2VConfig

    try:
        return run_cli(opens2v.main, parse_cli(OpenS2VConfig, args=list(argv)))
    except SystemExit as e:
        return e.code


def test_the_command_scores_the_demo_videos_motion_fb_to_every_digit_of_their_json(tmp_path, demo_json_dir, capsys):
    """The command on a dir of their demo videos and their other metric files: a2 writes motion_amplitude.json
    (motion_fb 0.35025984048843384 and 0.038793787360191345, equal to the last digit under the locked OpenCV), merges
    and labels the TotalScore with what it covers: 2 of the set's 180 videos is a partial TotalScore, never a
    leaderboard row. A video added since (a render resumed) is scored; the videos scored before are kept."""
    videos = tmp_path / "videos"
    videos.mkdir()
    shutil.copy(MEDIA / "faceobj_14.mp4", videos)
    json_dir = videos / "opens2v_json"
    shutil.copytree(demo_json_dir, json_dir)
    (json_dir / "motion_amplitude.json").unlink()  # a2 computes it: must give their file back
    assert command("--videos", str(videos), "--eval-set", SET) == 0
    assert "[1/1] faceobj_14: motion_fb=0.3503" in capsys.readouterr().out
    shutil.copy(MEDIA / "singleface_3.mp4", videos)  # rendered since
    assert command("--videos", str(videos), "--eval-set", SET) == 0
    out = capsys.readouterr().out
    assert "[2/2] singleface_3: motion_fb=0.0388" in out and "faceobj_14: motion_fb" not in out
    assert "motion_amplitude.json: 1 video(s)" in out
    ours = json.loads((json_dir / "motion_amplitude.json").read_text())
    assert ours.keys() == their("motion_amplitude").keys()
    assert_their_motion(ours, their("motion_amplitude"))
    result = json.loads((videos / "opens2v_Open-Domain.json").read_text())
    # to every digit under the locked OpenCV; its motion_fb's last float32 steps under another
    assert result["total_score"] == pytest.approx(0.5959962472265614, rel=1e-12 if locked_opencv() else 1e-6)
    assert result["partial"]
    assert result["label"] == "partial TotalScore over 7 of 7 metrics, 1 to 2 of 180 videos: not comparable with the " \
                              "leaderboard's" and result["videos"]["aes_score"] == 2
    assert "59.60" in out and "Phantom-14B" not in out and "not computed" in out
    # without NexusScore and NaturalScore: the metrics it covers and the weights renormalised
    for name in ("nexusscore", "naturalscore_1", "naturalscore_2", "naturalscore_3"):
        (json_dir / f"{name}.json").unlink()
    assert command("--videos", str(videos), "--eval-set", SET) == 0
    out = capsys.readouterr().out
    assert "partial TotalScore over 5 of 7 metrics (missing NexusScore, NaturalScore; the other weights renormalised " \
           "from 0.56 to 1), 1 to 2 of 180 videos" in out and "get_nexusscore.py" in out and "Phantom-14B" not in out


SET = str(MEDIA / "Open-Domain_Eval.json")


@pytest.mark.parametrize("argv, says", [
    (["--videos", "{tmp}/broken", "--eval-set", "{tmp}/x.json"], "{tmp}/x.json: not an OpenS2V-Eval set name"),
    (["--videos", "{tmp}/none", "--eval-set", SET], "--videos {tmp}/none: not a directory"),
    (["--videos", "{tmp}/broken", "--eval-set", SET], "{tmp}/broken/singleobj_1.mp4: cannot decode the video"),
    (["--videos", "{tmp}/broken", "--eval-set", SET, "--eval.no-motion-fb"],
     "{tmp}/broken/opens2v_json: no metric of any video"),
    (["--videos", "{tmp}/broken", "--eval-set", SET, "--eval.dino", "x"],
     "--eval.dino: a2's own metrics, which infer.py --eval-set scores"),
    (["--videos", "{tmp}/broken", "--eval-set", SET, "--leaderboard", "{tmp}/none.csv"],
     "--leaderboard {tmp}/none.csv: no such file"),
])
def test_the_commands_input_mistakes_are_one_line_exit_2(tmp_path, capsys, argv, says):
    """As `python3 -m a2.eval.opens2v` runs: an input mistake is one line, exit 2 (a video that does not decode, nothing
    to score: said, not a table of nan)."""
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "singleobj_1.mp4").write_bytes(b"not a video")
    assert command(*[a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says.replace("{tmp}", str(tmp_path)) in err, err


def test_a_complete_total_score_is_ranked_among_the_published_rows_and_a_partial_one_never():
    """Every metric of the domain on every video of the set: the run's row among the published ones, by TotalScore.
    A partial one (a metric or a video missing): its own row alone, under a label that says so."""
    published = opens2v.read_leaderboard(opens2v.LEADERBOARDS / "results_Open-Domain.csv")
    kling = their("leaderboard_model_name_Open-Domain")  # the v1.1 merge output of a published row
    videos = {m: 180 for m in opens2v.WEIGHTS["Open-Domain"]}
    run = dict(kling, videos=videos, label=opens2v.score_label("Open-Domain", [], videos, 180))
    lines = opens2v.format_table(run, "Open-Domain", published, name="this run").splitlines()
    assert lines[0] == "TotalScore" and len(lines) == 3 + 1 + len(published)
    mine = next(i for i, ln in enumerate(lines) if ln.startswith("this run"))
    totals = [float(ln.split()[-9 if "<-" in ln else -8]) for ln in lines[3:]]
    assert totals == sorted(totals, reverse=True) and f"{100 * kling['total_score']:.2f}" in lines[mine]
    run["videos"] = dict(videos, aes_score=179)
    run.update(label=opens2v.score_label("Open-Domain", [], run["videos"], 180), partial=True)
    lines = opens2v.format_table(run, "Open-Domain", published).splitlines()
    assert lines[0].startswith("partial TotalScore over 7 of 7 metrics, 179 to 180 of 180 videos") and len(lines) == 4


# ---------------------------------------------------------------- the encoders on tiny stand-ins


def tiny_aesthetics():
    """A CLIPVisionModelWithProjection + aesthetic MLP of their shapes, tiny and random."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    clip = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=8, projection_dim=16))
    processor = opens2v.pil_image_processor("clip", "CLIPImageProcessor")(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return opens2v.Aesthetics(clip, processor, opens2v.AestheticMLP(16))


def test_aesthetic_mlp_loads_their_state_dict_names_and_scores_as_defined():
    # their checkpoint's keys (get_aesscore.py's MLP: Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear)
    assert [k for k in opens2v.AestheticMLP().state_dict()] == [
        f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    scorer = tiny_aesthetics()
    clip, processor, mlp = scorer.embed.model, scorer.embed.processor, scorer.mlp
    frames = (np.random.default_rng(0).random((3, 40, 56, 3)) * 255).astype(np.uint8)
    # written out: the projected embedding of each processed frame, unit length, through the MLP, mean over frames
    x = processor(images=list(frames), return_tensors="pt").pixel_values
    with torch.no_grad():
        e = clip.visual_projection(clip.vision_model(pixel_values=x).pooler_output)
        expected = mlp(e / e.norm(dim=-1, keepdim=True)).mean().item()
    assert scorer(frames) == pytest.approx(expected, rel=1e-5)
    assert scorer(frames[:1]) != pytest.approx(scorer(frames[1:2]))


def test_validation_videos_get_their_metrics_under_their_names():
    import tyro

    from a2.eval.evaluate import evaluate_video, flat_metrics, load_evaluators, video_frames
    from config import EvalConfig, TrainConfig

    assert tyro.cli(TrainConfig, args=["--eval.motion-fb", "--eval.aes-clip", "c", "--eval.aes-mlp", "m"]).eval == \
        EvalConfig(motion_fb=True, aes_clip="c", aes_mlp="m")
    ev = load_evaluators(EvalConfig(motion_fb=True))
    ev.opens2v.aes = tiny_aesthetics()
    rng = np.random.default_rng(1)
    base = np.asarray(Image.fromarray((rng.random((48, 64, 3)) * 255).astype(np.uint8)).filter(ImageFilter.BLUR))
    frames = np.stack([np.roll(base, 3 * t, axis=1) for t in range(40)])  # (40, 48, 64, 3)
    video = torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1  # (3, F, H, W) in [-1, 1]
    result = evaluate_video(video, {}, "a moving texture", ev, max_frames=4)
    decoded = video_frames(video)
    assert result["video"]["motion_fb"] == opens2v.motion_fb(decoded) > 0.5  # every frame, not --eval.max-frames
    assert result["video"]["aes_score"] == pytest.approx(ev.opens2v.aes(opens2v.sample_frames(decoded, 32)))
    assert {"val/motion_fb", "val/aes_score", "val/motion"} <= set(flat_metrics(result, "val/"))


def test_training_validation_logs_their_metrics_per_step(tiny_dir, tmp_path):
    from data import make_synthetic_dataset
    from tests.conftest import args, train

    aes = tiny_aesthetics()  # saved as a user's dirs are: a CLIP dir and the MLP's state dict
    aes.embed.model.save_pretrained(tmp_path / "clip")
    aes.embed.processor.save_pretrained(tmp_path / "clip")
    torch.save(aes.mlp.state_dict(), tmp_path / "aesthetic-model.pth")
    data = make_synthetic_dataset(tmp_path / "data", num_samples=2, num_frames=17, size=(32, 32))
    images = [str(data / f"000_{name}.png") for name in ("person", "object", "background")]
    result = train(*args(data, tmp_path / "runs", "val", "--max-steps", "2", "--val-every", "1", "--val-steps", "1",
                         "--val-elements", *images, "--eval.motion-fb", "--eval.aes-clip", str(tmp_path / "clip"),
                         "--eval.aes-mlp", str(tmp_path / "aesthetic-model.pth"), model=tiny_dir))
    rows = [json.loads(line) for line in (result["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val/aes_score" in r]
    assert [r["step"] for r in val] == [1, 2]
    assert all(np.isfinite(r["val/motion_fb"]) and np.isfinite(r["val/aes_score"]) for r in val)
    video = opens2v.read_video(result["run_dir"] / "samples" / "step-0000002.mp4")
    assert video.shape[0] == 9  # 21 frames - 12 reference frames: the video the metrics were computed on (as a tensor)


def test_curricularface_backbone_has_their_ir101_names_and_facesim_aggregates_as_theirs(tmp_path, monkeypatch):
    with torch.device("meta"):
        ir101 = opens2v.IRBackbone()
    sd = ir101.state_dict()
    assert len(ir101.body) == 49 and sd["output_layer.3.weight"].shape == (512, 512 * 7 * 7)
    assert "body.3.shortcut_layer.0.weight" in sd and "body.0.shortcut_layer.0.weight" not in sd  # 64->128; max-pool
    assert "body.1.res_layer.3.weight" in sd  # PReLU
    assert "output_layer.4.running_mean" in sd and "output_layer.4.weight" not in sd  # BatchNorm1d(affine=False)
    torch.manual_seed(0)
    tiny = opens2v.IRBackbone(units=(1, 1, 1, 1), widths=(8, 8, 16, 16), dim=32)
    with torch.no_grad():
        for m in tiny.modules():  # random running stats: a stand-in that is not the identity at eval
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
    tiny.eval()
    assert tiny(torch.zeros(2, 3, 112, 112)).shape == (2, 32)
    rng = np.random.default_rng(0)
    face = (rng.random((224, 224, 3)) * 255).astype(np.uint8)
    other = (rng.random((224, 224, 3)) * 255).astype(np.uint8)

    # stand-in detector: a frame's "face" is the frame itself (kps unused); a black centre (also once padded) none
    def detect(bgr):
        h, w = bgr.shape[:2]
        return None if bgr[h // 2, w // 2].sum() == 0 else (np.zeros((5, 2)), bgr[:4, :4].astype(np.float32).ravel())

    def align(bgr, kps):
        return bgr[:224, :224]

    sim = opens2v.FaceSim(tiny, detect, align)
    black = np.zeros_like(face)
    same = opens2v.facesim_record(sim, face, np.stack([face, black, face]))
    assert same["cur_score"] == pytest.approx(1.0, abs=1e-6)  # frames without a face are left out
    assert same["arc_score"] == pytest.approx(1.0, abs=1e-6)
    mixed = opens2v.facesim_record(sim, face, np.stack([face, other]))
    c_other = torch.nn.functional.cosine_similarity(sim.embed(face), sim.embed(other), dim=0).item()
    a_other = max(0.0, torch.nn.functional.cosine_similarity(*(torch.from_numpy(x[:4, :4, ::-1].astype(np.float32))
                                                                .ravel() for x in (face, other)), dim=0).item())
    expected = np.mean([1.0, c_other] if c_other > 0 else [1.0])  # their loop leaves out the zeros of max(0, cos)
    assert mixed["cur_score"] == pytest.approx(expected, abs=1e-6)
    assert mixed["arc_score"] == pytest.approx((1.0 + a_other) / 2, abs=1e-6)  # ... but keeps arc_score's zeros
    assert opens2v.facesim_record(sim, black, np.stack([face])) is None  # no face in the reference, even padded
    assert opens2v.facesim_record(sim, face, np.stack([black])) == dict(cur_score=0.0, arc_score=0.0)

    cos = torch.tensor([0.5, float("nan"), -0.2, 0.0])  # a frame without a face is NaN
    assert opens2v.cur_score(cos) == pytest.approx(0.5)  # max(0, cos), its zeros left out as their loop does
    assert opens2v.face_sim(cos) == pytest.approx(dict(face_frames=0.75, face_sim_mean=0.1, face_sim_max=0.5))

    # the same face model, cosines and "no face" as a2's face_sim (--eval.face takes an OpenS2V-Weight dir), read by
    # the one path: face_sim over the frames with a face, cur_score of OpenS2V on the same cosines
    from a2.eval.evaluate import Evaluators, evaluate_video

    ev = Evaluators(face=sim, opens2v=opens2v.Scorers(face=sim, motion=False))
    reference = torch.from_numpy(face).permute(2, 0, 1).float() / 127.5 - 1  # the CLIP path's [-1, 1]
    r = evaluate_video(torch.from_numpy(np.stack([face, black, other])), {"subject": reference}, "x", ev,
                       faces=("subject",))
    subject = r["elements"]["subject"]
    assert subject["face_frames"] == pytest.approx(2 / 3)
    assert subject["face_sim_mean"] == pytest.approx((1 + c_other) / 2, abs=1e-6)
    assert subject["face_sim_max"] == pytest.approx(1.0, abs=1e-6)
    # cur_score on their 32 evenly spaced frames of 3: the face 16 times, black 15 (no face), the other once
    assert r["video"]["cur_score"] == pytest.approx((16 + c_other) / 17 if c_other > 0 else 1.0, abs=1e-6)

    # --eval.face takes an OpenS2V-Weight dir (face_extractor/ beside the backbone): their face model for face_sim
    from a2.eval.evaluate import load_evaluators
    from config import EvalConfig

    (tmp_path / "face_extractor").mkdir()
    loads = []
    monkeypatch.setattr(opens2v.FaceSim, "load", classmethod(lambda cls, d, device="cpu": loads.append(d) or sim))
    assert load_evaluators(EvalConfig(face=str(tmp_path))).face is sim
    both = load_evaluators(EvalConfig(face=str(tmp_path), facesim=str(tmp_path)))
    assert both.face is both.opens2v.face is sim and len(loads) == 2  # the one dir for both: loaded once


def tiny_gme():
    """gme-Qwen2-VL's architecture (Qwen2VLForConditionalGeneration) tiny and random, with a processor of Qwen2-VL's
    kind around a character-level tokenizer that knows the chat and vision tokens (built offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>"]
    vocab = {c: i for i, c in enumerate(special + list("abcdefghijklmnopqrstuvwxyz.,!?:'\n ") + ["[UNK]"])}
    chars = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    chars.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<|endoftext|>",
                                        additional_special_tokens=special[1:])
    images = opens2v.pil_image_processor("qwen2_vl", "Qwen2VLImageProcessor")(min_pixels=56 * 56,
                                                                              max_pixels=112 * 112)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())
    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=vocab["<|image_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"])
    return opens2v.Gme(Qwen2VLForConditionalGeneration(cfg).eval(), processor, batch=2)


def test_gme_score_is_the_prompt_query_against_each_frame_pooled_at_the_last_real_token():
    gme = tiny_gme()
    frames = (np.random.default_rng(0).random((3, 60, 90, 3)) * 255).astype(np.uint8)
    score = gme("a cat sits", frames)

    # written out: their chat strings, the image resized by Qwen2-VL's rule (60x90 -> 56x84) before the processor
    def embed(text, image=None):
        inputs = gme.processor(text=[text], images=None if image is None else [image], return_tensors="pt")
        return gme.forward(inputs["input_ids"], inputs["attention_mask"], inputs.get("pixel_values"),
                           inputs.get("image_grid_thw"))[0]

    query = embed("<|im_start|>system\nFind an image that matches the given text.<|im_end|>\n<|im_start|>user\n"
                  "a cat sits<|im_end|>\n<|im_start|>assistant\n<|endoftext|>")
    corpus = [embed("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
                    Image.fromarray(f).resize((84, 56))) for f in frames]
    assert score == pytest.approx(float(np.mean([(query @ c).item() for c in corpus])), abs=1e-5)
    # right-padded in a batch with a longer text: the same embedding (pooled at its last real token), unit length
    batch, alone = gme.embed(texts=["a cat", "a much longer prompt, padded to"]), gme.embed(texts=["a cat"])
    assert torch.allclose(batch[0], alone[0], atol=1e-5) and batch.norm(dim=-1) == pytest.approx([1.0, 1.0], abs=1e-5)
    # the image enters through its tokens: another frame, another embedding
    assert not torch.allclose(corpus[0], corpus[1], atol=1e-3)


# ---------------------------------------------------------------- infer.py --eval-set on an OpenS2V-Eval set


def test_infer_renders_an_opens2v_set_by_sample_id_and_resumes(tiny_dir, tmp_path, capsys):
    import tyro

    import infer

    root = tmp_path / "OpenS2V-Eval"
    (root / "Images" / "man").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        Image.fromarray((rng.random((40, 30, 3)) * 255).astype(np.uint8)).save(root / "Images" / "man" / f"{name}.jpg")
    samples = {"singleface_1": dict(img_paths=["Images/man/a.jpg"], prompt="a man smiles", class_label=["man"]),
               "humanobj_2": dict(img_paths=["Images/man/a.jpg", "Images/man/b.jpg"], prompt="a man and a cup",
                                  class_label=["man", "cup"])}
    eval_set = root / "Open-Domain_Eval.json"
    eval_set.write_text(json.dumps(samples))
    out = tmp_path / "videos"
    argv = ["--model", str(tiny_dir), "--height", "32", "--width", "32", "--num-frames", "17", "--steps", "1",
            "--device", "cpu", "--eval-set", str(eval_set), "--out-dir", str(out)]
    assert infer.main(tyro.cli(infer.InferConfig, args=argv)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["humanobj_2.mp4", "singleface_1.mp4"]
    frames = opens2v.read_video(out / "singleface_1.mp4")
    assert frames.shape[1:] == (32, 32, 3)  # the video alone, no references beside it
    printed = capsys.readouterr().out
    assert "[2/2] humanobj_2: wrote" in printed and "python3 -m a2.eval.opens2v" in printed
    before = (out / "singleface_1.mp4").stat().st_mtime_ns
    (out / "humanobj_2.mp4").unlink()
    assert infer.main(tyro.cli(infer.InferConfig, args=argv)) == 0
    printed = capsys.readouterr().out
    assert "[1/2] singleface_1: kept" in printed and "[2/2] humanobj_2: wrote" in printed
    assert (out / "singleface_1.mp4").stat().st_mtime_ns == before
    # a bad row: tests/test_input_errors.py (one line naming the sample, exit 2, before any weights load)
