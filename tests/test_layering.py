"""The house's shape: no import cycle among commgemm's modules (imports inside functions
included), the runtime path never imports
the measuring code (tuner, bench) or the CLI, every module says what it owns, and no file
grows past the size a reader can hold."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent / "commgemm"
MODULES = {
    ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
    for p in ROOT.rglob("*.py")
}
#: What runs on every call of an op (plan, AUTO, the algorithms and kernels).
RUNTIME = [
    m
    for m in MODULES
    if m.split(".")[1:2]
    in (
        ["ops"], ["gemm"], ["plan"], ["autodiff"], ["config"], ["registry"], ["operands"],
        ["epilogue"], ["vma"], ["distributed"], ["xla"], ["mosaic_gpu"], ["pallas_tpu"],
        ["grouped"], ["quant"], ["scaled"], ["operand_scaling"], ["bulk"], ["partitioned"],
        ["backend"], ["quantized_gemm"], ["layout"],
    )
    or m in ("commgemm.autotune.auto", "commgemm.autotune.cache", "commgemm.autotune.costmodel")
]  # fmt: skip
MEASURING = ("commgemm.bench", "commgemm.cli", "commgemm.autotune.tuner", "commgemm.demo")


def _imports(module: str, top_level_only: bool) -> set[str]:
    """The commgemm modules `module` imports (at module level only, or anywhere)."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the submodule; `from mod import name`, the module
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in MODULES] or [node.module]
        else:
            continue
        found |= {n for n in names if n in MODULES and n != module}
    return found


def test_no_import_cycle():
    graph = {m: _imports(m, top_level_only=False) for m in MODULES}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        if state.get(m) == 1:
            pytest.fail(f"import cycle: {' -> '.join(path[path.index(m) :] + [m])}")
        state[m] = 1
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


@pytest.mark.parametrize("module", sorted(RUNTIME))
def test_runtime_path_never_imports_measuring_code(module):
    bad = {n for n in _imports(module, top_level_only=False) if n.startswith(MEASURING)}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_docstring_and_size(module):
    text = MODULES[module].read_text()
    assert ast.get_docstring(ast.parse(text)), f"{module} has no docstring"
    assert len(text.splitlines()) <= 420, f"{module} has {len(text.splitlines())} lines"
