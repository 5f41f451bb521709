"""The package's shape: no import cycle anywhere (function-level imports included), plans
that never import kernels or the DSL, kernel classes in one idiom, no module over the size
budget, and the process state's single owner with its reset hook."""

from __future__ import annotations

import ast
import pathlib

import pytest

import csa_ops
from csa_ops import host
from csa_ops.config import Direction
from csa_ops.kernels import FAMILIES, KERNELS
from csa_ops.state import STATE, ForwardNumerics

ROOT = pathlib.Path(csa_ops.__file__).resolve().parent.parent
# Importable names of the package's source folders (meta/ and lowering/ live at the top).
PACKAGES = {"csa_ops": ROOT / "csa_ops", "csa_ops.meta": ROOT / "meta",
            "csa_ops.lowering": ROOT / "lowering"}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """Package modules that `name` imports anywhere in its body. `from . import x` depends
    on x, not on the package whose namespace it reads."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names]
            hits = [m for m in submodules if m in modules]
            found.update(hits if hits else [target] if target in modules else [])
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    found.discard(name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_anywhere_in_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # The walk sees real edges (a broken resolver would find no cycle in anything).
    assert "csa_ops.kernels.families" in graph["csa_ops.kernels.extend_plan"]
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_plans_never_import_kernels_or_the_dsl():
    modules = _modules()
    kernel_modules = {f"csa_ops.kernels.{family}.{entry.split(':')[0]}"
                      for family, table in KERNELS.items() for entry in table.values()}
    for name in ("csa_ops.kernels.window.plan", "csa_ops.kernels.streaming.plan",
                 "csa_ops.kernels.families", "csa_ops.kernels.extend_plan",
                 "csa_ops.kernels.calls", "csa_ops.config"):
        imported = _imports(name, modules[name], modules)
        assert not imported & kernel_modules, (name, imported & kernel_modules)
        tree = ast.parse(modules[name].read_text())
        external = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        external |= {node.module for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and not node.level}
        assert not {m for m in external if m and m.split(".")[0] in ("cutlass", "cuda")}, name


def test_every_kernel_is_a_class_with_a_jit_launch():
    for family, table in KERNELS.items():
        for direction, entry in table.items():
            module, name = entry.split(":")
            path = ROOT / "csa_ops" / "kernels" / family / f"{module}.py"
            tree = ast.parse(path.read_text())
            classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
            assert name in classes, (family, direction)
            calls = [node for node in classes[name].body
                     if isinstance(node, ast.FunctionDef) and node.name == "__call__"]
            assert calls and any(ast.unparse(d) == "cute.jit" for d in calls[0].decorator_list)
            # No closure factory: no function in the module defines a kernel inside it.
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    nested = [n for n in ast.walk(node) if isinstance(n, ast.FunctionDef)
                              and any("cute" in ast.unparse(d) for d in n.decorator_list)]
                    assert not nested, (path.name, node.name)


@pytest.mark.parametrize("name, path", sorted(_modules().items()))
def test_no_module_over_the_size_budget(name, path):
    assert len(path.read_text().splitlines()) <= 800, name


FUSED = {Direction.EXTEND_STORE, Direction.ROWS_STORE, Direction.FORWARD_EPILOGUE,
         Direction.BACKWARD_EPILOGUE}


def test_every_family_implements_the_contract():
    for name, plan in FAMILIES.items():
        for function in ("configure", "supports", "fast_forward", "enumerate_keys",
                         "plan_forward", "plan_backward", "extend_key", "extend_launches",
                         "plan_extend", "plan_extend_launch"):
            assert callable(getattr(plan, function, None)), (name, function)
        assert set(KERNELS[name]) - FUSED == {
            Direction.FORWARD, Direction.BACKWARD, Direction.EXTEND}
    # The register-window family's decode step with the store's epilogue in one kernel, a
    # prefill's two, and the training forward and backward with their epilogue.
    assert FUSED <= set(KERNELS["window"])
    # The row epilogue: the store's kernel and the training forward's.
    assert set(KERNELS) - set(FAMILIES) == {"epilogue"}
    assert set(KERNELS["epilogue"]) == {Direction.STORE, Direction.EPILOGUE,
                                        Direction.EPILOGUE_BACKWARD}


def test_the_state_resets_to_a_fresh_process():
    host.set_key(host.select_key(4, 2, 128, "bfloat16", "sm_90a", Direction.FORWARD),
                 Direction.FORWARD)
    STATE.versions["probe"] = "1"
    cleared = []
    STATE.on_reset(lambda: cleared.append(True))
    try:
        STATE.reset()
        assert not STATE.keys and not STATE.problems and "probe" not in STATE.versions
        assert STATE.forward_numerics is ForwardNumerics.CERTIFIED and cleared
        assert host.cache_info()["size"] == 0  # the compiled kernels' hook ran too
    finally:
        STATE._reset_hooks.pop()


def test_the_forward_numerics_mode_picks_the_streaming_forward_key():
    def forward_key():
        return host._key_for(128, 2, 512, "bfloat16", "sm_90a", Direction.FORWARD)

    certified, window = forward_key(), host._key_for(4, 2, 512, "bfloat16", "sm_90a",
                                                     Direction.FORWARD)
    with csa_ops.forward_numerics("fast"):
        assert csa_ops.get_forward_numerics() == "fast"
        assert forward_key().knobs.parity == 0 and certified.knobs.parity == 1
        # The register windows are certified at full speed: unchanged.
        assert host._key_for(4, 2, 512, "bfloat16", "sm_90a", Direction.FORWARD) == window
        # The backward has no numerics mode.
        assert host._key_for(128, 2, 512, "bfloat16", "sm_90a", Direction.BACKWARD).knobs \
            == host.select_key(128, 2, 512, "bfloat16", "sm_90a", Direction.BACKWARD).knobs
    assert csa_ops.get_forward_numerics() == "certified" and forward_key() == certified
    with pytest.raises(ValueError, match="forward numerics must be one of"):
        csa_ops.set_forward_numerics("quick")
    assert csa_ops.get_forward_numerics() == "certified"


def test_every_package_is_installed():
    """pyproject.toml lists its packages by name: a new folder missing there installs in
    editable mode (the folder is on the path) but not from a wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert found == listed
