"""The package's import graph: no circle, and no module importing from a layer above its own.

Every ``bstrain/**/*.py`` is parsed with ``ast``; every ``import`` and ``from ... import`` of a
bstrain module counts, at module level and inside functions alike (a lazy import is still a
dependency), relative ones resolved. ``from pkg import name`` is an edge to the submodule
``pkg.name`` when there is one, else to ``pkg`` itself.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "bstrain"

# The layers, bottom to top (README: kernels/ -> ops/ -> nn/ -> models/ -> train/). A module may
# import from its own layer or a lower one; the longest matching prefix gives a module's layer.
LAYERS = {
    "bstrain.errors": 0,                # leaf utilities, imported from anywhere
    "bstrain._deprecated": 0,
    "bstrain._tensors": 0,
    "bstrain.layout": 0,                # block layouts are plain data: kernels (growth_limit) and ops take them
    "bstrain.kernels": 1,
    "bstrain.ops": 2,
    "bstrain.nn": 3,
    "bstrain.sparsity": 4,              # dynamic sparsity edits the nn modules' layouts
    "bstrain.models": 4,
    "bstrain.hf": 4,                    # saving and loading sparsified Hugging Face models
    "bstrain.data": 4,                  # at the side: data and configs serve the trainer
    "bstrain.configs": 4,               # (the schema names the built-in models' configs)
    "bstrain.train": 5,
    "bstrain.cli": 6,
    "bstrain.__main__": 6,
    "bstrain": 6,                       # the package's lazy facade: bstrain.graphed, bstrain.sparsity
}

# Known edges that break a rule, each with its reason. The tests leave these out and fail on any
# other, and on an entry that no longer exists, so this list only shrinks.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <node.module>`` refers to, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The bstrain module that ``name`` (a module, or an attribute of one) lives in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """{module: the bstrain modules it imports}, over every import statement in the file."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"] or [base]
            else:
                continue
            for name in names:
                target = _target(name, modules) if name.split(".")[0] == "bstrain" else None
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (each holds a circle),
    sorted; Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(found)


def test_every_module_has_a_layer():
    assert [m for m in _modules() if not any(m == p or m.startswith(p + ".") for p in LAYERS)] == []


def test_no_import_circle():
    graph = {m: {n for n in ns if (m, n) not in ALLOWED} for m, ns in import_graph().items()}
    assert circles(graph) == [], "import circles (each a set of modules importing one another):\n" + "\n".join(
        "  " + ", ".join(c) for c in circles(graph))


def test_no_import_from_a_higher_layer():
    graph = import_graph()
    upward = sorted((m, n) for m, ns in graph.items() for n in ns
                    if layer(n) > layer(m) and (m, n) not in ALLOWED)
    assert upward == [], "imports from a higher layer:\n" + "\n".join(
        f"  {m} (layer {layer(m)}) -> {n} (layer {layer(n)})" for m, n in upward)


def test_allowlist_is_current():
    graph = import_graph()
    assert [edge for edge in ALLOWED if edge[1] not in graph.get(edge[0], ())] == []


if __name__ == "__main__":                     # python tests/test_imports.py: the graph, one edge a line
    g = import_graph()
    for m in sorted(g):
        for n in sorted(g[m]):
            print(f"{m} ({layer(m)}) -> {n} ({layer(n)}){'   UP' if layer(n) > layer(m) else ''}")
    print("circles:", circles(g))
