"""Import graph of the project's own modules (tests and scripts/ left out): edges, floors, cycles, counted twice.

An edge is "module A imports project module B", at any depth of A's code (a function-level import is a dependency
too); `from a2.kinds import align` is a2.kinds.align, and an empty package (a2, a2/kinds/, ...) is no module. Floors
are the longest-path layering: a module that imports no project module is on floor 0, any other one floor above the
highest module it imports.

The graph is printed at two grains:
- modules: every file is a node;
- folders: each concern folder of a2/ (a2/kinds/, a2/model/, ...) is ONE node, standing for all its modules, and an
  edge is "some module of A imports some module of B" (imports inside a folder are not counted). The modules at
  a2/'s root and the top-level scripts stay nodes of their own. The layout's target (edges, no cycle) is stated at
  this grain (the design review's "modules or folders"); the module count is the finer, larger one.

    python scripts/imports.py [--edges] [--modules]   (--edges: each node's imports; --modules: at module grain)
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def graph() -> dict[str, set[str]]:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    mods = {f[:-3].replace("/", ".").removesuffix(".__init__"): ROOT / f for f in files
            if not f.startswith(("tests/", "scripts/")) and (ROOT / f).is_file() and (ROOT / f).stat().st_size}
    g = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        g[name] = {d for d in deps if d in mods and d != name}
    return g


def folder(module: str) -> str:
    """The node a module counts as at folder grain: a2.kinds.align -> a2.kinds; a2.cli, config -> themselves."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "a2" and len(parts) > 2 else module


def folders(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with each folder of a2/ as one node: an edge wherever some module of one imports some of the other."""
    out = {}
    for m, deps in g.items():
        out.setdefault(folder(m), set()).update(folder(d) for d in deps)
    return {m: deps - {m} for m, deps in out.items()}


def floors(g: dict[str, set[str]]) -> tuple[dict[str, int], list[list[str]]]:
    """Each module's floor, and the cycles met (each as the path that closes it)."""
    floor, cycles = {}, []

    def visit(v, path):
        if v in path:
            cycles.append(path[path.index(v):] + [v])
            return 0
        if v not in floor:
            floor[v] = 1 + max((visit(w, path + [v]) for w in g[v]), default=-1)
        return floor[v]

    for v in g:
        visit(v, [])
    return floor, cycles


def summary(g: dict[str, set[str]], grain: str, note: str = "") -> str:
    f, cycles = floors(g)
    return (f"{grain} {len(g)}  edges {sum(map(len, g.values()))}  floors {max(f.values()) + 1}  cycles {len(cycles)}"
            + note + "".join("\n  cycle: " + " -> ".join(c) for c in cycles))


def main():
    g = graph()
    fg = folders(g)
    print(summary(g, "modules"))
    print(summary(fg, "folders", "   (a folder of a2/ counted as one node)"))
    up = sorted(f"{m} -> {d}" for m in g if m.startswith("a2.") for d in g[m] if not d.startswith("a2."))
    print(f"library imports of a top-level module (config, the scripts): {len(up)}  " + ", ".join(up))
    shown = g if "--modules" in sys.argv else fg
    f = floors(shown)[0]
    for level in range(max(f.values()) + 1):
        print(f"floor {level}: " + " ".join(sorted(m for m in f if f[m] == level)))
    if "--edges" in sys.argv:
        for m in sorted(shown, key=lambda m: (f[m], m)):
            print(f"{m} ({f[m]}) -> " + " ".join(sorted(shown[m], key=lambda w: (f[w], w))))


if __name__ == "__main__":
    main()
