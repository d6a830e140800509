"""Every CLI documents every option in --help, and one thing has one name across the CLIs (or both names work)."""

import ast
import os
import subprocess
import sys

import pytest
import tyro

from tests.conftest import ROOT

# the dataclasses tyro parses (every CLI's, a2/data/public_index.py's indexes among them), and every config dataclass
# (the JSON dataset config's fields too): in config.py and the modules below it, which import no torch
CLI_CLASSES = {"config.py": None, "a2/config/dataset_config.py": None, "a2/elements.py": None}


def undocumented_fields(path, classes=None):
    """`file: Class.field` for each dataclass field not followed by a docstring (what tyro shows as its help)."""
    missing = []
    for cls in ast.parse(path.read_text()).body:
        if not isinstance(cls, ast.ClassDef) or not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
            continue
        if classes is not None and cls.name not in classes:
            continue
        for node, nxt in zip(cls.body, cls.body[1:] + [None]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(
                    nxt.value.value, str)
                if not doc:
                    missing.append(f"{path.name}: {cls.name}.{node.target.id}")
    return missing


def test_every_field_has_a_docstring(tmp_path):
    assert [m for f, classes in CLI_CLASSES.items() for m in undocumented_fields(ROOT / f, classes)] == []
    # the check sees a missing docstring (and a comment above a field does not count as one)
    (tmp_path / "x.py").write_text("@dataclass\nclass A:\n    a: int = 1\n    \"\"\"doc\"\"\"\n    # section\n"
                                   "    b: int = 2\n")
    assert undocumented_fields(tmp_path / "x.py") == ["x.py: A.b"]


def help_text(capsys, monkeypatch, cli, args):
    """What `--help` prints, in process (tyro prints and exits 0)."""
    monkeypatch.setenv("COLUMNS", "120")  # one column: tyro sets the sections' boxes side by side when wider
    with pytest.raises(SystemExit) as e:
        cli(args + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def option_help(text, option):
    """The help of `option` in tyro's box layout: its lines up to the next option."""
    lines = [ln.strip("│ ").rstrip() for ln in text.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith(option + " ") or ln == option
                 or ln.startswith(option + ","))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("-")), len(lines))
    return " ".join(lines[start:end])


def test_help(capsys, monkeypatch):
    import bench
    import data
    import infer
    from config import TrainConfig

    text = help_text(capsys, monkeypatch, lambda a: tyro.cli(TrainConfig, args=a), [])
    lr = option_help(text, "--lr")
    assert "learning rate" in lr and "optimisation" not in lr, lr
    assert "optimisation" not in option_help(text, "--weight-decay")
    assert "143" in option_help(text, "--resume")
    assert "lora" in option_help(help_text(capsys, monkeypatch, lambda a: tyro.cli(infer.InferConfig, args=a), []),
                                 "--lora")
    assert "--num-frames" in help_text(capsys, monkeypatch, lambda a: tyro.cli(bench.BenchConfig, args=a), [])
    assert "--num-samples" in help_text(capsys, monkeypatch, data._cli, ["make-sample"])
    assert "--data-root" in help_text(capsys, monkeypatch, data._cli, ["validate"])
    # the script itself: `python3 data.py --help` lists the subcommands and exits 0
    r = subprocess.run([sys.executable, str(ROOT / "data.py"), "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"}, timeout=300)
    assert r.returncode == 0 and "make-sample" in r.stdout and "validate" in r.stdout, r.stderr[-2000:]
    assert "Index a public S2V dataset" in r.stdout and "Union" not in r.stdout  # not typing.Union's docstring


def test_bench_layout_choices_are_the_kinds():
    """config.KIND_NAMES (bench.py --layout's choices, read before torch is imported) are a2/kinds/kinds.py's kinds."""
    from a2.kinds.kinds import KIND_DEFS
    from config import KIND_NAMES

    assert KIND_NAMES == tuple(KIND_DEFS)


def test_resolution_is_one_name_across_clis():
    import bench
    import infer

    # infer.py's default model is the built-in tiny one, sampled at 64x64 unless told (infer.resolve, in its main)
    for cls, default in ((infer.InferConfig, (64, 64)), (bench.BenchConfig, (64, 64))):
        def parse(*argv, cls=cls):  # the size a run uses, from a config left as parsed
            cfg = tyro.cli(cls, args=list(argv))
            return infer.resolve(cfg)[0].resolution if cls is infer.InferConfig else cfg.size

        assert parse("--resolution", "32", "48") == parse("--height", "32", "--width", "48") == (32, 48)
        assert parse() == default
        with pytest.raises(ValueError, match="disagree"):
            cls(resolution=(32, 48), height=64)
    assert tyro.cli(bench.BenchConfig, args=["--num-frames", "9"]).frames == 9
    assert tyro.cli(bench.BenchConfig, args=["--training-type", "full", "--micro-batch", "2"]).mode == "full"


HEAVY = ("torch", "diffusers", "transformers", "peft", "a2")  # what a script imports after parsing its flags
# config.py's own modules: tyro and the standard library only (anything heavy they imported would be listed above)
# the folders' __init__.py are empty: importing one costs nothing
LIGHT = ("a2", "a2.config", "a2.data", "a2.eval", "a2.kinds", "a2.memory", "a2.model", "a2.train", "a2.cli",
         "a2.elements", "a2.config.dataset_config", "a2.config.sections")


@pytest.mark.parametrize("script, argv, typo, mistakes", [
    ("train_a2.py", [], "--modle", [["--data-root", "x", "--resolution", "30", "30"],  # not multiples of 16
                                    ["--data-root", "x", "--num-frames", "32"],  # not 4k+1
                                    ["--data-root", "x", "--lr", "abc"]]),  # not a number (tyro's own answer)
    ("infer.py", [], "--prompt-file", [["--resolution", "32", "48", "--height", "64"],  # the two forms disagree
                                       ["--height", "60", "--width", "60"], ["--num-frames", "32"]]),
    ("bench.py", [], "--num-frame", [["--layout", "nope"], ["--num-frames", "32"], ["--compare-run", "no-run"]]),
    ("data.py", ["make-sample", "out"], "--num-sample", [["--num-frames", "0"], ["--height", "31"]]),
    ("data.py", ["validate"], "--data-roo", [["--data-root", "x", "--resolution", "30", "30"],
                                             ["--data-root", "x", "--num-frames", "32"]]),
    ("demo.py", ["runs/x"], "--clp", [["--frames", "0"]]),
    ("-m a2.eval.opens2v", [], "--vidoes", [["--videos", "x"],  # --eval-set missing
                                            ["--videos", "x", "--eval-set", "y", "--eval.dino", "z"]]),  # not theirs
])
def test_help_a_typo_and_a_config_error_answer_before_the_heavy_imports(script, argv, typo, mistakes):
    """--help, a flag typo (one line naming the closest flag) and a config error (one line: a value the model cannot
    take, a value of the wrong type, a choice that is none of the choices) exit before torch, diffusers or a2 are
    imported (python -X importtime lists every module a run imports): seconds, not the heavy imports' ~9 s."""
    for args, code in ((argv + ["--help"], 0), (argv + [typo, "x"], 2), *((argv + m, 2) for m in mistakes)):
        run = script.split() if script.startswith("-m ") else [str(ROOT / script)]  # python3 -m: a2 itself, empty
        r = subprocess.run([sys.executable, "-X", "importtime", *run, *args], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"}, timeout=120, cwd=ROOT)
        timings = [ln for ln in r.stderr.splitlines() if ln.startswith("import time:")]
        heavy = sorted(m for m in (ln.rsplit("|", 1)[1].strip() for ln in timings)
                       if m.split(".")[0] in HEAVY and m not in LIGHT)
        said = [ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")]
        assert len(timings) > 50 and r.returncode == code and heavy == [], (args, r.returncode, heavy[:5], said[-5:])
        if args[-2:] == [typo, "x"]:
            assert len(said) == 1 and said[0].startswith(f"error: unknown option {typo} (did you mean --"), said
        elif code == 0:
            assert "usage:" in r.stdout and "--help" in r.stdout
        else:
            assert len(said) == 1 and said[0].startswith("error: ") and "│" not in said[0], (args, said)


@pytest.mark.parametrize("mistake", ["--device cuda", "--output-dir file", "--swap-blocks 2"])
def test_train_mistakes_found_after_the_imports_are_one_line(data_dir, tmp_path, mistake):
    """train_a2.py's input mistakes that need torch to be seen (no CUDA GPU; an --output-dir, or a dir above it, that
    is a file; block swap on VACE's model, whose context blocks it does not reach) are one line, exit 2, before the
    run starts (nothing logged: no data scanned, no weights loaded)."""
    (tmp_path / "file").write_text("")
    flag, value = mistake.split()
    given = {"--output-dir": str(tmp_path), "--device": "cpu",
             flag: str(tmp_path / value) if flag == "--output-dir" else value}
    model = "tiny-vace" if flag == "--swap-blocks" else "tiny"
    argv = ["--model", model, "--data-root", str(data_dir), "--resolution", "32", "32", "--num-frames", "21",
            *(x for kv in given.items() for x in kv)]
    r = subprocess.run([sys.executable, str(ROOT / "train_a2.py"), *argv], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT)  # no GPU, also on a GPU machine
    said = r.stderr.strip().splitlines()
    want = {"--device": "--device cuda: PyTorch sees no CUDA GPU here (--device cpu, or auto)",
            "--output-dir": f"--output-dir {tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a dir to write into",
            "--swap-blocks": "--swap-blocks does not reach VACE's context blocks: drop it (--fp8-base and "
                             "recomputation cover them)"}[flag]
    assert (r.returncode, said, r.stdout) == (2, [f"error: {want}"], ""), (r.returncode, said[-5:])


def broken_lines(text: str, columns: int) -> list[str]:
    """The help lines that end well before the box's edge although the option's help goes on: a sentence broken
    where its source line ends, not wrapped to the width."""
    lines = [ln.rstrip().rstrip("│").rstrip() for ln in text.splitlines()]
    broken, block = [], []
    for ln in lines + ["╰"]:
        body = ln.lstrip("│ ")
        if body.startswith("-") or not body or body[0] in "╰├─╭":  # an option starts, or the box ends
            broken += [b for b in block[:-1] if len(b) < columns - 60 and "  " in b.strip("│ ")]  # not a lone flag
            block = [ln] if body.startswith("-") else []
        elif block:
            block.append(ln)
    return broken


def test_help_reads_as_paragraphs(capsys, monkeypatch):
    """Each option's help is one paragraph wrapped to the terminal, not broken where its docstring's source lines
    end (tyro 1.0 keeps those breaks; a2.cli.help_from_docstrings hands it each docstring as one paragraph)."""
    from config import BenchConfig, InferConfig, TrainConfig

    for cls in (TrainConfig, InferConfig, BenchConfig):
        text = help_text(capsys, monkeypatch, lambda a, cls=cls: tyro.cli(cls, args=a), [])
        assert len(text.splitlines()) > 50 and broken_lines(text, 120) == [], (cls.__name__, broken_lines(text, 120))
    # the check sees a help broken at its source lines (the default tyro rendering of such a docstring)
    assert broken_lines("│ --x INT  First line of the x flag\n│          and (continues) here │\n╰──", 250) != []


def test_the_tiny_model_builder_answers_help_and_a_wrong_argument_before_torch(tmp_path):
    """python -m a2.model.tiny --help prints its usage, exit 0 (it built a model dir named "--help"); an argument it
    does not take: the usage, exit 2; both before torch is imported."""
    for args, code in ((["--help"], 0), (["out", "--nope"], 2)):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "a2.model.tiny", *args], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        heavy = [ln for ln in r.stderr.splitlines() if ln.startswith("import time:") and "torch" in ln]
        assert r.returncode == code and "python -m a2.model.tiny OUT_DIR" in r.stdout and heavy == [], r.stderr[-500:]
    assert not (ROOT / "--help").exists() and not (ROOT / "out").exists()
