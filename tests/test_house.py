"""The package's shape, read from its source: files that fit a reader, short signatures, state that lives as long as
the call it serves, and imports that go one way."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cp_compile"
MODULES = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
_MUTATORS = {
    "append",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
}
_TABLES = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}


def _name(node) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _is_table(value) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _name(value.func) in _TABLES


def _module_tables() -> dict[str, str]:
    """Module-level dicts, lists and sets, by name: where each is made."""
    tables = {}
    for path, tree in MODULES.items():
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if value is not None and _is_table(value):
                tables.update(
                    {t.id: f"{path.relative_to(PACKAGE)}:{node.lineno}" for t in targets if isinstance(t, ast.Name)}
                )
    return tables


def _changed_inside_functions(names) -> set[str]:
    """The names among ``names`` that a function body changes (a mutating method, an item set or deleted)."""
    changed = set()
    for tree in MODULES.values():
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(function):
                targets = []
                if isinstance(node, ast.Attribute) and node.attr in _MUTATORS:  # called, or taken to be called
                    targets = [node.value]
                elif isinstance(node, (ast.Assign, ast.Delete)):
                    targets = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
                elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript):
                    targets = [node.target.value]
                changed.update(_name(t) for t in targets if _name(t) in names)
    return changed


def test_few_mutable_module_tables():
    """Per-call state lives on the call's own objects; registries are filled at import (kinds, schedules, the
    benchmark's variants, what integrations keep in force while a plan is)."""
    tables = _module_tables()
    changed = sorted(f"{tables[name]} {name}" for name in _changed_inside_functions(set(tables)))
    assert len(changed) <= 11, changed


def test_no_file_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def _decorated_by(function, names: set[str]) -> bool:
    return any(_name(d.func if isinstance(d, ast.Call) else d) in names for d in function.decorator_list)


def test_no_function_requires_more_than_ten_arguments():
    """A custom op's schema and a Triton kernel's launch arguments aside."""
    many = []
    for path, tree in MODULES.items():
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if _decorated_by(function, {"custom_op", "jit"}):
                continue
            args = function.args
            positional = [a.arg for a in (*args.posonlyargs, *args.args) if a.arg not in ("self", "cls")]
            required = len(positional) - len(args.defaults) + sum(d is None for d in args.kw_defaults)
            if required > 10:
                many.append(f"{path.relative_to(PACKAGE)}:{function.lineno} {function.name} ({required})")
    assert not many, many


def _imports() -> dict[str, set[str]]:
    """Each module's package imports (at any depth of its code), by dotted name."""
    names = {p: ".".join(("cp_compile", *p.relative_to(PACKAGE).with_suffix("").parts)) for p in MODULES}
    names = {p: n.removesuffix(".__init__") for p, n in names.items()}
    known = set(names.values())
    graph = {}
    for path, tree in MODULES.items():
        here = names[path].split(".") if path.name == "__init__.py" else names[path].split(".")[:-1]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
                module = ".".join(filter(None, (base, node.module))) if node.level else node.module or ""
                for alias in node.names:  # a submodule imported by name, else the module itself
                    found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[names[path]] = {m for m in found if m in known and m != names[path]}
    return graph


def test_no_import_cycle():
    """Imports go downward only; a package's ``__init__`` importing its own modules is not a cycle."""
    graph = _imports()
    edges = {
        m: {n for n in deps if not m.startswith(n + ".") and not n.startswith(m + ".")} for m, deps in graph.items()
    }
    state: dict[str, int] = {}

    def visit(module: str, path: list) -> list:
        state[module] = 1
        for dep in sorted(edges[module]):
            if state.get(dep) == 1:
                return [*path, module, dep]
            if dep not in state and (cycle := visit(dep, [*path, module])):
                return cycle
        state[module] = 2
        return []

    cycles = [c for m in sorted(edges) if m not in state and (c := visit(m, []))]
    assert not cycles, cycles
