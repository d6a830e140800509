"""infer.py, data.py and bench.py as a newcomer meets them: each input mistake ends in one line (exit 2), a signal in
one line with what is kept (exit 128 + the signal), and a precompute says it resumes."""

import os
import signal
import subprocess
import sys

import pytest

import infer
from config import run_cli
from tests.conftest import ROOT


def one_line_exit_2(capsys, cfg) -> str:
    """infer.py's main on cfg, as its __main__ runs it: must exit 2 with one line on stderr and nothing else."""
    with pytest.raises(SystemExit) as e:
        run_cli(infer.main, cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("mistake, want", [
    ("missing", "nope.png: element 'subject' image not found"),
    ("text", "notes.png: element 'subject' is not a readable image"),
    ("size", "height and width must be positive multiples of 16, got 60x60"),
    ("frames", "num_frames must be 4k+1 (e.g. 17, 49, 81), got 20"),
])
def test_infer_input_mistakes_are_one_line_exit_2(tmp_path, capsys, data_dir, mistake, want):
    (tmp_path / "notes.png").write_text("not a picture\n")
    good = [str(data_dir / f"000_{n}.png") for n in ("person", "object", "background")]
    cfg = dict(missing=dict(elements=(str(tmp_path / "nope.png"), *good[1:])),
               text=dict(elements=(str(tmp_path / "notes.png"), *good[1:])),
               size=dict(elements=tuple(good), height=60, width=60),
               frames=dict(elements=tuple(good), num_frames=20))[mistake]
    err = one_line_exit_2(capsys, infer.InferConfig(model="tiny", device="cpu", out=str(tmp_path / "o.mp4"), **cfg))
    assert want in err
    assert not (tmp_path / "o.mp4").exists()


def test_a_missing_element_is_still_a_file_not_found_error(tmp_path, data_dir):
    """The one-line error keeps its kind: callers that catch FileNotFoundError still do."""
    with pytest.raises(FileNotFoundError, match="image not found"):
        infer.main(infer.InferConfig(model="tiny", device="cpu", elements=(str(tmp_path / "nope.png"),)))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_in_one_line_with_what_is_kept(signum):
    code = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); from config import exit_on_signal; "
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
