"""The project's import graph has no circles.

The graph is read from the source with `ast`, not by importing anything: every import statement of
every module in every folder of the repository (tests and the virtual environment aside) counts, the lazy ones inside
functions and those under `if TYPE_CHECKING:` (a circle by type is a circle to the reader) included.
An edge a -> b means module a imports project module b somewhere.
"""
import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parents[1]


def project_modules(root: Path) -> Dict[str, Path]:
    """Module name -> file, for every *.py of every folder (tests/ and hidden folders aside): the
    root's as <name>, a folder's as <folder>.<name>, a package's __init__.py as the package."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] == "tests" or any(p.startswith(".") for p in parts):
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imported_names(path: Path, module: str) -> List[str]:
    """Every dotted name an import statement in the file names (for `from a import b`: a and
    a.b, since b may be a submodule), TYPE_CHECKING blocks included."""
    names: List[str] = []
    package = module.rpartition(".")[0]

    class Visitor(ast.NodeVisitor):
        def visit_Import(self, node: ast.Import) -> None:
            names.extend(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:  # relative: from the file's package
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(p for p in parts + ([node.module] if node.module else []) if p)
            if base:
                names.append(base)
            names.extend(f"{base}.{alias.name}" if base else alias.name for alias in node.names)

    Visitor().visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def import_graph(root: Path) -> Dict[str, Set[str]]:
    """Project module -> the project modules it imports (itself left out)."""
    modules = project_modules(root)
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        deps = set()
        for name in imported_names(path, module):
            parts = name.split(".")
            for n in range(len(parts), 0, -1):  # the longest prefix that is a project module
                candidate = ".".join(parts[:n])
                if candidate in modules:
                    deps.add(candidate)
                    break
        deps.discard(module)
        graph[module] = deps
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle as [a, b, ..., a], or None. Depth-first search; a grey node met again closes a cycle."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {node: WHITE for node in graph}
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        colour[node] = GREY
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if colour.get(dep, BLACK) == GREY:
                return path[path.index(dep):] + [dep]
            if colour.get(dep) == WHITE:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        colour[node] = BLACK
        return None

    for node in sorted(graph):
        if colour[node] == WHITE:
            found = visit(node)
            if found:
                return found
    return None


def test_the_project_has_no_import_cycle():
    graph = import_graph(ROOT)
    # The reader sees what matters: lazy imports inside functions (fault_injection imports checkpoint
    # only in one), experiments' modules, and the schema root's imports of the modules it assembles.
    assert "checkpoint" in graph["fault_injection"]
    assert "experiments.tables" in graph["experiments.figures"]
    assert {"checkpoint", "data", "optim", "parallel", "clustermodel.schema"} <= graph["config"]
    assert graph["clustermodel.schema"] == set()  # the cluster model's switches: a leaf the schema root assembles
    assert {"parallel", "clustermodel.rates"} <= graph["clustermodel.perfmodel"]
    assert "experiments.slurm.submit" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def packages_imports(graph: Dict[str, Set[str]], package: str) -> Set[str]:
    """The project modules outside `package` that its modules import."""
    inside = lambda m: m == package or m.startswith(package + ".")  # noqa: E731
    return {d for m, deps in graph.items() if inside(m) for d in deps if not inside(d)}


def test_the_library_never_imports_experiments_and_the_packages_are_layers():
    """experiments/ holds scripts that use the library, never the reverse; observe/ imports nothing of
    the rest (every module may record into it), and parallelisms/ only the model, its kernels and
    observe/ (parallel.py applies it to the model from outside)."""
    graph = import_graph(ROOT)
    for module, deps in graph.items():
        if not module.startswith("experiments"):
            assert not any(d.startswith("experiments") for d in deps), f"{module} imports {sorted(deps)}"
    assert packages_imports(graph, "observe") == set()
    assert packages_imports(graph, "parallelisms") <= {"model", "kernels", "observe", "observe.spans"}


def test_errors_is_a_leaf_and_config_is_imported_by_none_it_imports():
    graph = import_graph(ROOT)
    assert graph["errors"] == set(), graph["errors"]
    assert graph["clustermodel.perfmodel"].isdisjoint({"clustermodel.cli"})
    for module in graph["config"]:
        assert "config" not in graph[module], f"{module} imports config.py back"
    # config.ConfigError stays a name for callers outside the project; the project's modules take it from errors.py
    for module, path in project_modules(ROOT).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "config":
                assert "ConfigError" not in [a.name for a in node.names], f"{module} imports ConfigError from config"


def test_the_detector_finds_a_known_cycle(tmp_path):
    """A synthetic project: a -> b (lazy, in a function) -> c -> a (from-import); a TYPE_CHECKING
    import back (d -> a, a -> d) is a cycle too; experiments' modules are nodes too."""
    (tmp_path / "a.py").write_text("import d\n\ndef f():\n    import b\n    return b\n")
    (tmp_path / "b.py").write_text("import os\nfrom c import thing\n")
    (tmp_path / "c.py").write_text("thing = 1\n\ndef g():\n    from a import f\n    return f\n")
    (tmp_path / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]

    (tmp_path / "c.py").write_text("thing = 1\n")  # the circle broken; the one by type is left
    assert find_cycle(import_graph(tmp_path)) == ["a", "d", "a"]
    (tmp_path / "d.py").write_text("from typing import TYPE_CHECKING\n")
    assert find_cycle(import_graph(tmp_path)) is None

    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "x.py").write_text("from experiments import y\n")
    (tmp_path / "experiments" / "y.py").write_text("def h():\n    import experiments.x\n")
    assert find_cycle(import_graph(tmp_path)) == ["experiments.x", "experiments.y", "experiments.x"]
