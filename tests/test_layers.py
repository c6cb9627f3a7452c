"""The house rules, read from the imports with ``ast`` (lazy imports inside
functions count as much as those at the top):

- no import cycle among the project's modules;
- ``infer.runtime`` (what a session runs) imports no builder or tool:
  nothing of ``infer.spec``, ``prep``, ``synth``, ``train``, ``tools``, nor
  the front doors (``run``, ``serve``, ``cli``);
- ``infer`` imports nothing from ``iod`` but ``iod.inproc`` (the daemon's
  core run in-process);
- ``shared`` imports nothing of ``infer`` or ``iod``;
- ``scripts/`` import nothing from ``tests/``.
"""

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("infer", "iod", "shared", "native")
BUILDERS_AND_TOOLS = ("infer.spec", "infer.prep", "infer.synth", "infer.train", "infer.tools",
                      "infer.run", "infer.serve", "infer.cli")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str, is_package: bool):
    """Every module ``path`` imports (absolute names; ``from a import b`` gives
    ``a.b`` as well as ``a``: b may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def graph(root: Path) -> dict:
    """{module: set of project modules it imports} for the packages under ``root``."""
    files = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            files[_module_name(root, path)] = path
    known = set(files)
    edges = {}
    for mod, path in files.items():
        deps = set()
        for name in _imports(path, mod, path.name == "__init__.py"):
            while name and name not in known:  # a.b.func -> a.b
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        edges[mod] = deps
    return edges


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def cycles(edges: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            # a package's __init__ importing its own submodules is no cycle to break
            if _under(w, v) and w != v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def broken_rules(edges: dict) -> list:
    """One line per import that breaks a rule of the module docstring."""
    bad = []
    for mod, deps in sorted(edges.items()):
        for dep in sorted(deps):
            if _under(mod, "infer.runtime") and any(_under(dep, p) for p in BUILDERS_AND_TOOLS):
                bad.append(f"{mod} imports {dep}: the runtime imports no builder or tool")
            if _under(mod, "infer") and _under(dep, "iod") and not _under(dep, "iod.inproc"):
                bad.append(f"{mod} imports {dep}: infer imports nothing from iod but iod.inproc")
            if _under(mod, "shared") and (_under(dep, "infer") or _under(dep, "iod")):
                bad.append(f"{mod} imports {dep}: shared imports nothing of infer or iod")
    return bad


def scripts_importing_tests(root: Path) -> list:
    bad = []
    for path in sorted((root / "scripts").rglob("*.py")):
        for name in sorted(_imports(path, path.stem, False)):
            if _under(name, "tests") or name == "conftest":
                bad.append(f"{path.relative_to(root)} imports {name}")
    return bad


def test_no_import_cycle():
    assert cycles(graph(ROOT)) == []


def test_the_layers_hold():
    assert broken_rules(graph(ROOT)) == []


def test_scripts_import_nothing_from_tests():
    assert scripts_importing_tests(ROOT) == []


def test_the_graph_sees_the_project():
    edges = graph(ROOT)
    assert "infer.runtime.streaming" in edges["infer.runtime.loader"]
    assert "iod.core" in edges["iod.inproc"]
    assert "shared.protocol" in edges["shared.codec"]  # a relative import, resolved


def _copy(tmp_path):
    root = tmp_path / "repo"
    for pkg in PACKAGES + ("scripts",):
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return root


def test_a_planted_upward_import_is_caught(tmp_path):
    root = _copy(tmp_path)
    gate = root / "infer" / "runtime" / "gate.py"
    gate.write_text(gate.read_text() + "\n\ndef _planted():\n    from infer.tools import bench  # noqa\n")
    assert any("infer.runtime.gate imports infer.tools.bench" in line for line in broken_rules(graph(root)))


def test_a_planted_cycle_and_daemon_import_are_caught(tmp_path):
    root = _copy(tmp_path)
    args = root / "infer" / "args.py"
    args.write_text(args.read_text() + "\nfrom infer import run  # noqa\nfrom iod import core  # noqa\n")
    script = root / "scripts" / "planted.py"
    script.write_text("from tests.conftest import prep_model  # noqa\n")
    assert any({"infer.args", "infer.run"} <= set(group) for group in cycles(graph(root)))
    assert any("infer.args imports iod.core" in line for line in broken_rules(graph(root)))
    assert "scripts/planted.py imports tests.conftest" in scripts_importing_tests(root)
