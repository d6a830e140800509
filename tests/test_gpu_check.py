"""scripts/gpu_check.sh's plan of a GPU lease, on the CPU: its parts cover every gpu-marked test once within their
time limits, a part's results become docs/gpu.md's section and the next listing's times, and a test stopped at its
budget leaves its result behind."""

import json
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

TEST_ID = re.compile(r"\s(tests/\S+::\S+)")


def listed(part: str) -> tuple[list[str], float]:
    """`bash scripts/gpu_check.sh PART --list` as a planner runs it (this interpreter first on PATH): its tests and
    its total, seconds."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", part, "--list"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    rows = [line for line in r.stdout.splitlines() if " budget " in line]
    assert rows and all(re.match(r"\s+(unmeasured|\d+ s \((passed|failed), )", line) for line in rows), rows
    return TEST_ID.findall(r.stdout), float(re.search(r"^total (\d+) s$", r.stdout, re.M)[1])


def test_quick_and_rest_cover_every_gpu_test_once():
    """pytest's own collection of the gpu marker against the two listings: each test in exactly one, and quick's
    expected total (each test's last measured time, else its budget, the timeout it runs under) within 6 minutes,
    speed's within 4."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                        "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    collected = [line for line in r.stdout.splitlines() if line.startswith("tests/") and "::" in line]
    assert len(collected) >= 18, r.stdout[-2000:]  # the CUDA tier's 17 and the NCCL context-parallel test
    quick, quick_s = listed("quick")
    rest, _ = listed("rest")
    both = quick + rest
    assert len(both) == len(set(both)), [t for t in set(both) if both.count(t) > 1]
    assert sorted(both) == sorted(collected), (set(collected) - set(both), set(both) - set(collected))
    assert quick_s <= 6 * 60, quick_s
    speed = gpu_check.listing("speed", gpu_check.load_times())
    assert float(speed[-1].split()[1]) <= 4 * 60, speed


H100 = dict(part="quick", date="2026-12-07 19:05 UTC", card="NVIDIA H100 80GB HBM3", gpus=1,
            nvidia_smi=["NVIDIA H100 80GB HBM3, 81559 MiB, 570.124.06"], torch="2.11.0+cu128", cuda="12.8",
            diffusers="0.36.0", commit="abc1234def", dirty=False)
LORA, FSDP, VACE = (f"tests/test_gpu.py::{t}" for t in ("test_lora_bf16_trains_and_infers",
                                                        "test_fsdp_lora_in_bf16_matches_ddp[compile]",
                                                        "test_vace_lora_over_fp8_base_trains_and_infers"))


def write_out(out, env, tests=(), speed=()):
    out.mkdir()
    (out / "env.json").write_text(json.dumps(env))
    for name, rows in (("results.jsonl", tests), ("speed.jsonl", speed)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_record_of_a_part(tmp_path):
    """A fake quick part (a test passed, one failed, one never reached) and a fake speed part (the issue's H100 row:
    10.19 s/step, 42.8% MFU, measured peak 67.70 GiB against the rule's 68.10, +0.6%) recorded into a new doc: the
    header once, each part's machine, versions, commit, results and times, the failure's text, what was not reached;
    and the times file then gives --list the measured times."""
    doc, times = tmp_path / "gpu.md", tmp_path / "times.json"
    times.write_text(json.dumps({"budget_s": {LORA: 40, FSDP: 45}, "measured": {}}))
    quick = tmp_path / "quick"
    write_out(quick, dict(H100, planned=[LORA, FSDP, VACE]), tests=[
        dict(part="quick", test=LORA, result="passed", seconds=31.24, text=""),
        dict(part="quick", test=FSDP, result="failed", seconds=52.0,
             text="E   AssertionError: ({1: 0.5}, {1: 0.7})\n--- log ---\nlast line of the log")])
    section = gpu_check.record(quick, doc, times)
    speed = tmp_path / "speed"
    row = dict(s_per_step=10.19, mfu=0.428, peak_mem_gb=67.70, estimate_gb=68.10,
               plan="recompute 98% of the blocks keeping self-attention")
    name = "A2-14B LoRA, 3 refs, 81x480x832"
    write_out(speed, dict(H100, part="speed", planned=[name]),
              speed=[dict(part="speed", test=name, result="passed", seconds=97.0, bench=row, text="")])
    gpu_check.record(speed, doc, times)
    text = doc.read_text()
    print(text)
    assert text.startswith(gpu_check.HEADER) and text.count("# GPU runs") == 1 and text.index("## quick") < text.index(
        "## speed")
    assert section in text and "## quick, 2026-12-07 19:05 UTC, NVIDIA H100 80GB HBM3" in section
    for want in ("NVIDIA H100 80GB HBM3, 81559 MiB, 570.124.06 (1 GPU visible)", "torch 2.11.0+cu128 (CUDA 12.8), "
                 "diffusers 0.36.0", "commit abc1234def\n", "2 of 3 run: 1 failed, 1 passed; 1 min 23 s in all",
                 f"| `{LORA}` | passed | 31.2 s |", f"| `{FSDP}` | failed | 52.0 s |",
                 f"Not reached (no result: the call ended first): `{VACE}`",
                 "```text\nE   AssertionError: ({1: 0.5}, {1: 0.7})\n--- log ---\nlast line of the log\n```"):
        assert want in section, want
    assert (f"| {name} | passed | 97 s | recompute 98% of the blocks keeping self-attention | 10.19 | 42.8% | 67.70 | "
            "68.10 | +0.6% |") in text
    t = gpu_check.load_times(times)
    assert t["measured"][LORA] == dict(seconds=31.24, result="passed", card="NVIDIA H100 80GB HBM3",
                                       date="2026-12-07", commit="abc1234def")
    assert VACE not in t["measured"] and t["measured"][name]["seconds"] == 97.0
    lines = gpu_check.listing("quick", t)
    assert any(LORA in line and line.lstrip().startswith("31 s (passed, NVIDIA H100") for line in lines), lines
    assert any(VACE in line and "unmeasured" in line for line in lines), lines
    assert gpu_check.DOC.read_text().startswith(gpu_check.HEADER)  # the repository's record is the generator's
    write_out(tmp_path / "cpu", dict(H100, card="no CUDA device", gpus=0, planned=[LORA]))
    try:
        gpu_check.record(tmp_path / "cpu", doc, times)
        raise AssertionError("a run without a GPU was recorded")
    except SystemExit as e:
        assert "without a CUDA GPU" in str(e)


def test_a_test_stopped_at_its_budget_leaves_its_result(tmp_path):
    """run_tests: a test's process killed at its budget (1 s here: pytest has not even started) is a `timeout` row in
    results.jsonl and its text in failures.txt, written before the next test starts."""
    times = {"budget_s": {"tests/test_gpu.py::test_validation_video": 1}, "measured": {}}
    assert gpu_check.run_tests("quick", tmp_path, times, "test_validation_video") == 1
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["test"], r["result"]) for r in rows] == [("tests/test_gpu.py::test_validation_video", "timeout")]
    assert 1 <= rows[0]["seconds"] < 30
    assert "=== tests/test_gpu.py::test_validation_video: timeout" in (tmp_path / "failures.txt").read_text()
    assert json.loads((tmp_path / "env.json").read_text())["planned"] == ["tests/test_gpu.py::test_validation_video"]


def test_the_speed_rows_are_bench_commands():
    """Each speed row is a bench.py command line: its flags parse, and say what the row's name says."""
    import tyro

    from config import BenchConfig

    rows = {name: tyro.cli(BenchConfig, args=list(flags)) for name, flags in gpu_check.SPEED.items()}
    fp8 = rows["A2-14B LoRA, 3 refs, 81x480x832, --fp8-base --fp8-matmul"]
    wan = rows["Wan 1.3B full fine-tuning, 81x480x832, --max-memory-gb 40"]
    assert fp8.memory.fp8_base and fp8.memory.fp8_matmul and (fp8.preset, fp8.mode) == ("14B", "lora")
    assert wan.memory.max_memory_gb == 40 and (wan.preset, wan.mode, wan.refs) == ("1.3B", "full", 0)
    assert all((b.frames, *b.size) == (81, 480, 832) and b.memory.compile is None for b in rows.values())


def test_the_plugin_reports_a_tests_outcome_and_failure_text(tmp_path):
    """`-p gpu_check` in a test's pytest process (run_tests): the outcome and, for a failure, pytest's own text (the
    assertion and its values), written when the test ends."""
    (tmp_path / "test_x.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\n"
                                        "def test_bad():\n    assert 1 + 1 == 3, 'the sum'\n\n"
                                        "@pytest.mark.skip(reason='no GPU')\ndef test_skip():\n    pass\n")
    got = {}
    for name in ("test_ok", "test_bad", "test_skip"):
        report = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check",
                        f"test_x.py::{name}"], cwd=tmp_path, capture_output=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "scripts"), "A2_GPU_REPORT": str(report)})
        got[name] = json.loads(report.read_text())
    assert [got[n]["result"] for n in ("test_ok", "test_bad", "test_skip")] == ["passed", "failed", "skipped"]
    assert "AssertionError: the sum" in got["test_bad"]["text"] and "assert (1 + 1) == 3" in got["test_bad"]["text"]
    assert got["test_ok"]["text"] == ""
