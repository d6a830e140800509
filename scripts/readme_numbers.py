"""The README's numbers, measured: runs a quick-start block of README.md as written (`smoke` or `main`), in a fresh dir
laid out as a clone, and rewrites the README's block between `<!-- numbers NAME -->` and `<!-- /numbers NAME -->` from
what it measured: each command's wall and CPU time, demo.py's distances and colour matches, infer.py's video size, and
(smoke) the run dir's files. No number in those blocks is typed by hand.

    python3 scripts/readme_numbers.py smoke            # about 2-3 minutes on 2 CPU cores
    python3 scripts/readme_numbers.py main             # the 600-step main job: tens of minutes on a shared 2-core box
    python3 scripts/readme_numbers.py main --from-json runs/readme_numbers/main.json   # re-render a measured run

Run it with OMP_NUM_THREADS=1 on a shared machine (the README's own advice); the machine's load average at the start is
written beside the timings, since wall time on a shared box depends on it. tests/test_docs.py holds the README's blocks
to the format `render` writes (not the timings).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# a quick-start block: `<!-- quickstart NAME -->` before a bash code block
QUICKSTART = r"<!-- quickstart {} -->\n```bash\n(.*?)^```"
NUMBERS = r"(<!-- numbers {0} -->\n)(.*?)(<!-- /numbers {0} -->)"
SHAPES = {"person": "square", "object": "disc"}  # what make-sample draws in each sample's element images


def commands(name: str, text: str | None = None) -> list[str]:
    """The commands of the README's quick-start blocks marked `name`, in order, as written (continuations joined,
    comments dropped)."""
    blocks = re.findall(QUICKSTART.format(name), text or README.read_text(), re.M | re.S)
    if not blocks:
        raise SystemExit(f"README.md marks no block '<!-- quickstart {name} -->'")
    lines = "".join(blocks).replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def script_of(line: str) -> str:
    """A command's short name for the table: `data.py make-sample`, `train_a2.py`, ..."""
    w = shlex.split(line)
    return " ".join(w[1:3]) if w[1] == "data.py" else w[1]


def clone(work: Path) -> Path:
    """A dir laid out as a clone of the project: its files linked, its outputs (sample_data, runs) written here."""
    work.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs", "sample_data", "outputs") and not entry.name.startswith("."):
            if not (work / entry.name).exists():
                (work / entry.name).symlink_to(entry)
    return work


def tree(run: Path) -> list[str]:
    """A run dir's files and dirs, one per line, dirs with a trailing /, each dir's entries under it, indented."""
    out = []

    def walk(d: Path, depth: int):
        for p in sorted(d.iterdir()):
            out.append("  " * depth + p.name + ("/" if p.is_dir() else ""))
            if p.is_dir():
                walk(p, depth + 1)

    walk(run, 0)
    return out


def video_size(path: Path) -> tuple[int, int, int]:
    """(width, height, frames) of a video file."""
    import imageio.v3 as iio

    frames = iio.imread(path, plugin="pyav")  # (F, H, W, 3)
    return frames.shape[2], frames.shape[1], frames.shape[0]


def measure(name: str, work: Path) -> dict:
    """Run the block's commands in `work` with bash (python3 = this interpreter), timing each; read the results."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.setdefault("OMP_NUM_THREADS", "1")
    result = dict(block=name, date=datetime.date.today().isoformat(), load=round(os.getloadavg()[0], 1),
                  threads=env["OMP_NUM_THREADS"], cores=os.cpu_count(), commands=[])
    for line in commands(name):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        (work / f"{script_of(line).replace(' ', '_')}.log").write_text(p.stdout + p.stderr)
        if p.returncode:
            raise SystemExit(f"exit {p.returncode}: {line}\n{(p.stdout + p.stderr)[-3000:]}")
        print(f"{wall:7.1f} s wall {cpu:7.1f} s CPU  {line[:100]}", flush=True)
        result["commands"].append(dict(line=line, command=script_of(line), wall_s=round(wall), cpu_s=round(cpu)))
        read_output(result, line, p.stdout, work)
        if script_of(line) == "train_a2.py":
            run = work / "runs" / shlex.split(line)[shlex.split(line).index("--run-name") + 1]
    result["tree"] = [f"runs/{run.name}/"] + ["  " + x for x in tree(run)]  # after infer.py and demo.py wrote theirs
    return result


def read_output(result: dict, line: str, out: str, work: Path) -> None:
    """What a command of the block printed or wrote, into `result`: demo.py's distances and colour matches, the size
    of infer.py's video and the size its log gives."""
    if script_of(line) == "demo.py":
        d = re.search(r"base ([\d.]+), LoRA ([\d.]+) \(lower is closer\)", out)
        result["distance"] = dict(base=float(d[1]), lora=float(d[2]))
        found = re.findall(r"^\S+_(person|object): its colour(?:, the (\w+)'s,)? .*?: base (-?[\d.]+), "
                           r"LoRA (-?[\d.]+)$", out, re.M)
        result["match"] = {m[0]: dict(base=float(m[2]), lora=float(m[3])) for m in found}
        # make-sample draws the subject (_person) as a square, the object as a disc; demo.py says which it saw
        assert all(m[1] in ("", SHAPES[m[0]]) for m in found) and len(found) == 2, out
    if script_of(line) == "infer.py":
        out_file = shlex.split(line)[shlex.split(line).index("--out") + 1]
        result["video"] = dict(zip(("width", "height", "frames"), video_size(work / out_file)))
        result["log_size"] = re.search(r"^wrote .*\(\d+ frames, (\d+x\d+)", out, re.M)[1]


def render(m: dict) -> str:
    """The README's numbers block for a measured run (the block between its markers): the measurements as JSON in a
    comment (tests/test_docs.py renders them again and compares), then the text they make."""
    rows = "\n".join(f"| `{c['command']}` | {c['wall_s']} s | {c['cpu_s']} s |" for c in m["commands"])
    total = sum(c["wall_s"] for c in m["commands"])
    d, sq, disc = m["distance"], m["match"]["person"], m["match"]["object"]
    v = m["video"]
    text = (f"<!-- measured {json.dumps(m)} -->\n"
            f"Measured by `python3 scripts/readme_numbers.py {m['block']}` on {m['date']}: {m['cores']} CPU cores, "
            f"load average {m['load']} at the start, OMP_NUM_THREADS={m['threads']}.\n\n"
            f"| command | wall | CPU |\n|---|---|---|\n{rows}\n| all | {total} s | |\n\n"
            f"demo.py: distance to the clip {d['lora']:.3f} (LoRA) against {d['base']:.3f} (base); colour match "
            f"{sq['lora']:.2f} (square) and {disc['lora']:.2f} (disc) against the base's {sq['base']:.2f} and "
            f"{disc['base']:.2f}. infer.py's video: {v['width']} pixels wide, {v['height']} high, {v['frames']} "
            f"frames: the log's {m['log_size']} (height x width) video with the references tiled to its left.\n")
    if "tree" in m and m["block"] == "smoke":
        text += "\n```\n" + "\n".join(m["tree"]) + "\n```\n"
    return text


def rewrite(name: str, block: str) -> None:
    text = README.read_text()
    pattern = re.compile(NUMBERS.format(name), re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no '<!-- numbers {name} -->' ... '<!-- /numbers {name} -->' block")
    README.write_text(pattern.sub(lambda m: m[1] + block + m[3], text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("block", choices=("smoke", "main"))
    ap.add_argument("--work", help="the dir to run in (default: a new temporary dir)")
    ap.add_argument("--from-json", help="render a run measured before (its JSON) instead of running")
    a = ap.parse_args()
    if a.from_json:
        m = json.loads(Path(a.from_json).read_text())
    else:
        work = clone(Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix=f"a2-{a.block}-")))
        m = measure(a.block, work)
        saved = ROOT / "runs" / "readme_numbers" / f"{a.block}.json"
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(m, indent=1))
        print(f"measured in {work}; saved {saved}")
    rewrite(a.block, render(m))
    print(f"README.md: block '{a.block}' rewritten")


if __name__ == "__main__":
    main()
