"""The package's layering, read from its source: no import cycles, `eval` at the bottom, the commands at the top."""

import ast
import os

import tvopd_trl


PACKAGE_DIR = os.path.dirname(tvopd_trl.__file__)


def _modules():
    """`{module name: path}` of every module of the package."""
    modules = {}
    for directory, _, files in os.walk(PACKAGE_DIR):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                parts = ["tvopd_trl", *os.path.relpath(path, PACKAGE_DIR)[: -len(".py")].split(os.sep)]
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _ancestors(module):
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _import_graph():
    """`{module: modules of the package it imports}`, with every import in the file, at the top or in a function, and
    every `importlib.import_module("a.b")` of a name written out (a lazy re-export imports all the same).

    Importing `a.b.c` runs `a` and `a.b` first, so those count too, except the importer's own ancestors, which have
    run before it whatever it imports."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import module`
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                targets.add(node.args[0].value)
        imported = {target for target in targets if target in modules}
        imported |= {ancestor for target in imported for ancestor in _ancestors(target) if ancestor in modules}
        graph[module] = imported - _ancestors(module) - {module}
    return graph


def _a_cycle(graph):
    """One import cycle of `graph` as a list of nodes, or `None`."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def _subpackage(module):
    """`tvopd_trl.eval.selection` -> `tvopd_trl.eval`; a top-level module is its own unit."""
    return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_back():
    cycle = _a_cycle(_import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_subpackage_imports_itself_back():
    # Modules can be acyclic while their packages are not (eval.benchmarks -> tiny.task, tiny.accuracy -> eval).
    graph = {}
    for module, targets in _import_graph().items():
        graph.setdefault(_subpackage(module), set()).update(
            _subpackage(target) for target in targets if _subpackage(target) != _subpackage(module)
        )
    cycle = _a_cycle(graph)
    assert cycle is None, f"import cycle between subpackages: {' -> '.join(cycle)}"


def test_eval_is_the_bottom_layer():
    # Everything else builds on the evaluation protocol; the tiny task registers its benchmark by reference.
    outside = {
        module: sorted(target for target in targets if not target.startswith("tvopd_trl.eval"))
        for module, targets in _import_graph().items()
        if module.startswith("tvopd_trl.eval")
    }
    assert not {module: targets for module, targets in outside.items() if targets}


def test_only_the_scripts_import_the_scripts():
    importers = {
        module: sorted(target for target in targets if target.startswith("tvopd_trl.scripts"))
        for module, targets in _import_graph().items()
        if not module.startswith("tvopd_trl.scripts")
    }
    assert not {module: targets for module, targets in importers.items() if targets}


def test_the_trainer_reads_in_one_sitting():
    # Each stage has a module of its own (docs/architecture.md); the trainer only composes them.
    with open(os.path.join(PACKAGE_DIR, "trainer.py")) as source:
        lines = len(source.read().splitlines())
    assert lines <= 650, f"tvopd_trl/trainer.py has {lines} lines: move a stage out (docs/architecture.md)"
