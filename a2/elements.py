"""The Element: one reference image of a sample, and its grammar for `--elements` (one string per element,
position = order given unless pos= is set):

    NAME=SUFFIX[,SUFFIX...][:OPTION[,OPTION...]]
    options: required | repeat=N | pos=N | vae=MODE | clip=MODE | clip=off
    MODE: resize | center_crop | pad_white | letterbox

    subject=_person.png,_mask.png:required,repeat=1,clip=pad_white
    background=_background.png:repeat=4,vae=center_crop

A dataset file lists the same elements as JSON (a2/config/dataset_config.py). It imports the standard library and
a2/cli.py only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from a2.cli import ConfigError

# how an image is framed to a size (fit_pad_white: Phantom-Wan's and SkyReels-V3's references)
PREPROCESS_MODES = ("resize", "center_crop", "pad_white", "letterbox", "fit_pad_white")


@dataclass(frozen=True)
class Element:
    """One reference image of a sample: how it is found, framed and placed in the sequence."""

    name: str
    """The element's name (subject, object, background, ...); names are unique in a dataset."""
    suffixes: tuple[str, ...]
    """The file name endings after the sample id (`_person.png`) that name this element's image; the first one that
    exists wins."""
    required: bool = False
    """Makes a sample without this element a dataset error; otherwise the element is optional."""
    repeat: int = 1
    """The number of pixel frames this element occupies in the VAE mini-video."""
    position: int = 0
    """The element's place in the sequence; elements are ordered by ascending position."""
    vae_preprocess: str = "resize"
    """How the image is framed to the video size for the VAE path (one of PREPROCESS_MODES)."""
    clip_preprocess: str = "pad_white"
    """How the image is framed to the CLIP size (one of PREPROCESS_MODES)."""
    clip: bool = True
    """Also encodes the image with CLIP (257 image tokens)."""


# SkyReels-A2's published layout: repeats 1/4/4, VAE pad_white/pad_white/center_crop, CLIP pad_white (512x512)
A2_ELEMENTS: tuple[Element, ...] = (
    Element("subject", ("_person.png", "_mask.png", "_subject.png"), False, 1, 0, "pad_white", "pad_white"),
    Element("object", ("_object.png", "_thing.png"), False, 4, 1, "pad_white", "pad_white"),
    Element("background", ("_background.png", "_env.png", "_scene.png"), False, 4, 2, "center_crop", "pad_white"),
)


# The released S2V models' references (Phantom-Wan, SkyReels-V3 R2V, RefAlign, MAGREF: their kinds' element specs,
# a2.kinds.kinds.kind_elements): one frame each, framed as their labs frame one (Lanczos fit, white pad), no CLIP
# path; ref0..ref2 also read A2's subject / object / background files, so one dataset dir trains every kind
RELEASED_ELEMENTS: tuple[Element, ...] = tuple(
    Element(f"ref{i}", (f"_ref{i}.png",) + (A2_ELEMENTS[i].suffixes if i < len(A2_ELEMENTS) else ()), False, 1, i,
            "fit_pad_white", "pad_white", False) for i in range(8))


def check_element(e: Element, where: str) -> Element:
    if not e.name or not e.suffixes:
        raise ConfigError(f"{where}: an element needs a name and at least one suffix")
    if e.repeat < 1:
        raise ConfigError(f"{where}: element '{e.name}': repeat must be >= 1, got {e.repeat}")
    for key, mode in (("vae preprocess", e.vae_preprocess), ("clip preprocess", e.clip_preprocess)):
        if mode not in PREPROCESS_MODES:
            raise ConfigError(f"{where}: element '{e.name}': {key} {mode!r} is not one of {PREPROCESS_MODES}")
    return e


def check_elements(elements, where: str) -> tuple[Element, ...]:
    elements = tuple(sorted((check_element(e, where) for e in elements), key=lambda e: e.position))
    for attr in ("name", "position"):
        values = [getattr(e, attr) for e in elements]
        if len(set(values)) != len(values):
            raise ConfigError(f"{where}: element {attr}s must be unique, got {values}")
    return elements


def parse_element(spec: str, position: int) -> Element:
    where = f"--elements {spec!r}"
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise ConfigError(f"{where}: expected NAME=SUFFIX[,SUFFIX...][:OPTIONS]")
    suffixes, _, options = rest.partition(":")
    kw = dict(name=name, suffixes=tuple(s for s in suffixes.split(",") if s), position=position)
    for opt in filter(None, options.split(",")):
        key, _, value = opt.partition("=")
        if key == "required" and not value:
            kw["required"] = True
        elif key in ("repeat", "pos") and value.lstrip("-").isdigit():
            kw["repeat" if key == "repeat" else "position"] = int(value)
        elif key == "vae" and value:
            kw["vae_preprocess"] = value
        elif key == "clip" and value:
            kw["clip"] = value != "off"
            if value != "off":
                kw["clip_preprocess"] = value
        else:
            raise ConfigError(f"{where}: unknown option {opt!r} "
                              "(required | repeat=N | pos=N | vae=MODE | clip=MODE|off)")
    return Element(**kw)


def parse_elements(specs) -> tuple[Element, ...]:
    """The --elements grammar (module docstring) -> Elements sorted by position."""
    return check_elements([parse_element(s, i) for i, s in enumerate(specs)], "--elements")


def pair_elements(images, specs: tuple[Element, ...]) -> list[tuple[Element, str]]:
    """Pair each element image (`path` or `name=path`) with its spec: by name when named, else by position."""
    by_name = {e.name: e for e in specs}
    if len(images) > len(specs):
        raise ValueError(f"{len(images)} element images but only {len(specs)} element specs")
    items = []
    for i, item in enumerate(images):
        name, sep, path = item.partition("=")
        if sep and name in by_name:
            items.append((by_name[name], path))
        elif sep and not Path(item).exists():
            raise ValueError(f"element image {item}: unknown element name {name!r}; known: {sorted(by_name)}")
        else:
            items.append((specs[i], item))
    names = [e.name for e, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"element given twice in {names}")
    return items
