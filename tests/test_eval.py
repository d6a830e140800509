"""The eval loss (--eval-split / --eval-manifest / a dataset config's `eval` datasets, --eval-every): held-out samples
never trained on, the loss at fixed sigma quantiles with fixed noise: the same for the same weights at every eval,
at 1 and 2 ranks, from the precompute cache, and on every kind of conditioning."""

import json
import math

import pytest

import train_a2
from config import from_flags
from tests.conftest import args, launch, train

EVAL = ["--lr", "0", "--eval-split", "2", "--eval-every", "1", "--max-steps", "2"]  # lr 0: the weights stay put


def evals(run_dir, prefix="eval/") -> dict:
    """step -> {eval metric: value} from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(prefix)} for r in rows if prefix + "loss" in r}


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory):
    return train(*args(data_dir, tmp_path_factory.mktemp("one"), "one", *EVAL, "--micro-batch", "2"))["run_dir"]


def test_eval_loss_is_the_same_across_evals_and_ranks(one_process, data_dir, tmp_path):
    from a2.train.flow import sigma_quantile

    got = evals(one_process)
    assert sorted(got) == [1, 2] and got[1] == got[2]  # the same weights: the same numbers, bit for bit
    cfg = from_flags()  # the tiny model's recipe, as the runs drew their sigmas
    sigmas = [sigma_quantile(cfg.objective, (i + 1) / 10) for i in range(9)]  # the quantiles 0.1 .. 0.9
    assert sorted(k for k in got[1] if "@" in k) == sorted(f"eval/loss@{s:.3f}" for s in sigmas)
    assert f"eval/loss@{sigmas[4]:.3f}" in got[1] and len(set(got[1].values())) == 10  # each sigma its own loss
    assert got[1]["eval/loss"] == sum(got[1][f"eval/loss@{s:.3f}"] for s in sigmas) / 9
    # 2 ranks, one held-out sample each, gathered: the same numbers as one process
    p = launch(args(data_dir, tmp_path, "ddp", *EVAL, "--micro-batch", "1"), nproc=2)
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-4000:]
    assert evals(tmp_path / "ddp") == got


def test_held_out_clips_are_never_trained_on(data_dir):
    """--eval-split takes whole clips (all their windows), drawn with the seed, and the sampler never yields them."""
    from a2.config.dataset_config import DatasetConfig
    from data import BucketBatchSampler, E2VDataset, held_out

    cfg = DatasetConfig(str(data_dir), target_resolution=(32, 32), frame_extraction="slide", frame_stride=4)
    ds = E2VDataset([cfg], num_frames=9, verbose=False)
    assert len(ds) == 12  # 4 clips of 17 frames: windows at 0, 4, 8
    held = held_out(ds, 1, seed=0)
    assert len(held) == 3 and len({ds.samples[i].video for i in held}) == 1
    assert held_out(ds, 1, seed=0) == held and any(held_out(ds, 1, seed=s) != held for s in range(1, 6))
    sampler = BucketBatchSampler(ds, 3, seed=0, exclude=held)
    seen = set()
    for epoch in range(5):
        sampler.set_epoch(epoch)
        seen |= {i for batch in sampler for i, _ in batch}
    assert seen == set(range(12)) - set(held)
    with pytest.raises(Exception, match="--eval-split 4: the training datasets have 4 clips"):
        held_out(ds, 4, seed=0)


def test_eval_manifest_and_json_eval_datasets_are_held_out(data_dir, tmp_path):
    from data import E2VDataset, held_out

    manifest = tmp_path / "eval.jsonl"
    manifest.write_text("".join(json.dumps({"video": str(data_dir / f"00{i}.mp4"), "caption": "a square",
                                            "subject": str(data_dir / f"00{i}_person.png")})
                                + "\n" for i in (2, 3)))
    cfgs = train_a2.run_datasets(from_flags(data_root=str(data_dir), eval_manifest=str(manifest), resolution=(32, 32)))
    assert [c.eval for c in cfgs] == [False, True] and cfgs[1].elements == cfgs[0].elements
    ds = E2VDataset(cfgs, num_frames=9, verbose=False)
    assert [ds.samples[i].dataset for i in held_out(ds, 0, 0)] == [1, 1] and len(ds) == 6
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"datasets": [{"data_root": str(data_dir), "target_resolution": [32, 32]}],
                                  "eval": [{"data_root": str(data_dir), "target_resolution": [32, 32],
                                            "frame_extraction": "head"}]}))
    ds = E2VDataset(train_a2.run_datasets(from_flags(dataset_config=str(config))), num_frames=9, verbose=False)
    held = held_out(ds, 0, 0)
    assert len(ds) == 8 and [ds.samples[i].dataset for i in held] == [1] * 4 and ds.samples[held[0]].windows


def test_eval_from_the_cache_equals_eval_from_pixels(one_process, data_dir, tmp_path):
    cache = tmp_path / "cache"
    train(*args(data_dir, tmp_path, "pre", "--cache-dir", str(cache), "--precompute"))
    cached = train(*args(data_dir, tmp_path, "cached", *EVAL, "--micro-batch", "2", "--cache-dir", str(cache)))
    assert evals(cached["run_dir"]) == evals(one_process)


KINDS = {  # model, flags: each kind of conditioning the step builds
    "t2v": ("tiny-t2v", ["--dataset-type", "t2v", "--num-frames", "17"]),
    "incontext": ("tiny-t2v", ["--reference-layout", "incontext", "--num-frames", "9"]),
    "inplace": ("tiny", ["--frame-conditioning", "first", "--num-frames", "17"]),
    "ti2v": ("tiny-ti2v", ["--frame-conditioning", "first", "--num-frames", "17"]),
    "expert": ("tiny-wan22-i2v", ["--expert", "low"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_eval_loss_on_every_kind_of_conditioning(data_dir, tmp_path, kind):
    model, flags = KINDS[kind]
    r = train(*args(data_dir, tmp_path, kind, *EVAL, "--eval-split", "1", "--eval-quantiles", "3", "--ema-decay",
                    "0.9", *flags, model=model))
    got, ema = evals(r["run_dir"]), evals(r["run_dir"], "eval_ema/")
    assert sorted(got) == [1, 2] and got[1] == got[2] and len(got[1]) == 4
    assert all(math.isfinite(v) for v in got[1].values())
    assert list(ema[2].values()) == list(got[2].values())  # lr 0: the EMA is the weights
    if kind == "expert":  # sigmas in the low-noise expert's range, below its boundary
        boundary = json.loads((r["run_dir"] / "run.json").read_text())["sigma_range"][1]
        assert all(float(k.split("@")[1]) < boundary for k in got[1] if "@" in k)
