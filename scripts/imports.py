"""Import graph of the project's own modules: edges, floors and cycles.

An edge is "module A imports project module B" (at any depth of A's code: a function-level import is still a
dependency). Floors are the longest-path layering: a module that imports no project module stands on floor 0, any
other one floor above the highest module it imports. Tests and this folder are left out.

    python scripts/imports.py            # summary
    python scripts/imports.py --edges    # and every edge, by floor
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules() -> dict[str, Path]:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    out = {}
    for f in files:
        if f.startswith(("tests/", "scripts/")):
            continue
        name = f[:-3].replace("/", ".")
        out[name.removesuffix(".__init__")] = ROOT / f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports; `from a2 import x` counts as a2.x when a2.x is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a2.x.y (an attribute) → a2.x
                t = t.rpartition(".")[0]
            if t and t != name and not (t == "a2" and not known["a2"].read_text().strip()):
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    mods_with_a2 = dict(mods)
    return {m: imports(m, p, known) for m, p in mods_with_a2.items() if m in known} | {}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    return out


def floors(g: dict[str, set[str]]) -> dict[str, int]:
    memo: dict[str, int] = {}

    def floor(v, seen=()):
        if v not in memo:
            deps = [w for w in g.get(v, ()) if w not in seen]  # a cycle is reported, not followed
            memo[v] = 1 + max((floor(w, seen + (v,)) for w in deps), default=-1)
        return memo[v]

    return {v: floor(v) for v in g}


def main():
    g = graph()
    g = {m: deps for m, deps in g.items() if m != "a2"}
    f = floors(g)
    cyc = cycles(g)
    edges = sum(len(d) for d in g.values())
    print(f"modules {len(g)}  edges {edges}  floors {max(f.values()) + 1}  cycles {len(cyc)}")
    for c in cyc:
        print("  cycle:", " ".join(c))
    for level in range(max(f.values()) + 1):
        print(f"floor {level}: " + " ".join(sorted(m for m in f if f[m] == level)))
    if "--edges" in sys.argv:
        for m in sorted(g, key=lambda m: (f[m], m)):
            print(f"{m} ({f[m]}) -> " + " ".join(sorted(g[m], key=lambda w: (f[w], w))))


if __name__ == "__main__":
    main()
