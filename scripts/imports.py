"""Import graph of the project's own modules (tests and scripts/ left out): edges, floors, cycles.

An edge is "module A imports project module B", at any depth of A's code (a function-level import is a dependency
too); `from a2 import x` is a2.x, and the empty package a2 is no module. Floors are the longest-path layering: a
module that imports no project module is on floor 0, any other one floor above the highest module it imports.

    python scripts/imports.py [--edges]
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


def main():
    g = graph()
    f, cycles = floors(g)
    print(f"modules {len(g)}  edges {sum(map(len, g.values()))}  floors {max(f.values()) + 1}  cycles {len(cycles)}")
    for c in cycles:
        print("  cycle: " + " -> ".join(c))
    up = sorted(f"{m} -> {d}" for m in g if m.startswith("a2.") for d in g[m] if not d.startswith("a2."))
    print(f"library imports of a top-level module (config, the scripts): {len(up)}  " + ", ".join(up))
    for level in range(max(f.values()) + 1):
        print(f"floor {level}: " + " ".join(sorted(m for m in f if f[m] == level)))
    if "--edges" in sys.argv:
        for m in sorted(g, key=lambda m: (f[m], m)):
            print(f"{m} ({f[m]}) -> " + " ".join(sorted(g[m], key=lambda w: (f[w], w))))


if __name__ == "__main__":
    main()
