"""The CUDA checks in parts that each fit one call of a GPU lease: planned, run and recorded here, called by
scripts/gpu_check.sh (which installs the wheels and prints the card first).

    python3 scripts/gpu_check.py list quick|rest|speed   # each test (row) and its expected time; no GPU needed
    python3 scripts/gpu_check.py run quick|rest [WORD]   # the part's tests (those whose id holds WORD), on CUDA
    python3 scripts/gpu_check.py speed                   # bench.py's speed rows, on CUDA
    python3 scripts/gpu_check.py record OUT              # OUT's results appended to docs/gpu.md, times updated

quick: one test for each path only a GPU exercises (QUICK). rest: every other test marked gpu, found by pytest's
collection (`--collect-only -m gpu`), so that a new gpu test lands in a part by itself. Each test runs in its own
pytest process (a process group, compiled code or a full GPU never carries over to the next test) under its budget
(the timeout of its process; gpu_times.json), and its result, time and failure text are written to OUT as soon as
it ends: a call killed at its limit leaves the tests it finished behind. `record` reads OUT (results.jsonl,
speed.jsonl, env.json) alone, so it can run on the GPU machine or, on OUT brought back, anywhere.

Expected times come from scripts/gpu_times.json: the last measured time of each test where a run recorded one,
"unmeasured" where none did (then the part's total counts the test's budget, the most it may take)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = ROOT / "scripts" / "gpu_times.json"
DOC = ROOT / "docs" / "gpu.md"
TEXT = 6000  # characters of a failure's text kept (its end: the assertion and the last frames)

# the GPU-only paths, one test each
QUICK = {
    "tests/test_gpu.py::test_lora_bf16_trains_and_infers": "bf16 LoRA train + infer.py",
    # on an H100 its second run is --fp8-matmul: the LoRA step through _scaled_mm
    "tests/test_gpu.py::test_lora_over_fp8_base_weights_on_cuda": "LoRA over fp8 base weights and fp8 _scaled_mm, "
                                                                  "compiled",
    "tests/test_gpu.py::test_fsdp_lora_in_bf16_matches_ddp[compile]": "FSDP2 LoRA, compiled",
    "tests/test_gpu.py::test_fsdp_full_finetune_in_bf16_matches_ddp[checkpointing]": "FSDP2 full fine-tuning",
    "tests/test_gpu.py::test_offload_and_swap_bf16_step[False]": "activation offload and block swap",
    "tests/test_gpu.py::test_resume_after_sigterm_on_cuda": "SIGTERM, checkpoint, --resume auto",
    "tests/test_gpu.py::test_validation_video": "the validation video",
    "tests/test_gpu.py::test_vace_lora_over_fp8_base_trains_and_infers": "Wan VACE LoRA, bf16 and fp8, compiled",
}
SHAPE = ("--frames", "81", "--height", "480", "--width", "832", "--attention-backend", "_native_cudnn")
A2_14B = ("--preset", "14B", "--refs", "3", "--mode", "lora", *SHAPE)
# bench.py's rows (its defaults: --memory auto, compiled on CUDA); one warm-up step (it compiles), two timed
SPEED = {
    "A2-14B LoRA, 3 refs, 81x480x832": (*A2_14B, "--warmup", "1", "--steps", "2"),
    "A2-14B LoRA, 3 refs, 81x480x832, --fp8-base --fp8-matmul": (*A2_14B, "--fp8-base", "--fp8-matmul", "--warmup",
                                                                 "1", "--steps", "2"),
    "Wan 1.3B full fine-tuning, 81x480x832, --max-memory-gb 40": ("--preset", "1.3B", "--refs", "0", "--mode", "full",
                                                                  *SHAPE, "--max-memory-gb", "40", "--warmup", "1",
                                                                  "--steps", "2"),
}
DEFAULT_BUDGET_S = 580  # a test without a budget of its own: what is left of a 10-minute call


def load_times(path: Path = TIMES) -> dict:
    return json.loads(path.read_text())


def collect_gpu_tests() -> list[str]:
    """Every test marked gpu, as pytest collects them (its node ids), on any machine."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                        "tests"], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ids = [line for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if r.returncode != 0 or not ids:
        raise SystemExit(f"pytest --collect-only -m gpu failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr}")
    return ids


def part_items(part: str) -> list[str]:
    """The tests (node ids) or speed rows of a part, in the order they run."""
    if part == "quick":
        return list(QUICK)
    if part == "rest":
        return [t for t in collect_gpu_tests() if t not in QUICK]
    if part == "speed":
        return list(SPEED)
    raise SystemExit(f"scripts/gpu_check.py: no part {part!r}: quick, rest or speed")


def budget(item: str, times: dict) -> float:
    return times["budget_s"].get(item, DEFAULT_BUDGET_S)


def expected(item: str, times: dict) -> tuple[float, bool]:
    """(seconds, measured): the last measured time, else the budget (the most the item may take)."""
    m = times["measured"].get(item)
    return (m["seconds"], True) if m else (budget(item, times), False)


def minutes(s: float) -> str:
    m, s = divmod(round(s), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def listing(part: str, times: dict) -> list[str]:
    items = part_items(part)
    total = sum(expected(i, times)[0] for i in items)
    unmeasured = sum(not expected(i, times)[1] for i in items)
    lines = [f"{part}: {len(items)} {'rows' if part == 'speed' else 'tests'}, expected total {minutes(total)} ("
             f"{len(items) - unmeasured} measured, {unmeasured} unmeasured counted at their budget)"]
    for i in items:
        m = times["measured"].get(i)
        when = (f"{m['seconds']:.0f} s ({m['result']}, {m['card']}, {m['date']}, {m['commit']})" if m else
                "unmeasured")
        what = QUICK.get(i) or (" ".join(SPEED[i]) if part == "speed" else "")
        lines.append(f"  {when:<12} budget {budget(i, times):>4.0f} s  {i}" + (f"  [{what}]" if what else ""))
    lines.append(f"total {total:.0f} s")
    return lines


def environment(out: Path, part: str, planned: list[str]) -> dict:
    """The machine and the code a part ran on, and what it was to run: env.json in OUT. The card as nvidia-smi names
    it: this process never initialises CUDA (its context would take GPU memory from the tests). A copy of the tree
    without .git names its commit in A2_COMMIT."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def git(*a):
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
    except FileNotFoundError:
        smi = []
    try:
        diffusers = version("diffusers")
    except PackageNotFoundError:
        diffusers = "missing"
    status = git("status", "--porcelain", "--untracked-files=no")
    env = dict(part=part, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               card=smi[0].split(",")[0].strip() if smi else "no CUDA device", gpus=len(smi), nvidia_smi=smi,
               torch=torch.__version__, cuda=torch.version.cuda, diffusers=diffusers,
               commit=os.environ.get("A2_COMMIT") or git("rev-parse", "--short=10", "HEAD") or "unknown",
               dirty=None if status is None or os.environ.get("A2_COMMIT") else bool(status), planned=planned)
    (out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    return env


def append(path: Path, row: dict) -> None:
    with open(path, "a") as f:  # one line per result, flushed as it ends
        f.write(json.dumps(row) + "\n")


def tail(text: str) -> str:
    return text[-TEXT:]


def run_tests(part: str, out: Path, times: dict, word: str = "") -> int:
    """Each test of the part in its own pytest process under its budget; results.jsonl and failures.txt in OUT
    written as each ends. Returns the number that did not pass."""
    items = [i for i in part_items(part) if word in i]
    environment(out, part, items)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    bad = 0
    for n, test in enumerate(items, 1):
        log = logs / (test.split("::", 1)[1].replace("[", "-").replace("]", "").replace("/", "_") + ".log")
        report = out / ".report.json"
        report.unlink(missing_ok=True)
        print(f"[{part} {n}/{len(items)}] {test} (budget {budget(test, times):.0f} s)", flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p",
                                  "gpu_check", test], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     [str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]),
                                      "A2_GPU_REPORT": str(report)}, start_new_session=True)
            try:
                p.wait(timeout=budget(test, times))
                result = json.loads(report.read_text()) if report.exists() else dict(
                    result="error", text=f"pytest exited {p.returncode} without a result")
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)  # the test and the processes it started
                p.wait()
                result = dict(result="timeout", text=f"stopped at its budget, {budget(test, times):.0f} s")
        seconds = time.perf_counter() - t0
        if result["result"] not in ("passed", "skipped"):
            bad += 1
            # pytest's text of the failure, then the end of the process's output (a timeout's only trace)
            result["text"] = (result.get("text", "") + "\n--- the end of its log ---\n"
                              + log.read_text(errors="replace")[-TEXT // 3:])
            with open(out / "failures.txt", "a") as f:
                f.write(f"=== {test}: {result['result']} after {seconds:.1f} s\n{result['text']}\n\n")
        append(out / "results.jsonl", dict(part=part, test=test, seconds=round(seconds, 1), **result))
        print(f"  {result['result']} in {seconds:.1f} s", flush=True)
    return bad


def pytest_runtest_logreport(report):
    """(pytest plugin, `-p gpu_check` in run_tests' processes) the test's outcome and failure text, as it ends."""
    path = os.environ.get("A2_GPU_REPORT")
    if not path or report.when == "teardown" and report.passed:
        return
    if report.when == "call" or report.failed or report.skipped:
        result = "passed" if report.passed else "skipped" if report.skipped else "failed"
        text = "" if report.passed else tail(str(report.longrepr))
        Path(path).write_text(json.dumps(dict(result=result, phase=report.when, call_s=round(report.duration, 1),
                                              text=text)))


def run_speed(out: Path, times: dict) -> int:
    """bench.py's rows, each under its budget: speed.jsonl in OUT (bench.py's row, or the failure's text)."""
    environment(out, "speed", list(SPEED))
    bad = 0
    for name, flags in SPEED.items():
        rows = out / ".bench.jsonl"
        rows.unlink(missing_ok=True)
        print(f"[speed] {name}: bench.py {' '.join(flags)} (budget {budget(name, times):.0f} s)", flush=True)
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "bench.py", *flags, "--out", str(rows)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            log, _ = p.communicate(timeout=budget(name, times))
            result = "passed" if p.returncode == 0 and rows.exists() else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            log, _ = p.communicate()
            result = "timeout"
        seconds = time.perf_counter() - t0
        print(log[-1500:], flush=True)
        bench = json.loads(rows.read_text().splitlines()[-1]) if result == "passed" else None
        row = dict(part="speed", test=name, result=result, seconds=round(seconds, 1), flags=list(flags), bench=bench,
                   text="" if bench else tail(log))
        if not bench:
            bad += 1
            with open(out / "failures.txt", "a") as f:
                f.write(f"=== speed {name}: {result} after {seconds:.1f} s\n{row['text']}\n\n")
        append(out / "speed.jsonl", row)
    return bad


# ---------------------------------------------------------------- the record (docs/gpu.md)

HEADER = """# GPU runs

What `scripts/gpu_check.sh quick | rest | speed` measured on a CUDA machine, one section per part run, oldest
first. This file is written by `python3 scripts/gpu_check.py record OUT` from the results the part left in OUT
(results.jsonl, speed.jsonl, env.json); nothing in it is typed by hand. The expected times that
scripts/gpu_check.sh PART --list prints are the last ones recorded here (scripts/gpu_times.json). The H100 runs
before this file are in docs/memory.md's speed tables.
"""


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def section(env: dict, tests: list[dict], speed: list[dict], planned: list[str]) -> str:
    """One part's record: the machine, each test's result and time, the speed rows, and what the part did not reach
    (planned: the part's items; those without a result were not reached, e.g. the call hit its limit)."""
    rows = tests + speed
    counts = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    done = {r["test"] for r in rows}
    missing = [i for i in planned if i not in done]
    smi = "; ".join(env.get("nvidia_smi") or []) or "nvidia-smi gave nothing"
    lines = [f"## {env['part']}, {env['date']}, {env['card']}", "",
             f"- card: {smi} ({env['gpus']} GPU{'s' if env['gpus'] != 1 else ''} visible)",
             f"- torch {env['torch']} (CUDA {env['cuda']}), diffusers {env['diffusers']}",
             f"- commit {env['commit']}" + {True: " with uncommitted changes", False: "",
                                            None: " (uncommitted changes unknown)"}[env["dirty"]],
             f"- {len(rows)} of {len(planned)} run: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
             + f"; {minutes(sum(r['seconds'] for r in rows))} in all", ""]
    if tests:
        lines += ["| test | result | time |", "|---|---|---|"]
        lines += [f"| `{r['test']}` | {r['result']} | {r['seconds']:.1f} s |" for r in tests]
        lines.append("")
    if speed:
        lines += ["| row | result | time | plan | s/step | MFU | measured peak GiB | rule GiB | rule - peak |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in speed:
            b = r["bench"] or {}
            peak, rule = b.get("peak_mem_gb"), b.get("estimate_gb")
            err = f"{rule / peak - 1:+.1%}" if peak and rule else "-"
            lines.append(f"| {r['test']} | {r['result']} | {r['seconds']:.0f} s | {b.get('plan', '-')} | "
                         f"{fmt(b.get('s_per_step'))} | {fmt(b.get('mfu'), '.1%')} | {fmt(peak)} | {fmt(rule)} | "
                         f"{err} |")
        lines.append("")
    if missing:
        lines += ["Not reached (no result: the call ended first): " + ", ".join(f"`{m}`" for m in missing), ""]
    for r in rows:
        if r["result"] not in ("passed", "skipped"):
            text = "\n".join(r["text"].strip().splitlines()[-25:]).replace("```", "'''")
            lines += [f"`{r['test']}` {r['result']} (the end of its text):", "", "```text", text, "```", ""]
    return "\n".join(lines)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def record(out: Path, doc: Path = DOC, times_path: Path = TIMES) -> str:
    """Append OUT's part to `doc` (its header first when new) and store each result's time in `times_path`: the
    expected time of the next --list. Returns the section."""
    env = json.loads((out / "env.json").read_text())
    if not env["gpus"]:
        raise SystemExit(f"{out} ran on a machine without a CUDA GPU: its tests were skipped; nothing to record")
    tests, speed = read_rows(out / "results.jsonl"), read_rows(out / "speed.jsonl")
    times = load_times(times_path)
    text = section(env, tests, speed, env["planned"])
    old = doc.read_text() if doc.exists() else HEADER
    doc.write_text(old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")
    for r in tests + speed:
        if r["result"] in ("passed", "failed"):  # a timeout or a skip is no measure of the test's time
            times["measured"][r["test"]] = dict(seconds=r["seconds"], result=r["result"], card=env["card"],
                                                date=env["date"][:10], commit=env["commit"])
    times_path.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
    return text


def main(argv: list[str]) -> int:
    times = load_times()
    out = Path(os.environ.get("OUT", ROOT / "out" / "gpu_check"))
    if len(argv) >= 2 and argv[0] == "list":
        print("\n".join(listing(argv[1], times)))
        return 0
    if len(argv) >= 2 and argv[0] == "run" and argv[1] in ("quick", "rest"):
        out.mkdir(parents=True, exist_ok=True)
        return int(run_tests(argv[1], out, times, argv[2] if len(argv) > 2 else "") > 0)
    if argv[:1] == ["speed"]:
        out.mkdir(parents=True, exist_ok=True)
        return int(run_speed(out, times) > 0)
    if len(argv) == 2 and argv[0] == "record":
        print(record(Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
