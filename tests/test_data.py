"""config.py and data.py: both config forms, every validation error with its id, loading shapes (synthetic and
the real hiker clip), buckets, deterministic disjoint sharding, exact data-position restore."""

import json
import shutil

import numpy as np
import pytest
import torch

from a2.cli import ConfigError
from a2.config.dataset_config import DatasetConfig, load_dataset_config
from a2.data.loader import collate
from a2.data.media import clean_caption
from a2.elements import A2_ELEMENTS, Element, parse_elements
from data import BucketBatchSampler, DatasetError, E2VDataset, make_synthetic_dataset, rank_slice


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("synth") / "d", num_samples=6, num_frames=17,
                                  size=(32, 48))


def copy_of(synth, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(synth, d)
    return d


# ---------------------------------------------------------------- config


def test_cli_grammar_and_json_forms_give_equal_dataclasses(tmp_path):
    cli = parse_elements(["subject=_person.png,_mask.png:required,repeat=1,vae=pad_white,clip=pad_white",
                          "object=_object.png:repeat=4,vae=pad_white",
                          "background=_background.png:repeat=4,vae=center_crop,clip=off"])
    flat = {"name": "subject", "suffixes": ["_person.png", "_mask.png"], "required": True, "vae_repeat": 1,
            "position": 0, "clip_process": "pad_white", "vae_preprocess": "pad_white"}
    nested = [{"name": "object", "suffixes": ["_object.png"], "vae": {"repeat": 4, "position": 1,
                                                                       "preprocess": "pad_white"}},
              {"name": "background", "suffixes": ["_background.png"], "vae": {"repeat": 4, "position": 2,
                                                                               "preprocess": "center_crop"},
               "clip": False}]
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"datasets": [{"data_root": "x", "elements": [flat] + nested}]}))
    (ds,) = load_dataset_config(f)
    assert ds.elements == cli
    assert cli[2] == Element("background", ("_background.png",), False, 4, 2, "center_crop", "pad_white", False)


def test_default_elements_are_a2s():
    assert [(e.name, e.repeat, e.vae_preprocess, e.clip_preprocess) for e in A2_ELEMENTS] == [
        ("subject", 1, "pad_white", "pad_white"), ("object", 4, "pad_white", "pad_white"),
        ("background", 4, "center_crop", "pad_white")]


def test_design_document_config_loads(tmp_path):
    f = tmp_path / "train.json"
    f.write_text(json.dumps({"datasets": [{
        "data_root": "e2v", "dataset_type": "e2v", "target_resolution": [480, 848], "auto_frame_buckets": True,
        "reshape_mode": "bicubic", "remove_common_llm_caption_prefixes": True, "weight": 2.0,
        "elements": [{"name": "main_subject", "suffixes": ["_dog.png", "_person.png"], "required": True,
                      "vae": {"repeat": 4, "position": 0}, "clip": {"preprocess": "center_crop"}}],
        "processors": {"vae": {"resolution": [480, 848], "combine": "after", "default_preprocess": "resize",
                               "frame_conditioning": "full", "frame_index": 0, "concatenate_mask": True},
                       "clip": {"resolution": [512, 512], "default_preprocess": "center_crop"}},
        "visualization": {"enabled": True, "output_dir": "visualizations/{run_id}", "frequency": 100,
                          "processors": [{"type": "latent_save", "data": ["input_latents"]}]}}]}))
    (ds,) = load_dataset_config(f)
    assert ds.data_root == str(tmp_path / "e2v") and ds.weight == 2.0 and ds.vae.combine == "after"
    assert ds.elements[0].clip_preprocess == "center_crop" and ds.elements[0].vae_preprocess == "resize"
    assert ds.visualization.enabled and ds.visualization.processors[0]["type"] == "latent_save"


@pytest.mark.parametrize("patch,message", [
    ({"colour": 1}, r"datasets\[0\]: unknown key\(s\) \['colour'\]"),
    ({"target_resolution": [480, 850]}, r"datasets\[0\].target_resolution: .*multiples of 16"),
    ({"frame_buckets": [16]}, r"frame_buckets: every bucket must be 4k\+1"),
    ({"elements": [{"name": "a", "suffixes": ["_a.png"], "vae": {"repeat": 0}}]}, "repeat must be >= 1"),
    ({"elements": [{"name": "a", "suffixes": ["_a.png"], "clip": {"preprocess": "zoom"}}]}, "'zoom' is not one"),
    ({"processors": {"vae": {"combine": "during"}}},
     r"processors.vae.combine: 'during' is not one of \('before', 'after'\)"),
    ({"elements": [{"name": "a", "suffixes": ["x"]}, {"name": "a", "suffixes": ["y"], "position": 1}]},
     "names must be unique"),
    # a value of the wrong type: named, not a TypeError from deep inside
    ({"data_root": 5}, r"datasets\[0\].data_root: expected str, got 5"),
    ({"weight": "x"}, r"datasets\[0\].weight: expected int or float, got 'x'"),
    ({"elements": "x"}, r"datasets\[0\].elements: expected list, got 'x'"),
    ({"elements": [{"name": "a", "suffixes": 5}]}, r"elements\[0\].suffixes: expected a file suffix or a list of them, "
                                                   r"got 5"),
    ({"elements": [{"name": "a", "suffixes": [5]}]}, r"elements\[0\].suffixes: expected a file suffix or a list"),
    ({"elements": [{"name": "a", "suffixes": "_a.png", "required": "yes"}]},
     r"elements\[0\].required: expected bool, got 'yes'"),
    ({"elements": [{"name": "a", "suffixes": "_a.png", "vae_repeat": True}]},
     r"elements\[0\].repeat: expected int, got True"),
    ({"elements": [{"name": "a", "suffixes": "_a.png", "vae_repeat": 1, "vae": {"repeat": 4}}]},
     r"elements\[0\]: vae_repeat 1 and vae.repeat 4 disagree: give one of them"),
    ({"auto_frame_buckets": "yes"}, r"datasets\[0\].auto_frame_buckets: expected bool, got 'yes'"),
    ({"frame_stride": "2"}, r"datasets\[0\].frame_stride: expected int, got '2'"),  # was a TypeError
    # a setting that would be dropped, or that two keys give differently: refused, not silently resolved
    ({"frame_buckets": [17, 33]}, r"frame_buckets: the buckets of auto_frame_buckets .*which is off: add "
                                  r"\"auto_frame_buckets\": true, or drop frame_buckets"),
    ({"target_resolution": [480, 832], "processors": {"vae": {"resolution": [320, 576]}}},
     r"target_resolution \[480, 832\] and processors.vae.resolution \[320, 576\] disagree: give one of them"),
    ({"vae_combine": "after", "processors": {"vae": {"combine": "before"}}},
     r"vae_combine 'after' and processors.vae.combine 'before' disagree"),
    ({"clip_resolution": [448, 448], "processors": {"clip": {"resolution": [512, 512]}}},
     r"clip_resolution .* disagree"),
    # a visualization block that would fail (or write nothing) at its first step
    ({"visualization": {"enabled": True, "frequency": 0}}, r"visualization.frequency: every N steps, N >= 1, got 0"),
    ({"visualization": {"processors": [{"data": ["input_latents"]}]}},
     r"visualization.processors\[0\].type: expected one of \('latent_save', 'vae_decode'\), got None"),
    ({"visualization": {"processors": [{"type": "vae_decode", "data": ["latents"]}]}},
     r"processors\[0\].data: \['latents'\] not among \('input_latents', "),
    ({"visualization": {"processors": [{"type": "latent_save", "format": "png"}]}},
     r"processors\[0\].format: latent_save writes pt, got 'png'"),
])
def test_bad_json_values_name_key_and_file(tmp_path, patch, message):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"datasets": [{"data_root": "x", **patch}]}))
    with pytest.raises(ConfigError, match=message) as e:
        load_dataset_config(f)
    assert "bad.json" in str(e.value)


def test_flat_and_nested_forms_that_agree_and_the_public_dataset_keys(tmp_path):
    """The first design's flat keys (clip_resolution, vae_combine, target_resolution) beside their processors form
    load when they agree; frame_buckets with auto_frame_buckets on; sam and cross_video are --sam and --cross-video."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"datasets": [{
        "data_root": "x", "dataset_type": "opens2v", "manifest": "i.jsonl", "sam": "/sam", "cross_video": True,
        "target_resolution": [320, 576], "clip_resolution": [448, 448], "vae_combine": "after",
        "auto_frame_buckets": True, "frame_buckets": [17, 33],
        "processors": {"vae": {"resolution": [320, 576], "combine": "after"}, "clip": {"resolution": [448, 448]}}}]}))
    (ds,) = load_dataset_config(f)
    assert ds.target_resolution == ds.vae.resolution == (320, 576) and ds.clip.resolution == (448, 448)
    assert ds.vae.combine == "after" and ds.frame_buckets == (17, 33) and ds.auto_frame_buckets
    assert ds.sam == "/sam" and ds.cross_video


def test_bad_cli_element_specs():
    with pytest.raises(ConfigError, match="expected NAME=SUFFIX"):
        parse_elements(["subject"])
    with pytest.raises(ConfigError, match="unknown option 'big'"):
        parse_elements(["subject=_p.png:big"])
    with pytest.raises(ConfigError, match="vae preprocess 'stretch'"):
        parse_elements(["subject=_p.png:vae=stretch"])


# ---------------------------------------------------------------- validation


def test_every_validation_error_names_id_and_file(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    (d / "000_person.png").unlink()  # missing required element
    shutil.copy(d / "001_person.png", d / "001_mask.png")  # two files match one element
    (d / "002.mp4").write_bytes(b"garbage")  # corrupt video
    (d / "003_object.png").write_bytes(b"not an image")  # unreadable image
    (d / "004.txt").write_text("   \n")  # empty caption
    elements = (Element("subject", ("_person.png", "_mask.png"), required=True), *A2_ELEMENTS[1:])
    cfg = DatasetConfig(str(d), target_resolution=(32, 48), elements=elements)
    with pytest.raises(DatasetError) as e:
        E2VDataset([cfg], num_frames=17, verbose=False)
    msg = str(e.value)
    assert f"000: {d / '000_person.png'}: required element 'subject' missing" in msg
    assert "001: " in msg and "several files match element 'subject'" in msg
    assert f"002: {d / '002.mp4'}: unreadable video" in msg
    assert f"003: {d / '003_object.png'}: element 'object' is not a readable image" in msg
    assert "004: " in msg and "empty caption" in msg
    assert "005:" not in msg
    ok = E2VDataset([cfg], num_frames=17, skip_bad_samples=True, verbose=False)
    assert [s.id for s in ok.samples] == ["005"]  # --skip-bad-samples drops every sample it lists


def test_too_short_video_is_reported(synth, tmp_path, capsys):
    d = copy_of(synth, tmp_path)
    cfg = DatasetConfig(str(d), target_resolution=(32, 48))
    with pytest.raises(DatasetError, match=r"000: .*000.mp4: 17 frames, shorter than the smallest bucket \(21\)"):
        E2VDataset([cfg], num_frames=21, verbose=False)
    auto = DatasetConfig(str(d), target_resolution=(32, 48), auto_frame_buckets=True, frame_buckets=(9, 17, 33))
    ds = E2VDataset([auto], num_frames=33)  # 17-frame clips go to the 17 bucket
    assert {b[0] for b in ds.buckets} == {17}
    assert "6 samples" in capsys.readouterr().out


# ---------------------------------------------------------------- loading


def test_item_shapes_and_values(synth):
    ds = E2VDataset([DatasetConfig(str(synth), target_resolution=(32, 48))], num_frames=9, verbose=False)
    it = ds[0]
    assert it["video"].shape == (3, 9, 32, 48) and it["video"].min() >= -1 and it["video"].max() <= 1
    assert it["ref_vae"].shape == (3, 3, 32, 48) and it["ref_clip"].shape == (3, 3, 512, 512)
    assert it["repeats"] == (1, 4, 4) and it["element_names"] == ("subject", "object", "background")
    assert it["prompt"].startswith("A square moving right")  # "The video shows" stripped
    b = collate([ds[0], ds[1]])
    assert b["video"].shape == (2, 3, 9, 32, 48) and b["ref_vae"].shape == (2, 3, 3, 32, 48)


def test_clean_caption():
    assert clean_caption("The video shows a dog running.") == "A dog running."
    assert clean_caption("In this video, a cat sleeps.") == "A cat sleeps."
    assert clean_caption("A hiker at the top.") == "A hiker at the top."


def test_manifest_and_npz_forms(synth, tmp_path):
    rows = [{"video": str(synth / "000.mp4"), "caption": "a square", "subject": str(synth / "000_person.png")}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DatasetConfig(str(tmp_path), target_resolution=(32, 48), manifest="m.jsonl", elements=A2_ELEMENTS[:1])
    ds = E2VDataset([cfg], num_frames=9, verbose=False)
    assert ds[0]["element_names"] == ("subject",) and ds[0]["prompt"] == "a square"
    frames = (np.random.default_rng(0).random((12, 40, 40, 3)) * 255).astype(np.uint8)
    np.savez(tmp_path / "clip0.npz", frames=frames)
    (tmp_path / "train.jsonl").write_text(json.dumps({"path": "clip0.npz", "prompt": "noise"}))
    t2v = DatasetConfig(str(tmp_path), target_resolution=(32, 32), manifest="train.jsonl", elements=(),
                        dataset_type="t2v", reshape_mode="resize")
    it = E2VDataset([t2v], num_frames=9, verbose=False)[0]
    assert it["video"].shape == (3, 9, 32, 32) and it["ref_vae"].shape[0] == 0


def test_real_hiker_clip_loads_to_requested_shape(media, tmp_path):
    shutil.copy(media / "hiker.mp4", tmp_path / "hiker.mp4")
    (tmp_path / "hiker.txt").write_text("A hiker standing at the top of a mountain, triumphantly, high quality")
    cfg = DatasetConfig(str(tmp_path), target_resolution=(480, 832), elements=())
    it = E2VDataset([cfg], num_frames=49, verbose=False)[0]
    v = it["video"]
    assert v.shape == (3, 49, 480, 832)
    assert -1 <= v.min() < -0.5 and 0.5 < v.max() <= 1  # real content, full range
    assert (v[:, 0] - v[:, -1]).abs().mean() > 0.01  # the camera moves: frames differ


# ---------------------------------------------------------------- batching and sharding


def test_buckets_share_shape_and_element_set(synth, tmp_path):
    d = copy_of(synth, tmp_path)
    for i in ("000", "001"):
        (d / f"{i}_object.png").unlink()
    ds = E2VDataset([DatasetConfig(str(d), target_resolution=(32, 48))], num_frames=9, verbose=False)
    sampler = BucketBatchSampler(ds, 2, seed=0)
    for batch in sampler:
        assert len({ds.buckets[i] for i, _ in batch}) == 1
        collate([ds[x] for x in batch])  # no bucket mixing


def test_sharding_is_deterministic_and_disjoint(synth):
    ds = E2VDataset([DatasetConfig(str(synth), target_resolution=(32, 48))], num_frames=9, verbose=False)
    a, b = BucketBatchSampler(ds, 4, seed=1), BucketBatchSampler(ds, 4, seed=1)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(BucketBatchSampler(ds, 4, seed=1))  # epochs differ
    (gb,) = list(BucketBatchSampler(ds, 4, seed=1))
    shards = [rank_slice(gb, r, 2, 1, 2) for r in range(2)]
    flat = [x for s in shards for mb in s for x in mb]
    assert sorted(flat) == sorted(gb) and len(set(flat)) == 4  # disjoint and covering
    assert rank_slice(gb, 0, 1, 2, 2) == [gb[0:2], gb[2:4]] and rank_slice(gb, 1, 2, 1, 2) == [gb[1:2], gb[3:4]]


def test_global_batch_larger_than_data_is_an_error(synth):
    ds = E2VDataset([DatasetConfig(str(synth), target_resolution=(32, 48))], num_frames=9, verbose=False)
    with pytest.raises(ValueError, match="global batch 8"):
        BucketBatchSampler(ds, 8)


def test_dataset_weights(synth, tmp_path):
    d2 = copy_of(synth, tmp_path)
    cfgs = [DatasetConfig(str(synth), target_resolution=(32, 48), weight=2.0),
            DatasetConfig(str(d2), target_resolution=(32, 48), weight=0.5)]
    ds = E2VDataset(cfgs, num_frames=9, verbose=False)
    picks = [i for b in BucketBatchSampler(ds, 1, seed=0) for i, _ in b]
    per = [sum(ds.samples[i].dataset == k for i in picks) for k in (0, 1)]
    assert per == [12, 3]
    assert torch.is_tensor(ds[picks[0]]["video"])
