"""The package's shape: no import circle, no upward import, and a ``mem_cache/`` root that holds
upstream's module names only (fork-only modules live in rooms named for their concept).

Every ``import`` statement counts, wherever it stands (module level, inside a function, under
``TYPE_CHECKING``): a lazy import still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

PACKAGE_ROOT = Path(__file__).resolve().parents[4] / "python" / "sglang"

# (importer package, imported package): layers that sit below the other must not import it.
FORBIDDEN_EDGES = (
    ("sglang.srt.managers", "sglang.srt.disaggregation"),
    ("sglang.srt.model_executor", "sglang.srt.models"),
    ("sglang.srt.layers", "sglang.srt.models"),
    ("sglang.srt.mem_cache", "sglang.srt.disaggregation"),
    ("sglang.srt.mem_cache", "sglang.srt.models"),
)

# Upstream's module and package names at the root of mem_cache/, plus our kvcacheio/ and the
# fork-only rooms (the tree's vocabulary, the hierarchical tree's parts, the controller's parts).
MEM_CACHE_ROOT = {
    "__init__.py", "radix_cache.py", "hiradix_cache.py", "hi_mamba_radix_cache.py", "hicache_storage.py",
    "memory_pool_host.py", "allocator.py", "evict_policy.py", "cache_init_params.py", "common.py",
    "base_prefix_cache.py", "utils.py", "mamba_radix_cache.py", "hicache_auto_size.py",
    "memory_pool", "pool_host", "storage", "hybrid_cache", "kvcacheio",
    "radix", "hiradix", "controller",
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the in-package modules it imports (``from pkg import mod`` counts as ``pkg.mod``
    when ``mod`` is a module)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target.split(".")[0] == top and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                  for low, high in FORBIDDEN_EDGES if inside(src, low) and inside(dst, high))


def write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "sglang"


def test_the_package_has_no_import_circle():
    assert import_circles(import_graph(PACKAGE_ROOT)) == []


def test_no_layer_imports_one_above_it():
    assert upward_imports(import_graph(PACKAGE_ROOT)) == []


def test_mem_cache_root_holds_upstream_names_and_concept_rooms_only():
    root = PACKAGE_ROOT / "srt" / "mem_cache"
    present = {p.name for p in root.iterdir() if p.name != "__pycache__" and not p.name.endswith(".pyc")}
    assert present - MEM_CACHE_ROOT == set()


def test_the_checks_see_a_lazy_circle_and_an_upward_import(tmp_path):
    pkg = write_package(tmp_path, {
        "sglang/__init__.py": "",
        "sglang/srt/__init__.py": "",
        "sglang/srt/managers/__init__.py": "",
        "sglang/srt/managers/a.py": "from sglang.srt.managers import b\n",
        "sglang/srt/managers/b.py": "def f():\n    from .a import g\n",
        "sglang/srt/managers/c.py": "import typing\nif typing.TYPE_CHECKING:\n"
                                    "    from sglang.srt.disaggregation.x import Y\n",
        "sglang/srt/disaggregation/__init__.py": "",
        "sglang/srt/disaggregation/x.py": "Y = 1\n",
    })
    graph = import_graph(pkg)
    assert graph["sglang.srt.managers.a"] == {"sglang.srt.managers.b"}
    assert graph["sglang.srt.managers.b"] == {"sglang.srt.managers.a"}
    assert import_circles(graph) == [["sglang.srt.managers.a", "sglang.srt.managers.b"]]
    assert upward_imports(graph) == ["sglang.srt.managers.c -> sglang.srt.disaggregation.x"]
