"""How every script meets its user: its flags parsed by tyro before the heavy imports (parse_cli), a mistake in
what the user gave (flags, config, data) said in one line with exit status 2 (InputError, run_cli), a stop signal
said in one line (exit_on_signal), a main that leaves the process as it found it (left_as_found), and a text file read
as its writer meant it. It imports tyro and the standard library only (torch inside left_as_found, once main runs)."""

from __future__ import annotations

import ast
import codecs
import contextlib
import difflib
import io
import itertools
import os
import random
import re
import signal
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, get_args, get_origin, get_type_hints

import tyro


def _on_off(args: list[str]) -> bool:
    if len(args) > 1 or args and args[0].lower() not in ("true", "false"):
        raise ValueError(f"expected nothing (on), True or False, not {' '.join(args)!r}")
    return not args or args[0].lower() == "true"


# a bool flag whose default (None) is decided later: `--flag` (on), `--flag False`, or left out
OnOffAuto = Annotated[bool | None, tyro.constructors.PrimitiveConstructorSpec(
    nargs="*", metavar="[True|False]", instance_from_str=_on_off, str_from_instance=lambda x: [str(x)],
    is_instance=lambda x: x is None or isinstance(x, bool))]


class InputError(ValueError):
    """Bad input from the user (flags, config, data): the CLIs print it as it is, one line per problem, no traceback."""


class MissingInput(InputError, FileNotFoundError):
    """A file or dir the user named is not there: an InputError (one line, exit 2) that `except FileNotFoundError`
    still catches."""


def as_input_error(fn, *args, **kwargs):
    """fn(*args, **kwargs) reading what the user gave (files, sizes, flags): its FileNotFoundError / ValueError is an
    input mistake, raised again as MissingInput / InputError with the same message (one line, exit 2)."""
    try:
        return fn(*args, **kwargs)
    except InputError:
        raise
    except FileNotFoundError as e:
        raise MissingInput(" ".join(str(e).split())) from e
    except ValueError as e:
        raise InputError(" ".join(str(e).split())) from e


class ConfigError(InputError):
    """A bad config value; the message names the file (or flag) and the key."""


def check_dir_to_write(flag: str, path, itself: bool = True) -> None:
    """A dir a command will write into (`path` itself, or with itself=False the dir a file path goes in) must not be,
    or lie under, an existing file: found before any work, not when the first file is written (ConfigError)."""
    path = Path(path)
    file = next((d for d in ((path,) if itself else ()) + tuple(path.parents) if d.is_file()), None)
    if file is not None:
        raise ConfigError(f"{flag} {path}: {file} is a file, not a dir to write into")


def printable(text: str) -> str:
    """Text that print() cannot choke on: file names that are not UTF-8 (surrogate escapes) as \\xNN."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def exit_on_signal(hint: str) -> None:
    """SIGTERM / SIGINT (Ctrl-C) end the process in one line, the signal and `hint` (what is kept, how to go on),
    exit 128 + the signal, no traceback; SystemExit, so every `finally` (temp files) runs on the way out. Called
    again, it changes the hint."""
    def stop(signum, _frame):
        from tqdm import tqdm  # its write: on a line of its own below a progress bar

        tqdm.write(printable(f"error: stopped by {signal.Signals(signum).name}: {hint}"), file=sys.stderr)
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)


@contextlib.contextmanager
def left_as_found(reset=lambda: None):
    """A main()'s decorator: main leaves the process as it found it on every exit (a return, an exception, a stop),
    so that a caller (a notebook, a test) keeps no SIGTERM/SIGINT handler of a run that has ended and can call main
    again: the handlers main installs are restored, the environment variables it set (PYTORCH_CUDA_ALLOC_CONF, read
    once when CUDA initialises) put back, the global random generators it reseeds (`random`'s, torch's CPU one and,
    where CUDA was initialised before main, each GPU's) restored, so that what the caller draws next does not depend
    on main's last seed, the process group main created destroyed, and reset() called (a script's own flags).
    After an exception with several ranks the group is left to the process's exit: destroying it would wait for the
    other ranks' collectives, which may never come."""
    import torch
    import torch.distributed as dist

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    environ = dict(os.environ)
    cuda = torch.cuda.is_initialized()  # (not initialised here: main sets the allocator's variable first)
    rng = random.getstate(), torch.random.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None
    created = not dist.is_initialized()
    failed = True
    try:
        yield
        failed = False
    finally:
        reset()
        for name in os.environ.keys() - environ.keys():
            del os.environ[name]
        os.environ.update(environ)
        for signum, handler in handlers.items():
            if signal.getsignal(signum) is not handler:  # (only the main thread may set one; main set them there)
                signal.signal(signum, handler)
        random.setstate(rng[0])
        torch.random.set_rng_state(rng[1])
        if cuda:
            torch.cuda.set_rng_state_all(rng[2])
        if created and dist.is_initialized() and not (failed and dist.get_world_size() > 1):
            dist.destroy_process_group()


def run_cli(main, *args):
    """main(*args), with an InputError printed as its message (no traceback) and exit status 2."""
    try:
        return main(*args)
    except InputError as e:
        print(printable(f"error: {e}"), file=sys.stderr)
        sys.exit(2)


def option_names(cls, prefix: str = "") -> list[str]:
    """The --flags tyro makes of a config dataclass: --field-name, --nested.field-name, and their aliases."""
    names = []
    hints = get_type_hints(cls, include_extras=True)
    for f in fields(cls):
        hint = hints[f.name]
        inner, marks = (get_args(hint)[0], get_args(hint)[1:]) if get_origin(hint) is Annotated else (hint, ())
        name = prefix + next((m.name for m in marks if getattr(m, "name", None)), f.name).replace("_", "-")
        if is_dataclass(inner):  # a section: --section.field, or --field under OmitArgPrefixes
            names += option_names(inner, prefix if tyro.conf.OmitArgPrefixes in marks else name + ".")
            continue
        names.append(f"--{name}")
        names += [a for m in getattr(hint, "__metadata__", ()) for a in getattr(m, "aliases", None) or ()]
    return names


def tyro_error_line(box: str) -> str:
    """tyro's answer to a bad value (a box: a title, the message wrapped to the terminal, the option's help, a
    pointer to --help) as one line: the message, after the title where it does not say it already; a config's own
    check (its __post_init__) without tyro's "Error parsing XConfig:" before it; required options by name alone."""
    rule = lambda r: not r.strip("─-") or r[0] == "╰"  # noqa: E731  (a rule: UTF-8 boxes, or ASCII's dashes)
    rows = [line.strip().strip("│╭╮|").strip() for line in box.strip().splitlines()]
    title = rows[0].strip("─- ") if rows else ""
    rows = list(itertools.takewhile(lambda r: not rule(r), itertools.dropwhile(rule, rows[1:])))
    body = re.sub(r"^Error parsing [A-Z]\w*: ", "", " ".join(rows).rstrip("."))  # a config class: its own check
    typed = re.fullmatch(r"Error parsing (--[\w.-]+): no type matching (.+) could be instantiated from \[(.*)\]", body)
    if typed:  # tyro's type algebra ({None}|{INT INT}) as what the flag takes and what it got
        takes = " or ".join(t.strip("{}") for t in typed[2].split("|") if t != "{None}")
        return f"{typed[1]} {typed[3].replace(chr(39), '').replace(',', '')}: expected {takes}"
    literal = re.fullmatch(r"Error parsing (--[\w.-]+): invalid literal for (int|float)\(\).*: '(.*)'", body)
    if literal:
        return f"{literal[1]} {literal[3]}: expected {'a whole number' if literal[2] == 'int' else 'a number'}"
    if title == "Required options":  # "Missing from PROG:", then "--flag METAVAR" or a positional's "METAVAR" rows
        body = "missing " + ", ".join(dict.fromkeys(r.split()[0] for r in rows if r.startswith("--")
                                                    or re.fullmatch(r"[A-Z][A-Z_]*", r)))
    said = title in ("Value error", "Required options") or body.lower().startswith(title.lower().split(" ")[0])
    return (body if said else f"{title}: {body}") if body else box.strip()


def unknown_line(unknown: list[str], known: list[str]) -> str:
    """The one line for arguments no option takes: the flags, each with the closest known ones."""
    flags = [a.partition("=")[0] for a in unknown if a.startswith("-")]
    close = dict.fromkeys(m for f in flags for m in difflib.get_close_matches(f, known, n=2, cutoff=0.6))
    what = f"unknown option {' '.join(flags)}" if flags else f"unexpected argument {' '.join(unknown)}"
    return f"{what}" + (f" (did you mean {' or '.join(close)}?)" if close else "")


def user_words(line: str, argv: list[str]) -> str:
    """tyro's line for a mistyped command (a subcommand name) or a positional argument given as a --flag, in the words
    of what was typed."""
    missing = re.fullmatch(r"Missing subcommand: Expected one of \{(.*)\}", line)
    given = next((a for a in argv if not a.startswith("-")), None)
    if missing and given:
        commands = [c.strip() for c in missing[1].split(",")]
        close = difflib.get_close_matches(given, commands, n=1, cutoff=0.6)
        return (f"unknown command {given!r}" + (f" (did you mean {close[0]}?)" if close else "")
                + f"; the commands: {', '.join(commands)}")
    positional = re.fullmatch(r"Missing value for argument '(\w+)'.*", line)
    if positional and f"--{positional[1]}" in argv:
        name = positional[1]
        return f"--{name}: {name.upper()} is given without a flag name here (a positional argument): drop --{name}"
    return line


def parse_cli(cls, args=None, **kwargs):
    """tyro.cli(cls) for a script's __main__, before its heavy imports: a config error (InputError) and a bad value
    (tyro's box) are one line, an unknown option one line naming the closest known ones (tyro's own answer quotes
    their whole help; a required option missing beside it is said after it), exit 2."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # --help goes to stdout, as it is
            cfg, unknown = run_cli(lambda: tyro.cli(cls, args=args, return_unknown_args=True, **kwargs))
    except SystemExit as e:
        if e.code == 2 and said.getvalue().strip() and not said.getvalue().startswith("error: "):  # tyro's box
            line = tyro_error_line(said.getvalue())
            if is_dataclass(cls) and line.startswith("missing "):  # a typo of a required option: said first
                known = option_names(cls)
                flags = [a.partition("=")[0] for a in (sys.argv[1:] if args is None else args) if a.startswith("--")]
                typos = [f for f in flags if f not in known and f.replace("no-", "", 1) not in known]  # --no-flag
                line = f"{unknown_line(typos, known)}; {line}; --help lists the options" if typos else line
            print(f"error: {user_words(line, sys.argv[1:] if args is None else list(args))}", file=sys.stderr)
        else:
            sys.stderr.write(said.getvalue())
        raise
    sys.stderr.write(said.getvalue())
    if unknown:
        print(f"error: {unknown_line(unknown, option_names(type(cfg)))}; --help lists the options", file=sys.stderr)
        sys.exit(2)
    return cfg


def read_text(path) -> str:
    """A text file as its writer meant it: UTF-8, UTF-8 with a BOM (Excel "CSV UTF-8", Notepad), or UTF-16 with a BOM
    (Excel "Unicode text"). Anything else (cp1252, Latin-1) raises ValueError rather than train as mojibake."""
    raw = Path(path).read_bytes()
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return raw.decode("utf-16")
    if b"\x00" in raw:  # valid UTF-8 byte by byte, but text would train with a NUL between every letter
        raise ValueError("UTF-16 text without a byte-order mark (NUL bytes); save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save it as UTF-8") from None


def help_from_docstrings(namespace: dict) -> None:
    """Give each field of the config dataclasses in `namespace` (a module's globals(), its source read from its
    __file__) its docstring as one paragraph of help (field metadata "help", which tyro reads before the docstring):
    tyro 1.0 joins an attribute docstring's lines only where the next line starts with a letter, and the source's
    indentation is not one, so --help broke every sentence where the source wraps it."""
    for node in ast.parse(Path(namespace["__file__"]).read_text(encoding="utf-8")).body:
        cls = namespace.get(getattr(node, "name", None))
        if not (isinstance(node, ast.ClassDef) and is_dataclass(cls)):
            continue
        for field_node, doc in zip(node.body, node.body[1:]):
            if (isinstance(field_node, ast.AnnAssign) and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
                f = cls.__dataclass_fields__[field_node.target.id]
                f.metadata = MappingProxyType({**f.metadata, "help": " ".join(doc.value.value.split())})
