"""Import layering, read from the source with `ast` (nothing is imported).

`import_cycles(package_dir, package_name)` walks every module of one package, takes each import
statement wherever it stands (a function-level import is still an edge: it runs whenever that
function does), resolves relative imports to module names and returns the circles of the package's
own module graph, each as a path `[a, b, ..., a]`. The export stage (`ovdflash_export`) and the
model fetching (`ovdflash_models`) and the runtime (`ovdflash`) must have none, and the runtime
keeps its layers: `decode/` imports only itself (no OpenVINO), `ov/` never imports the pipeline,
the server or the bench, `server/` never imports the bench, and nothing imports `cli/`. The runtime also never imports the torch side anywhere: only the two
CLI commands that front the export stage import `ovdflash_export` (`tests/test_no_torch.py`
checks what importing and running the runtime loads; this checks every module's source).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_no_torch import FORBIDDEN

ROOT = Path(__file__).resolve().parent.parent
# the import name of each package and its directory (pyproject's [tool.setuptools.package-dir])
PACKAGES = {"ovdflash": ROOT / "ovdflash", "ovdflash_export": ROOT / "export", "ovdflash_models": ROOT / "models"}
# the CLI commands whose work is the export stage: they import it, inside the command where it is heavy
EXPORT_FRONTS = {"ovdflash.cli.export", "ovdflash.cli.train"}


def package_modules(package_dir: Path, package_name: str) -> dict[str, Path]:
    """Module name -> source file, for every module of the package (subpackages included)."""
    modules = {}
    for path in sorted(Path(package_dir).rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package_name, *parts))] = path
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """Every name the file's import statements import, relative ones resolved: `X` for
    `import X`, `X.a` for `from X import a` (a module, or a name in module `X`)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # the package the module sits in, then one level up for each dot past the first
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(package_dir: Path, package_name: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name that is not a module counts as the
    longest module it lies in: `from pkg.mod import attr` imports `pkg.mod`)."""
    modules = package_modules(package_dir, package_name)
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in imported_names(path, module):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles `[a, b, ..., a]` through every module of each strongly connected part of the graph
    with more than one module (Tarjan's algorithm, iterative), in sorted order so that the report
    is stable: the shortest circle through each module that no earlier circle passes."""
    index, low, on_stack, stack, parts = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.add(member)
                    if member == node:
                        break
                if len(part) > 1:
                    parts.append(part)
    circles = []
    for part in parts:
        covered = set()
        for start in sorted(part):
            if start not in covered:
                circles.append(_circle_in(graph, part, start))
                covered.update(circles[-1])
    return sorted(circles)


def _circle_in(graph: dict[str, set[str]], part: set[str], start: str) -> list[str]:
    """The shortest circle through `start` inside its part, by breadth-first search."""
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & part):
                if child == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(part)}")


def import_cycles(package_dir, package_name: str) -> list[list[str]]:
    """The circles of the package's module graph, each as `[a, b, ..., a]`; [] when there are none."""
    return find_cycles(import_graph(Path(package_dir), package_name))


def assert_no_cycles(package_name: str):
    cycles = import_cycles(PACKAGES[package_name], package_name)
    assert not cycles, f"import circles in {package_name}:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("package_name", ["ovdflash", "ovdflash_export", "ovdflash_models"])
def test_no_import_cycles(package_name):
    assert_no_cycles(package_name)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that cross the runtime's layers the wrong way (CONTRIBUTING.md, the import rules)."""
    def within(module, package):
        return module == package or module.startswith(package + ".")

    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if within(target, "ovdflash.cli") and not within(module, "ovdflash.cli"):
                bad.append(f"{module} imports {target}: the CLI is imported by nothing")
            if within(module, "ovdflash.decode") and not within(target, "ovdflash.decode"):
                bad.append(f"{module} imports {target}: decode imports only decode")
            if within(module, "ovdflash.ov") and (target == "ovdflash.pipeline" or within(target, "ovdflash.server")
                                                  or within(target, "ovdflash.bench")):
                bad.append(f"{module} imports {target}: runners never import the pipeline or its users")
            if within(module, "ovdflash.server") and within(target, "ovdflash.bench"):
                bad.append(f"{module} imports {target}: the server does not import the bench")
    return bad


def test_the_runtime_keeps_its_layers():
    assert not (bad := layer_violations(import_graph(PACKAGES["ovdflash"], "ovdflash"))), "\n".join(bad)
    # decode/ never touches OpenVINO, directly or through a module outside it
    decode = package_modules(PACKAGES["ovdflash"] / "decode", "ovdflash.decode")
    assert not [m for m, path in decode.items() if any(n.split(".")[0] == "openvino" for n in imported_names(path, m))]


def test_the_layer_rules_catch_a_planted_import():
    graph = {"ovdflash.decode.sampling": {"ovdflash.ov.runners"}, "ovdflash.server.app": {"ovdflash.cli.serve"},
             "ovdflash.ov.paged": {"ovdflash.pipeline"}, "ovdflash.cli.chat": {"ovdflash.pipeline"}}
    assert [line.split(":")[0] for line in layer_violations(graph)] == [
        "ovdflash.decode.sampling imports ovdflash.ov.runners", "ovdflash.ov.paged imports ovdflash.pipeline",
        "ovdflash.server.app imports ovdflash.cli.serve"]


def test_the_checker_finds_a_planted_circle(tmp_path):
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import helper\n")
    (pkg / "sub" / "b.py").write_text("def helper():\n    from .. import a  # lazy: still an edge\n    return a\n")
    (pkg / "c.py").write_text("import planted.a\nfrom planted import sub\n")  # imports into the circle, not part of it
    assert import_cycles(pkg, "planted") == [["planted.a", "planted.sub.b", "planted.a"]]
    (pkg / "sub" / "b.py").write_text("def helper():\n    return 1\n")
    assert import_cycles(pkg, "planted") == []


def test_the_runtime_never_imports_the_torch_side():
    # torch and its libraries nowhere; the export stage only from the commands that run it
    offenders = []
    for module, path in package_modules(PACKAGES["ovdflash"], "ovdflash").items():
        for name in imported_names(path, module):
            top = name.split(".")[0]
            if top in FORBIDDEN and not (top == "ovdflash_export" and module in EXPORT_FRONTS):
                offenders.append(f"{module} imports {name}")
    assert not offenders, "\n".join(sorted(offenders))
