"""The package's layers import only downward, and nothing imports in a cycle.

Every ``import`` in every module counts, the ones inside functions too: a lazy
import still ties the importer to the imported module's layer.
"""

import ast
import pathlib

import pytest

import cp_compile

PACKAGE = pathlib.Path(cp_compile.__file__).parent

# bottom to top; a module may import from its own layer or any layer below. ``tools`` holds the instruments
# (commands, the local rank pool, the reference Llama, memory probes), above the library they measure.
LAYERS = [
    "errors", "torch_compat", "counters", "layout", "kernels", "comm", "kinds", "schedules", "mixers", "cost",
    "compiler", "api", "tools", "__main__",
]  # fmt: skip
API_MODULES = {
    "__init__",
    "active",
    "calibrate",
    "eager",
    "guard",
    "hf",
    "inference",
    "masks",
    "plan",
    "registration",
    "sac",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in LAYERS:
        return top
    if top in API_MODULES:
        return "api"
    raise AssertionError(f"{module}: not in any layer; add it to tests/test_layers.py")


def _imports(path: pathlib.Path, module: str, is_package: bool) -> set[str]:
    """The package's modules that ``module`` imports (the deepest name that is a module)."""
    found = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            target = f"{stem}.{node.module}" if node.level and node.module else (stem or node.module)
            names = [f"{target}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "cp_compile" or name.startswith("cp_compile."):
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = {(_module_name(p), p) for p in PACKAGE.rglob("*.py")}
    modules = {name for name, _ in files}
    graph = {}
    for name, path in files:
        edges = set()
        for target in _imports(path, name, path.name == "__init__.py"):
            while target not in modules:  # "from .x import name": the module is x
                target = target.rsplit(".", 1)[0]
            if target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def test_every_module_has_a_layer():
    for module in _graph():
        _layer(module)


def test_imports_only_go_down():
    upward = sorted(
        f"{src} ({_layer(src)}) imports {dst} ({_layer(dst)})"
        for src, targets in _graph().items()
        for dst in targets
        if LAYERS.index(_layer(dst)) > LAYERS.index(_layer(src))
    )
    assert not upward, "\n".join(upward)


def _cycle(graph: dict[str, set[str]]):
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # a package importing its own submodules (to register or re-export them) is how
            # packages are put together; the reverse edge is the one that would form a cycle
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_check_sees_a_cycle_and_an_upward_import():
    """The checks can fail: a planted cycle is found, and a kind importing a pass is upward."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert LAYERS.index(_layer("cp_compile.compiler.choose")) > LAYERS.index(_layer("cp_compile.kinds.flex"))


@pytest.mark.parametrize(
    "folder", ["kernels", "comm", "kinds", "schedules", "cost", "compiler", "inference", "layout", "tools"]
)
def test_layers_are_folders(folder):
    assert (PACKAGE / folder / "__init__.py").is_file()


def test_import_cp_compile_loads_no_instrument():
    """The library alone: ``import cp_compile`` loads none of ``cp_compile.tools`` (nor what they import)."""
    import subprocess
    import sys

    code = "import sys, cp_compile; print(sorted(m for m in sys.modules if m.startswith('cp_compile.tools')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded


def test_every_kind_and_schedule_module_is_registered_in_one_place():
    """A module that enters a kind or a schedule when imported is imported by ``registration.py``, the one place
    ``import cp_compile`` registers them; and no other module imports one only for that (``noqa: F401``), save
    the package importing ``registration`` itself."""
    registering = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.Expr)) else None
            func = getattr(value, "func", None)
            if getattr(func, "id", None) in ("register_kind", "sequence_schedule", "heads_schedule"):
                registering.add(_module_name(path))
    registration = PACKAGE / "registration.py"
    imported = _imports(registration, "cp_compile.registration", False)
    assert registering and registering <= imported, sorted(registering - imported)
    side_effect_imports = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        if path != registration
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.startswith("from . import") and "noqa: F401" in line and line.split()[3] != "registration"
    ]
    assert not side_effect_imports, side_effect_imports
