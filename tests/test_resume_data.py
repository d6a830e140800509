"""Resume after the dataset changed, end to end through train_a2.main: a run with --skip-bad-samples drops a clip
that fails mid-run and checkpoints; resumed on the same data it equals the uninterrupted run, and on changed data
(a clip added, one removed, the bad one replaced, clips renamed) it says so, names every dropped clip by path, and
leaves out no other clip."""

import os
import re
import shutil

import pytest

import train_a2
from data import E2VDataset, make_synthetic_dataset
from tests.conftest import args, losses, train

CUT, TOTAL = 4, 12  # the checkpoint's step; after it at least one whole epoch of every dataset below (3 to 5 clips)
STAMP = 10**18  # the damaged file's mtime, the same in every run: the same damaged file, as LoadFailures sees it


class DamagedAfterScan(E2VDataset):
    """The dataset with one file damaged once validation has read it: it fails to load mid-run (a disk or network
    fault after the scan), as a bad file that validation misses does. `bad` None: nothing is damaged."""

    bad = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        if DamagedAfterScan.bad is not None:
            DamagedAfterScan.bad.write_bytes(b"not a video")
            os.utime(DamagedAfterScan.bad, ns=(STAMP, STAMP))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("clips") / "all", num_samples=5, num_frames=17,
                                  size=(32, 32))


ORIGINAL = ("000", "001", "002", "003")  # 002.mp4 fails to load at step 1 and is dropped; 004 is added below


def dataset(clips, root):
    """A folder dataset of the clips ORIGINAL."""
    root.mkdir(parents=True)
    for f in clips.iterdir():
        if f.name[:3] in ORIGINAL:
            shutil.copy(f, root)
    return root


def rename(data, src, dst):
    for f in data.glob(f"{src}*"):
        f.rename(data / f.name.replace(src, dst, 1))


def run(monkeypatch, data, out, name, bad, steps, *extra):
    """train_a2.main on the tiny model with --skip-bad-samples, `bad` (a file of `data`, or None) damaged after the
    scan; returns {step: the ids it trained} and {step: loss}. Restores `bad` when done, for the next run's scan."""
    trained = {}
    inputs = train_a2.model_inputs

    def spy(batch, step, *a, **kw):
        trained[step + 1] = tuple(batch["ids"])
        return inputs(batch, step, *a, **kw)

    good = bad and (data / bad).read_bytes()
    monkeypatch.setattr(train_a2, "model_inputs", spy)
    monkeypatch.setattr(train_a2, "E2VDataset", DamagedAfterScan)
    monkeypatch.setattr(DamagedAfterScan, "bad", bad and data / bad)
    try:
        train(*args(data, out, name, "--max-steps", str(steps), "--skip-bad-samples", *extra))
    finally:
        if bad:
            (data / bad).write_bytes(good)
    return trained, losses(out / name)


def not_trained(out: str) -> dict[int, list[str]]:
    """{step: the lines that say why it was not trained}, from a run's output."""
    steps: dict[int, list[str]] = {}
    for m in re.finditer(r"^step (\d+)(?::| not trained;) (.*)$", out, re.M):
        steps.setdefault(int(m[1]), []).append(m[2])
    return steps


@pytest.fixture(scope="module")
def uninterrupted(clips, tmp_path_factory):
    """The uninterrupted run's losses: TOTAL steps on ORIGINAL with 002.mp4 damaged."""
    root = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as mp:
        return run(mp, dataset(clips, root / "data"), root, "full", "002.mp4", TOTAL)[1]


def cut(clips, tmp_path, monkeypatch, capsys):
    """The run stopped at CUT (its checkpoint), on ORIGINAL in tmp_path/data with 002.mp4 damaged: 002 failed at
    step 1 and was dropped."""
    data = dataset(clips, tmp_path / "data")
    trained, _ = run(monkeypatch, data, tmp_path, "run", "002.mp4", CUT)
    out = capsys.readouterr().out
    assert f"step 1: sample failed to load: 002: {data / '002.mp4'}: failed to load" in out, out
    assert sorted(trained) == list(range(2, CUT + 1))
    return data


def resume(monkeypatch, capsys, data, tmp_path, bad):
    trained, _ = run(monkeypatch, data, tmp_path, "run", bad, TOTAL, "--resume", "auto")
    out = capsys.readouterr().out
    skipped = not_trained(out)
    assert sorted(set(trained) | set(skipped)) == list(range(CUT + 1, TOTAL + 1))  # each step: trained or said why
    return out, trained, skipped


def test_resume_on_the_same_data_equals_the_uninterrupted_run_and_names_the_dropped_clip(clips, uninterrupted,
                                                                                         tmp_path, monkeypatch,
                                                                                         capsys):
    data = cut(clips, tmp_path, monkeypatch, capsys)
    out, trained, skipped = resume(monkeypatch, capsys, data, tmp_path, "002.mp4")
    assert "the dataset changed" not in out
    assert f"1 sample(s) dropped before the checkpoint stay dropped: {data / '002.mp4'} (002)" in out, out
    assert skipped, out  # a whole epoch follows the checkpoint: 002 comes up, and is left out
    for why in skipped.values():  # each step left out names the dropped clip, and it is the clip 002
        assert why == [f"holds sample(s) dropped before: {data / '002.mp4'} (002)", "1 sample(s) dropped so far"]
    assert not any("002" in ids for ids in trained.values())
    got = losses(tmp_path / "run")
    assert sorted(got) == sorted(uninterrupted) and len(got) < TOTAL - 1  # the same steps trained: 002's left out
    assert max(abs(uninterrupted[s] - got[s]) for s in got) <= 1e-6


CHANGES = {  # how the data changes after the checkpoint: the dataset's ids now, the damaged file (None: none)
    "added": (("000", "001", "002", "003", "004"), "002.mp4"),
    "removed": (("001", "002", "003"), "002.mp4"),  # 002 moves from index 2 to 1: by position 003 would be dropped
    "renamed": (("001", "002", "003", "009"), "002.mp4"),  # 000 -> 009: the order changes, 002 moves to index 1
    "replaced": (ORIGINAL, None),  # 002.mp4 replaced by a good file
    "bad-renamed": (("000", "001", "003", "008"), "008.mp4"),  # 002 -> 008, still damaged
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_resume_on_changed_data_says_so_and_leaves_out_only_the_bad_clip_by_path(clips, tmp_path, monkeypatch,
                                                                                 capsys, change):
    """Each change: the run says whether the dataset changed, and names the dropped clip by its path: still dropped
    (found where it is now), read again (its file was replaced), or gone; no other clip is left out."""
    data = cut(clips, tmp_path, monkeypatch, capsys)
    ids, bad = CHANGES[change]
    if change == "added":
        for f in clips.glob("004*"):
            shutil.copy(f, data)
    elif change == "removed":
        for f in data.glob("000*"):
            f.unlink()
    elif change == "renamed":
        rename(data, "000", "009")
    elif change == "replaced":
        (data / "002.mp4").write_bytes((clips / "002.mp4").read_bytes())
        os.utime(data / "002.mp4")  # a file written now (not the damaged one's time)
    else:
        rename(data, "002", "008")
    out, trained, skipped = resume(monkeypatch, capsys, data, tmp_path, bad)
    assert ("the dataset changed since the checkpoint (4 samples then, " f"{len(ids)} now)" in out) == (
        change != "replaced"), out
    key = f"{data / '002.mp4'} (002)"
    left_out = {"replaced": None, "bad-renamed": f"{data / '008.mp4'} (008)"}.get(change, key)
    said = {"replaced": f"read again, their files changed since they were dropped: {key}",
            "bad-renamed": f"dropped before the checkpoint, no longer in the dataset: {key}"}
    assert said.get(change, f"1 sample(s) dropped before the checkpoint stay dropped: {key}") in out, out
    # every step not trained names the clip it leaves out, and it is the bad one (by path); every other clip trains
    if left_out is None:
        assert not skipped, out
    else:
        assert skipped, out  # a whole epoch follows the checkpoint: the bad clip comes up, and is left out
        first = min(skipped)
        for s, why in skipped.items():
            if change == "bad-renamed" and s == first:  # read, fails again, dropped again, named
                assert why[0].startswith(f"sample failed to load: 008: {data / '008.mp4'}: failed to load"), why
            else:
                assert why == [f"holds sample(s) dropped before: {left_out}", "1 sample(s) dropped so far"], why
    trained_ids = {i for batch in trained.values() for i in batch}
    assert trained_ids == set(ids) - {bad and bad[:3]}, (trained, out)
