"""The docs cannot rot: every flag a doc names is a flag of the command it follows, every link into the docs lands,
no project file points outside the project, the JSON dataset format's tables are the loader's keys and defaults, and
the commands the docs mark (`<!-- test NAME: run -->` before a code block; `file X` writes the block to X first) run
as written, in a directory laid out as a clone: `python3 X.py ...` and `python3 -m M ...` in this process (runpy, as
`__main__`, so each second is not spent importing torch again), other lines and whole shell scripts with bash."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, assert_their_motion

DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
MARKED = re.compile(r"<!-- test ([\w-]+): (run|file (\S+)) -->\n```\w*\n(.*?)^```", re.M | re.S)


def logical_lines(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, blank and comment lines dropped."""
    joined = text.replace("\\\n", " ").splitlines()
    return [line for line in joined if line.strip() and not line.lstrip().startswith("#")]


def words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an apostrophe in prose-like text: the flags are still whitespace-separated
        return line.split()


# ---------------------------------------------------------------- flags


def cli_flags() -> dict[str, set[str]]:
    """The flags of every command the docs run: a script (data.py by subcommand), a module, torchrun."""
    from torch.distributed.run import get_args_parser

    import config
    from a2.cli import option_names

    def of(cls):
        return set(option_names(cls)) | {"--help"}

    return {"train_a2.py": of(config.TrainConfig), "scripts/multinode.sbatch": of(config.TrainConfig),
            "infer.py": of(config.InferConfig), "bench.py": of(config.BenchConfig), "demo.py": of(config.DemoConfig),
            "a2.eval.opens2v": of(config.OpenS2VConfig), "data.py make-sample": of(config.MakeSample),
            "data.py validate": of(config.Validate), "data.py index opens2v": of(config.IndexOpenS2V),
            "data.py index phantom": of(config.IndexPhantom), "data.py index humoset": of(config.IndexHumoSet),
            "data.py index kaleido": of(config.IndexKaleido),
            "data.py export-elements": of(config.ExportElements),
            "torchrun": {o for a in get_args_parser()._actions for o in a.option_strings}}


def known(flag: str, flags: set[str]) -> bool:
    """tyro's --no-FLAG (and --section.no-flag) of a bool, and --flag=value, are the flag."""
    flag = flag.partition("=")[0]
    return flag in flags or re.sub(r"(^--|\.)no-", r"\1", flag) in flags


def commands(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """(the command, the flags given to it) for each command in a shell line's words: torchrun's own flags, then the
    script's after it; a shell operator ends a command."""
    out, cmd = [], None
    for i, t in enumerate(tokens):
        t = t.strip("[]")
        if t in ("&&", "||", "|", ";", "&") or t.endswith(";"):
            cmd = None
        elif t == "torchrun":
            cmd = "torchrun"
            out.append((cmd, []))
        elif t in ("train_a2.py", "infer.py", "bench.py", "demo.py", "scripts/multinode.sbatch") or \
                t == "a2.eval.opens2v" and tokens[i - 1] == "-m":
            cmd = t
            out.append((cmd, []))
        elif t == "data.py":
            rest = [x for x in tokens[i + 1:i + 3]]
            cmd = "data.py " + (" ".join(rest) if rest[:1] == ["index"] else rest[0])
            out.append((cmd, []))
        elif cmd and t.startswith("--"):
            out[-1][1].append(t)
    return out


def code_spans(text: str) -> tuple[list[str], list[str]]:
    """A page's shell code blocks (logical lines) and its inline code spans outside them."""
    blocks = [line for lang, body in FENCE.findall(text) if lang in ("", "bash", "sh") for line in logical_lines(body)]
    prose = FENCE.sub("", text)
    return blocks, re.findall(r"`([^`\n]+)`", prose)


def test_every_flag_a_doc_names_exists():
    """Each `--flag` in a command of a code block (README.md, docs/*.md) is a flag of the command it follows; a flag in
    an inline code span is a flag of the command the span starts with, or else of some a2 command. A doc's flag that
    no command takes (renamed, removed, mistyped) names the page and the line."""
    clis = cli_flags()
    everything = set().union(*clis.values())
    bad, seen = [], 0
    for page in PAGES:
        lines, spans = code_spans(page.read_text())
        for line in lines + [s for s in spans if re.match(r"(python3 |torchrun |(train_a2|infer|bench|demo)\.py)", s)]:
            for cmd, flags in commands(words(line)):
                seen += len(flags)
                bad += [f"{page.name}: {cmd} {f}  ({line[:80]})" for f in flags if not known(f, clis[cmd])]
        for span in spans:
            if not re.match(r"(python3? |torchrun |(train_a2|infer|bench|demo)\.py)", span):  # a command: checked
                for f, section in re.findall(r"(?<![\w-])(--[a-z][\w.-]*?\w)(\.\*)?(?![\w.-])", span):
                    seen += 1
                    bad += [f"{page.name}: `{span}`: {f} is no flag"] if not (section or known(f, everything)) else []
    assert seen > 300 and not bad, "\n".join(bad)


def test_the_flag_check_catches_a_flag_that_does_not_exist():
    clis = cli_flags()
    (cmd, flags), = commands(words("python3 train_a2.py --model tiny --num-frame 33 --no-val-metrics"))
    assert cmd == "train_a2.py" and [f for f in flags if not known(f, clis[cmd])] == ["--num-frame"]
    torch_cmd, script = commands(words("torchrun --nnodes 2 --nproc_per_node 8 train_a2.py --fsdp --nnodes 2"))
    assert torch_cmd == ("torchrun", ["--nnodes", "--nproc_per_node"]) and script == ("train_a2.py", ["--fsdp",
                                                                                                      "--nnodes"])
    assert not known("--nnodes", clis["train_a2.py"]) and known("--eval.no-motion-fb", clis["a2.eval.opens2v"])


# ---------------------------------------------------------------- links, and nothing outside the project


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces to -."""
    heads = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_link_between_the_docs_lands():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: ({target})")
    assert not bad, "\n".join(bad)


# the SkyReels-A2 example photos: optional, not redistributable (tests/media/README.md), read beside a checkout
OPTIONAL_PHOTOS = {"tests/conftest.py", "tests/media/README.md"}


def test_no_project_file_points_outside_the_project():
    """No file of the project (docs, code, --help texts) sends a user to ../shared or the design documents, which a
    clone does not have; the tests' optional SkyReels-A2 photos are the one exception (they are not redistributable)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"\.\./shared|/ \"shared\"|DESIGN\.md|design doc", re.I)
    hits = [f"{f}:{n}: {line.strip()[:100]}" for f in files if f not in OPTIONAL_PHOTOS | {"tests/test_docs.py"}
            and Path(ROOT / f).suffix in (".py", ".md", ".sh", ".sbatch", ".toml", ".txt", ".json")
            and (ROOT / f).is_file()
            for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not hits, "\n".join(hits)


# ---------------------------------------------------------------- the JSON dataset format's tables


def table(section: str) -> dict[str, list[str]]:
    """The rows of the first table under docs/dataset.md's heading `section`: first cell's names -> the other cells."""
    text = (ROOT / "docs" / "dataset.md").read_text()
    body = text.split(f"\n{section}\n", 1)[1]
    rows = re.findall(r"^\| (?!key |---)(.*) \|$", body.split("\n#", 1)[0], re.M)
    return {name: cells[1:] for row in rows for cells in [row.split(" | ")]
            for name in re.findall(r"`([\w.]+)(?::[^`]*)?`", cells[0])}


def allowed_keys(tmp_path, dataset: dict) -> set[str]:
    """The keys the loader allows where `dataset` puts an unknown one, from its one-line error."""
    from a2.cli import ConfigError
    from a2.config.dataset_config import load_dataset_config

    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"datasets": [dataset]}))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['zzz'\]; allowed: ") as e:
        load_dataset_config(f)
    return set(json.loads(str(e.value).split("allowed: ")[1].replace("'", '"')))


def documented_default(cell: str):
    """A default cell's JSON value (`[480, 832]`, `"e2v"`, 1.0, null ...), or None where it is prose."""
    value = cell.split(" (")[0].strip().strip("`")
    try:
        return json.loads(value)
    except ValueError:
        return "prose"


def test_the_json_format_tables_are_the_loaders_keys_and_defaults(tmp_path):
    """Every key docs/dataset.md lists is a key the loader takes, and every key the loader takes is listed (a dataset,
    processors.vae / .clip, an element in both forms, visualization); each JSON default it states is the loaded
    value of a file that leaves the key out."""
    from a2.config.dataset_config import VisualizationConfig, load_dataset_config

    z = {"zzz": 1}
    dataset, vae, clip = table("### A dataset"), table("### `processors.vae`: the conditioning"), \
        table("### `processors.clip`")
    element, vis = table("### An element"), table("### `visualization`")
    assert set(dataset) | {"processors"} == allowed_keys(tmp_path, {"data_root": "x", **z})
    assert set(vae) == allowed_keys(tmp_path, {"data_root": "x", "processors": {"vae": z}})
    assert set(clip) == allowed_keys(tmp_path, {"data_root": "x", "processors": {"clip": z}})
    assert {k.split(".")[0] for k in element} == allowed_keys(tmp_path, {"data_root": "x", "elements": [
        {"name": "a", "suffixes": "_a.png", **z}]})
    assert {k[4:] for k in element if k.startswith("vae.")} == allowed_keys(tmp_path, {"data_root": "x", "elements": [
        {"name": "a", "suffixes": "_a.png", "vae": z}]})
    assert set(vis) == {f.name for f in fields(VisualizationConfig)}

    plain, one = tmp_path / "plain.json", tmp_path / "one.json"  # every key left out; one element, its keys left out
    plain.write_text(json.dumps({"datasets": [{"data_root": "x"}]}))
    one.write_text(json.dumps({"datasets": [{"data_root": "x", "elements": [{"name": "a", "suffixes": "_a.png"}]}]}))
    (ds,), ((el,),) = load_dataset_config(plain), [load_dataset_config(one)[0].elements]
    as_json = lambda v: json.loads(json.dumps(v))  # noqa: E731  (tuples as lists)
    aliases = {"clip_resolution": ds.clip.resolution, "vae_combine": ds.vae.combine}
    checked = 0
    for rows, obj in ((dataset, ds), (vae, ds.vae), (clip, ds.clip), (vis, ds.visualization),
                      ({"required": element["required"], "repeat": element["vae.repeat"]}, el)):
        for key, cells in rows.items():
            want = documented_default(cells[1])
            if want != "prose" and (key in aliases and obj is ds or key in {f.name for f in fields(obj)}):
                got = aliases[key] if key in aliases and obj is ds else getattr(obj, key)
                assert as_json(got) == want, (key, got, want)
                checked += 1
    assert checked >= 25


# ---------------------------------------------------------------- the README's numbers


def test_the_readmes_numbers_are_what_the_script_measured():
    """Each `<!-- numbers NAME -->` block of the README is what scripts/readme_numbers.py writes from the measurements
    it holds (rendered again here: a number typed over the text differs), and those measurements timed the commands of
    the README's quick-start blocks NAME as they stand (a command changed since makes the numbers stale). Timings are
    not checked: they depend on the machine."""
    spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "scripts" / "readme_numbers.py")
    readme_numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_numbers)
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- numbers (\w+) -->\n(.*?)<!-- /numbers \1 -->", text, re.S)
    assert [name for name, _ in blocks] == ["smoke", "main"]
    for name, block in blocks:
        m = json.loads(re.match(r"<!-- measured (.*) -->\n", block)[1])
        assert block == readme_numbers.render(m), name
        assert [c["line"] for c in m["commands"]] == readme_numbers.commands(name, text), name


# ---------------------------------------------------------------- the docs' commands, run as written


def clone(tmp_path: Path) -> Path:
    """A dir laid out as a clone of the project (its top-level files and dirs linked), where the docs' relative paths
    (train_a2.py, tests/media/...) resolve and what the commands write stays."""
    work = tmp_path / "clone"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs", "outputs") and not entry.name.startswith("."):
            (work / entry.name).symlink_to(entry)
    return work


def run_python(argv: list[str]) -> int:
    """`python3 SCRIPT ARGS` / `python3 -m MODULE ARGS` in this process, as __main__; its exit status."""
    saved = sys.argv, {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if argv[0] == "-m":  # the module's file as __main__ (run_module warns when the module is imported already)
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_path(importlib.util.find_spec(argv[1]).origin, run_name="__main__")
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved[0]
        for s, handler in saved[1].items():
            signal.signal(s, handler)


def python_first() -> dict[str, str]:
    """The environment with this interpreter's dir first on PATH: a doc's `python3 -c ...` run by bash is the python
    of the suite (with its packages), as in the activated environment the README sets up."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def run_doc(name: str, page: str, work: Path) -> list[str]:
    """The blocks marked `name` in docs/`page`, in order: files written, commands run (each must exit 0)."""
    blocks = [m for m in MARKED.finditer((ROOT / "docs" / page).read_text()) if m[1] == name]
    assert blocks, f"docs/{page} marks no block '{name}'"
    ran = []
    for m in blocks:
        if m[3]:
            (work / m[3]).write_text(m[4])
            continue
        for line in logical_lines(m[4]):
            argv = words(line)
            if argv[0] == "python3" and argv[1] != "-c":  # (a -c one-liner runs in bash)
                assert not {"&&", "|", ";", "&"} & set(argv), line
                code = run_python(argv[1:])
            else:
                code = subprocess.run(["bash", "-c", line], cwd=work, env=python_first()).returncode
            assert code == 0, f"exit {code}: {line}"
            ran.append(line)
    return ran


@pytest.fixture
def work(tmp_path, monkeypatch):
    work = clone(tmp_path)
    monkeypatch.chdir(work)
    return work


def test_the_json_dataset_example_validates_and_trains(work, capsys):
    """docs/dataset.md's complete example: written as e2v.json, its data made, `data.py validate` and a 2-step run
    with it as the doc gives them: three datasets (one held out), the buckets the text promises, the visualisations
    its block asks for, and the eval loss of the held-out clip."""
    from a2.config.dataset_config import load_dataset_config

    ran = run_doc("dataset-example", "dataset.md", work)
    assert [c.split()[1] for c in ran] == ["data.py"] * 4 + ["train_a2.py"]
    out = capsys.readouterr().out
    assert out.count("dataset: 7 samples from 3 dataset(s)") == 2  # validate's summary, then training's
    assert "bucket 21 frames 64x64 [subject, object, background]: 4 samples" in out
    assert "held out for the eval loss (never trained on): 1 sample(s)" in out
    cfgs = load_dataset_config(work / "e2v.json")
    assert [(Path(c.data_root).name, c.weight, c.eval) for c in cfgs] == [
        ("sample_data", 1.0, False), ("more_data", 0.5, False), ("held_out", 1.0, True)]
    run = work / "runs" / "json-demo"
    assert sorted(p.name for p in (run / "visualizations" / "json-demo").iterdir()) == [
        "step0000002_input_latents.pt", "step0000002_predicted_latents.pt", "step0000002_predicted_latents_f-1.png",
        "step0000002_predicted_latents_f0.png"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/loss" in m and m["step"] == 2 for m in metrics)
    assert (run / "pytorch_lora_weights.safetensors").is_file()


def test_every_visualized_tensor_is_one_training_writes(tmp_path):
    """a2.config.dataset_config.VISUALIZED, which the loader checks a visualization block's `data` against, names
    exactly the tensors the training step (a2/train/step.py: forward_loss) hands to the visualisations."""
    import ast

    from a2.config.dataset_config import VISUALIZED

    tree = ast.parse((ROOT / "a2" / "train" / "step.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "forward_loss")
    viz = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "viz" for t in n.targets))
    assert sorted(k.arg for k in viz.keywords) == sorted(VISUALIZED)


# docs/howto.md's sections: each built-in tiny model's (a2/model/tiny.py TINY_MODELS) and the kinds its heading names
HOWTOS = {"howto-tiny": {"prefix"}, "howto-tiny-t2v": {"t2v"}, "howto-tiny-phantom": {"phantom"},
          "howto-tiny-v3": {"v3"}, "howto-tiny-magref": {"magref"}, "howto-tiny-refalign": {"refalign"},
          "howto-tiny-ti2v": {"clean"}, "howto-tiny-wan22": {"t2v", "prefix"}, "howto-tiny-vace": {"vace"},
          "howto-tiny-kaleido": {"kaleido"}}


def test_every_tiny_model_has_a_howto():
    """Every built-in tiny model (a2/model/tiny.py's TINY_MODELS, the real-size random ones aside) is trained and
    sampled by a how-to section of docs/howto.md that the test below runs; each section's heading names the kinds it
    trains."""
    from a2.model.tiny import TINY_MODELS

    text = (ROOT / "docs" / "howto.md").read_text()
    blocks = {m[1]: m[4] for m in MARKED.finditer(text)}
    models = {w[i + 1] for name in HOWTOS for line in logical_lines(blocks[name]) for w in [words(line)]
              for i, t in enumerate(w) if t == "--model"}
    assert models == {m for m in TINY_MODELS if m.startswith("tiny")}
    for name, kinds in HOWTOS.items():
        head = text[:text.index(f"<!-- test {name}: run -->")].rsplit("\n## ", 1)[1].split("\n")[0]
        assert set(re.findall(r"`(\w+)`", re.search(r"\(kinds? (.*)\)$", head)[1])) == kinds, (name, head)


@pytest.fixture(scope="module")
def howto_data(tmp_path_factory) -> Path:
    """docs/howto.md's sample data, made once by its command as written (no command of a section writes into it)."""
    made = clone(tmp_path_factory.mktemp("howto"))
    cwd = Path.cwd()
    os.chdir(made)
    try:
        run_doc("howto-data", "howto.md", made)
    finally:
        os.chdir(cwd)
    return made / "sample_data"


@pytest.mark.parametrize("name", HOWTOS)
def test_each_tiny_models_howto_trains_and_samples(work, howto_data, capsys, name):
    """docs/howto.md's section `name` as written, on the page's sample data: each training run exports its LoRA, each
    infer.py writes its video, and they train and sample the kinds the section's heading names (the logs say which)."""
    (work / "sample_data").symlink_to(howto_data)
    capsys.readouterr()
    ran = run_doc(name, "howto.md", work)
    out = capsys.readouterr().out
    assert set(re.findall(r"\bkind (\w+)", out)) == HOWTOS[name], out[-3000:]
    for line in ran:
        w = words(line)
        if w[1] == "train_a2.py":
            run = work / "runs" / w[w.index("--run-name") + 1]
            assert list(run.glob("pytorch_lora_weights*.safetensors")), line
        else:
            assert (work / w[w.index("--out") + 1]).stat().st_size > 0, line


def test_the_stand_in_commands_train_and_sample(work, howto_data, capsys):
    """docs/howto.md's Stand-In commands on tiny-t2v: the run exports Stand-In's own file, and infer.py, given it,
    samples as Stand-In (the file chooses the kind)."""
    (work / "sample_data").symlink_to(howto_data)
    run_doc("standin", "howto.md", work)
    out = capsys.readouterr().out
    assert "kind standin" in out and "Stand-In LoRA runs/standin/standin_lora.ckpt: rank 128" in out
    assert (work / "runs" / "standin" / "standin_lora.ckpt").is_file()
    assert (work / "runs" / "standin" / "sample.mp4").stat().st_size > 0


def test_the_vace_commands_train_and_sample(work, howto_data, capsys):
    """docs/howto.md's VACE commands on tiny-vace: the masked clip its own bucket, a LoRA of the context blocks
    alone, sampled with a reference, a control video and its mask; the mask in a data dir of its own, so that
    sample_data validates as make-sample wrote it."""
    from safetensors import safe_open

    (work / "sample_data").symlink_to(howto_data)
    before = sorted(p.name for p in howto_data.iterdir())
    run_doc("vace", "howto.md", work)
    assert sorted(p.name for p in howto_data.iterdir()) == before  # the mask went into a data dir of its own
    out = capsys.readouterr().out
    assert "kind vace" in out and "ref2, clip mask]: 1 samples" in out, out[-3000:]
    with safe_open(work / "runs" / "vace" / "pytorch_lora_weights.safetensors", "pt") as f:
        assert {k.split(".")[1] for k in f.keys()} == {"vace_blocks"}
    assert (work / "runs" / "vace" / "sample.mp4").stat().st_size > 0


def test_the_evaluation_commands_score_base_and_lora(work, capsys):
    """docs/evaluation.md's eval.jsonl and commands: each row rendered base | LoRA, a row per video and element in
    metrics.jsonl, the table of means, and the note that the tiny encoder's numbers are noise."""
    run_doc("evaluation", "evaluation.md", work)
    out = capsys.readouterr().out
    assert sorted(p.name for p in (work / "eval").glob("*.mp4")) == [
        "000_a-person-beside-a-square-and-a-disc.mp4", "001_a-person.mp4"]
    rows = [json.loads(line) for line in (work / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert {(r["index"], r["model"]) for r in rows} >= {(0, "base"), (0, "lora"), (1, "base"), (1, "lora")}
    assert re.search(r"^metric +base +lora +delta$", out, re.M) and "their values are noise" in out


def test_the_opens2v_demo_command_gives_their_motion_and_a_partial_total(work, capsys):
    """docs/evaluation.md's OpenS2V-Eval command on their two demo videos: MotionAmplitude their JSON's, a
    partial TotalScore labelled with what it covers, never a leaderboard row."""
    run_doc("opens2v-demo", "evaluation.md", work)
    out = capsys.readouterr().out
    demo = work / "opens2v" / "demo"
    their = json.loads((ROOT / "tests" / "media" / "opens2v_eval" / "motion_amplitude.json").read_text())
    ours = json.loads((demo / "opens2v_json" / "motion_amplitude.json").read_text())
    assert len(ours) == 2
    assert_their_motion(ours, their)  # to the last digit under the locked OpenCV
    assert "partial TotalScore over 1 of 7 metrics" in out and "2 of 180 videos" in out
    assert json.loads((demo / "opens2v_Open-Domain.json").read_text())["partial"]


def test_the_loopback_smoke_command_trains_on_two_nodes(tmp_path):
    """docs/multinode.md's loopback command, run as written by bash (a free port in A2_RDZV_PORT): two torchrun
    "nodes" of 2 ranks, context parallel 2, 3 steps; both exit 0, each node builds its own tiny model, one checkpoint
    and one export are written. ~40 s on a 2-core CPU."""
    work = clone(tmp_path)
    (m,) = [m for m in MARKED.finditer((ROOT / "docs" / "multinode.md").read_text()) if m[1] == "loopback"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**python_first(), "A2_RDZV_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(["bash", "-c", m[4]], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    assert "global batch 2 = micro 1 x accum 1 x world 2 (x context parallel 2)" in log
    assert all((work / "smoke_cache" / f"node{n}").is_dir() for n in range(2))
    run = work / "runs" / "smoke"
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-0000003"] and not list(run.glob(".tmp-*"))
    assert (run / "pytorch_lora_weights.safetensors").is_file()


# ---------------------------------------------------------------- sentences that state a behaviour, held


def test_the_default_elements_and_an_options_defaults_are_the_docs(tmp_path):
    """docs/dataset.md: "An option left out is `repeat=1`, `vae=resize`, `clip=pad_white`, not required.
    `--elements` left out: SkyReels-A2's three, `subject=...`, `object=...`, `background=...`": the specs are read
    from that sentence and parsed, so the defaults and the doc cannot part."""
    from a2.elements import A2_ELEMENTS, parse_elements

    text = " ".join((ROOT / "docs" / "dataset.md").read_text().split())
    sentence = text.split("An option left out is ", 1)[1].split("(none with", 1)[0]
    left_out = re.match(r"`repeat=(\d+)`, `vae=(\w+)`, `clip=(\w+)`, not required", sentence)
    (e,) = parse_elements(["subject=_p.png"])
    assert (str(e.repeat), e.vae_preprocess, e.clip_preprocess, e.required) == (*left_out.groups(), False)
    specs = re.findall(r"`((?:subject|object|background)=[^`]+)`", sentence.replace(", ", ","))
    assert len(specs) == 3 and tuple(parse_elements(specs)) == A2_ELEMENTS, specs


def test_infer_tiles_the_references_left_of_the_video_unless_told_not_to(tmp_path):
    """README: "`infer.mp4` shows the reference images tiled to the left of the video (as A2's own `infer.py`
    does; `--no-side-by-side` writes the video alone)": the default file is (references + 1) tiles of the video's
    width, its first tile the subject as framed, its last the video `--no-side-by-side` writes alone (same seed; the
    tiles are compared through the encoder, which rounds each file apart: within 6 of 255 levels on average)."""
    import av
    import numpy as np

    import infer
    from a2.cli import parse_cli
    from a2.images import preprocess_image
    from config import InferConfig
    from tests.conftest import drawn_person

    h, w = 32, 48
    paths = []
    for i, size in enumerate(((40, 28), (40, 28), (28, 40))):
        paths.append(str(tmp_path / f"e{i}.png"))
        drawn_person(size, seed=i).save(paths[-1])
    run = ["--model", "tiny", "--resolution", str(h), str(w), "--num-frames", "21", "--steps", "2", "--device", "cpu",
           "--elements", *paths]

    def frames(name, *extra):
        assert infer.main(parse_cli(InferConfig, args=[*run, *extra, "--out", str(tmp_path / name)])) == 0
        with av.open(str(tmp_path / name)) as f:
            return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]).astype(np.float32)

    tiled, alone = frames("tiled.mp4"), frames("alone.mp4", "--no-side-by-side")
    assert alone.shape[1:3] == (h, w) and tiled.shape[1:3] == (h, 4 * w) and len(tiled) == len(alone)
    assert np.abs(tiled[:, :, 3 * w:] - alone).mean() < 6
    from PIL import Image

    subject = np.asarray(preprocess_image(Image.open(paths[0]), "pad_white", (h, w)), dtype=np.float32)
    assert np.abs(tiled[:, :, :w] - subject).mean() < 6 < np.abs(alone - subject).mean()


def test_a_dry_run_plans_for_an_80_gib_card_by_default():
    """docs/memory.md: a dry run exits 0 "if it fits `--max-memory-gb` (default 80), 3 if not": without the flag the
    plan's budget and the printed card are 80 GiB (the 1.3B step cut to 2 blocks, a second on fake tensors)."""
    from bench import BenchConfig, bench_dry_run
    from config import MemoryConfig

    printed = []
    r = bench_dry_run(BenchConfig(preset="1.3B", refs=0, frames=5, height=64, width=64,
                                  memory=MemoryConfig(dry_run=True)), layers=2, log=printed.append)
    assert r["plan"].budget_gb == 80 and r["fits"]
    assert "fits: 80.0 GiB card" in "\n".join(printed)


def test_lora_scale_scales_an_ordinary_lora(tmp_path):
    """docs/interop.md: "`--lora-scale` scales the ordinary ones": at 0 the LoRA adds exact zeros (the base model's
    latents bit for bit: the same ops on the same values), at 1 and at 0.5 it changes them, each differently."""
    from a2.model.tiny import model_path
    from a2.train.lora import export_lora
    from config import LORA_TARGETS
    from tests.conftest import drawn_person
    from tests.test_lora import adapted_pipe
    from tests.test_promises import sample

    lora, _ = export_lora(tmp_path / "run", adapted_pipe(model_path("tiny"), LORA_TARGETS).transformer)
    drawn_person((40, 28)).save(tmp_path / "me.png")
    run = ["--model", "tiny", "--resolution", "32", "48", "--num-frames", "9", "--steps", "2", "--device", "cpu",
           "--elements", str(tmp_path / "me.png")]
    base, _ = sample(run, tmp_path / "base")
    at = {s: sample([*run, "--lora", str(lora), "--lora-scale", s], tmp_path / s)[0] for s in ("0", "0.5", "1")}
    assert torch.equal(at["0"], base)
    assert min((at[a] - at[b]).abs().max().item() for a, b in (("0", "0.5"), ("0.5", "1"), ("0", "1"))) > 1e-4
