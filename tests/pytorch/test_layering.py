"""The package's structure, checked statically: layering, import cycles, file size, and no
references to a DESIGN.md the repository does not contain.

Every .py file under transformer_engine/ is parsed (``ast``; nothing is imported), and every
import in it is resolved to the absolute name of the module it loads: relative imports against
the file's package, ``from pkg import name`` to ``pkg.name`` when ``name`` is a submodule, and
``importlib.import_module("...")`` with a literal name. Imports inside functions and under
``if TYPE_CHECKING:`` count like the others: a deferred import is still a dependency, and hiding
a cycle behind one is what this test exists to stop. The parent packages that Python runs
implicitly (``transformer_engine/pytorch/__init__.py`` when ``pytorch.device`` is imported) are
not edges: every submodule would otherwise depend on its own package's re-exports.

The lower half of the file tests the checker itself on small synthetic trees.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

# Not from utils.py: this test imports nothing of the package it checks.
REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "transformer_engine"

# The architecture's layering (docs/architecture.md): a module may import modules of its own
# layer or of lower layers, never of a higher one. Patterns are fnmatch patterns over dotted
# module names ("X.*" is every submodule of X, at any depth). A module that no pattern matches
# fails the test: a new subpackage must be placed in a layer here, on purpose.
LAYERS: list[tuple[int, str, tuple[str, ...]]] = [
    (0, "common code, the native binding, constants", (
        "transformer_engine",
        "transformer_engine.__main__",
        "transformer_engine._native",
        "transformer_engine.common",
        "transformer_engine.common.*",
        "transformer_engine.pytorch.constants",
    )),
    (1, "the device seam, and upstream's small helpers over it", (
        "transformer_engine.pytorch.device",
        "transformer_engine.pytorch.utils",
    )),
    (2, "pure-PyTorch kernel specification", (
        "transformer_engine.pytorch.reference",
        "transformer_engine.pytorch.reference_fp4",
        "transformer_engine.pytorch.reference_blocks",
    )),
    (3, "kernel wrappers", (
        "transformer_engine.pytorch.cpp_extensions",
        "transformer_engine.pytorch.cpp_extensions.*",
    )),
    (4, "quantized tensors", (
        "transformer_engine.pytorch.quantized_tensor",
        "transformer_engine.pytorch.tensor",
        "transformer_engine.pytorch.tensor.*",
    )),
    (5, "quantization state and the checkpoint format", (
        "transformer_engine.pytorch.quantization",
        "transformer_engine.pytorch.quantization.*",
        "transformer_engine.pytorch.extra_state",
        "transformer_engine.pytorch.extra_state.*",
        "transformer_engine.pytorch._extra_state",
        # CustomRecipe factories and reference quantizers: build on quantizers and roles only
        "transformer_engine.pytorch.custom_recipes",
        "transformer_engine.pytorch.custom_recipes.*",
    )),
    (6, "the functional core; the optimizers, MoE permutation and routing, CPU offload (plain PyTorch)", (
        "transformer_engine.pytorch.functional",
        "transformer_engine.pytorch.functional.*",
        "transformer_engine.pytorch.optimizers",
        "transformer_engine.pytorch.optimizers.*",
        "transformer_engine.pytorch.permutation",
        "transformer_engine.pytorch.router",
        "transformer_engine.pytorch.cpu_offload",
        "transformer_engine.pytorch._offload_copies",
    )),
    (7, "distributed", (
        "transformer_engine.pytorch.distributed",
        "transformer_engine.pytorch._tensor_parallel",
        "transformer_engine.pytorch._sequence_parallel_input",
        "transformer_engine.pytorch._parallel_backward",
        "transformer_engine.pytorch._ring_gemm",
        "transformer_engine.pytorch._userbuffers",
        "transformer_engine.pytorch._block_gather",
        "transformer_engine.pytorch._sharded_parameters",
        "transformer_engine.pytorch._distributed_checkpoint",
        "transformer_engine.pytorch.cross_entropy",
    )),
    (8, "modules and fusible operations", (
        "transformer_engine.pytorch.module",
        "transformer_engine.pytorch.module.*",
        "transformer_engine.pytorch.ops",
        "transformer_engine.pytorch.ops.*",
    )),
    (9, "attention and the composed layers, CUDA graphs (clients of the modules)", (
        "transformer_engine.pytorch.attention",
        "transformer_engine.pytorch.attention.*",
        "transformer_engine.pytorch.transformer",
        "transformer_engine.pytorch.graph",
        "transformer_engine.pytorch._graph_arguments",
        "transformer_engine.pytorch._graph_copies",
        "transformer_engine.pytorch._graph_schedule",
        "transformer_engine.pytorch._graph_buffers",
        "transformer_engine.pytorch._graph_streams",
        "transformer_engine.pytorch._graph_captured",
    )),
    (10, "the public package and the compat shims", (
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.fp8",
        "transformer_engine.pytorch.float8_tensor",
    )),
]  # fmt: skip

# Top-level packages above the whole table: clients of transformer_engine.pytorch that
# nothing under transformer_engine/ may import (transformer_engine_torch is upstream's
# extension-module name, `import transformer_engine_torch as tex`).
CLIENT_PACKAGES = ("transformer_engine_torch",)

# Groups of one layer that must not import each other (either direction).
PEERS: list[tuple[str, str]] = [
    ("transformer_engine.pytorch.module", "transformer_engine.pytorch.ops")
]

# Extension modules built from the C++ sources: importable once built, absent from a fresh
# checkout, so they are modules of the tree either way.
BUILT_MODULES = {"transformer_engine._native"}

MAX_LINES = 600
TEXT_SUFFIXES = {".py", ".md", ".rst", ".txt", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".cmake", ""}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (absolute, resolved)
    path: str  # importing file, relative to the scanned root
    line: int
    text: str  # the import as written, for the message


# --- scanning ------------------------------------------------------------------------------------
def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(root: Path, package: str = PACKAGE) -> list[Path]:
    return sorted(p for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def known_modules(root: Path, package: str = PACKAGE) -> set[str]:
    """Modules of the tree: .py files, package folders (namespace ones too), extensions."""
    found = {module_name(p, root) for p in python_files(root, package)}
    for p in (root / package).rglob("*"):
        if "__pycache__" in p.parts:
            continue
        if p.is_dir():
            found.add(".".join(p.relative_to(root).parts))
        elif p.suffix in (".so", ".pyd") and p.name.count(".") >= 2:
            # An extension module carries its ABI tag (_native.cpython-311-x86_64-linux-gnu.so);
            # a plain libX.so next to it is a shared library, not importable.
            found.add(".".join(p.relative_to(root).parent.parts + (p.name.split(".")[0],)))
    found.add(package)
    return found | {m for m in BUILT_MODULES if m.startswith(package + ".")}


def _package_of(name: str, is_package: bool) -> str:
    return name if is_package else name.rpartition(".")[0]


def _resolve_relative(module: str | None, level: int, package: str) -> str:
    base = package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _import_text(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0]


def imports_of(
    source: str,
    name: str,
    is_package: bool,
    modules: set[str],
    path: str = "",
    package: str = PACKAGE,
) -> list[Import]:
    """Every import of a module of ``package`` in ``source`` (the module ``name``)."""
    found = []

    def add(target: str, node: ast.AST, text: str | None = None):
        if target == package or target.startswith(package + "."):
            found.append(Import(name, target, path, node.lineno, text or _import_text(node)))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(node.module, node.level, _package_of(name, is_package))
            submodules = (f"{base}.{alias.name}" for alias in node.names)
            targets = {sub if sub in modules else base for sub in submodules}
            for target in sorted(targets):
                add(target, node)
        elif isinstance(node, ast.Call) and _is_import_module_call(node):
            add(node.args[0].value, node)
    return sorted(found, key=lambda imp: (imp.line, imp.target))  # ast.walk is breadth-first


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return (
        called == "import_module"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def scan(root: Path, package: str = PACKAGE) -> list[Import]:
    modules = known_modules(root, package)
    found = []
    for path in python_files(root, package):
        name = module_name(path, root)
        rel = str(path.relative_to(root))
        found += imports_of(
            path.read_text(), name, path.name == "__init__.py", modules, rel, package
        )
    return found


# --- the rules -----------------------------------------------------------------------------------
def layer_of(module: str, layers=LAYERS) -> int | None:
    matches = {
        layer
        for layer, _, patterns in layers
        for pat in patterns
        if fnmatch.fnmatchcase(module, pat)
    }
    return matches.pop() if len(matches) == 1 else None


def _in_group(module: str, group: str) -> bool:
    return module == group or module.startswith(group + ".")


def layering_violations(
    imports: list[Import], modules: set[str], layers=LAYERS, peers=PEERS
) -> list[str]:
    problems = []
    for name in sorted(modules):
        if layer_of(name, layers) is None:
            problems.append(
                f"module {name} matches no pattern (or several) of the layer table: add it to the "
                "layer table in tests/pytorch/test_layering.py (docs/architecture.md's layering)"
            )
    for imp in imports:
        where = f"{imp.path}:{imp.line}: `{imp.text}`"
        if imp.target not in modules:
            problems.append(f"{where} imports {imp.target}, which is no module of the tree")
            continue
        src, dst = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if src is not None and dst is not None and dst > src:
            problems.append(
                f"{where}: layer {src} ({imp.source}) imports layer {dst} ({imp.target}); "
                "rule: a layer imports only its own and lower layers"
            )
        for a, b in peers:
            for mine, theirs in ((a, b), (b, a)):
                if _in_group(imp.source, mine) and _in_group(imp.target, theirs):
                    problems.append(
                        f"{where}: {imp.source} imports {imp.target}; rule: {a} and {b} are peers "
                        "and neither imports the other"
                    )
    return problems


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component with a cycle (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_cycle_in(sorted(c), edges) for c in sorted(components, key=min)]


def _cycle_in(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first node (breadth-first, inside it)."""
    start, members = component[0], set(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]  # path runs back from v to start
                if w in members and w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component of size > 1 always has one


def import_graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target != imp.source:
            edges.setdefault(imp.source, set()).add(imp.target)
    return edges


def cycle_messages(imports: list[Import]) -> list[str]:
    where = {(i.source, i.target): f"{i.path}:{i.line}" for i in imports}
    messages = []
    for cycle in find_cycles(import_graph(imports)):
        hops = ", ".join(f"{a} -> {b} ({where[a, b]})" for a, b in zip(cycle, cycle[1:]))
        messages.append(f"import cycle {' -> '.join(cycle)}: {hops}")
    return messages


def long_files(root: Path, package: str = PACKAGE, limit: int = MAX_LINES) -> list[str]:
    problems = []
    for path in sorted((root / package).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in TEXT_SUFFIXES:
            lines = len(path.read_text(errors="replace").splitlines())
            if lines > limit:
                problems.append(
                    f"{path.relative_to(root)} has {lines} lines (the limit is {limit})"
                )
    return problems


def design_md_mentions(root: Path, places=(PACKAGE, "docs", "README.md")) -> list[str]:
    problems = []
    for place in places:
        top = root / place
        paths = [top] if top.is_file() else sorted(top.rglob("*")) if top.exists() else []
        for path in paths:
            if (
                not path.is_file()
                or "__pycache__" in path.parts
                or path.suffix not in TEXT_SUFFIXES
            ):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"DESIGN\.md", line):
                    problems.append(
                        f"{path.relative_to(root)}:{number} mentions DESIGN.md, which does not "
                        "exist: point to docs/architecture.md"
                    )
    return problems


def client_problems(root: Path, clients=CLIENT_PACKAGES) -> list[str]:
    """Nothing under transformer_engine/ imports a client package; a client imports only
    modules of transformer_engine that exist; client files keep the line limit."""
    modules = known_modules(root)
    problems = []
    for client in clients:
        if not (root / client).exists():
            continue
        for path in python_files(root):
            name, rel = module_name(path, root), str(path.relative_to(root))
            for imp in imports_of(path.read_text(), name, path.name == "__init__.py", set(), rel,
                                  client):  # fmt: skip
                problems.append(
                    f"{rel}:{imp.line}: `{imp.text}` imports the client package {client}; "
                    "rule: transformer_engine never imports its clients"
                )
        for path in python_files(root, client):
            name, rel = module_name(path, root), str(path.relative_to(root))
            for imp in imports_of(path.read_text(), name, path.name == "__init__.py", modules, rel):
                if imp.target not in modules:
                    problems.append(f"{rel}:{imp.line} imports {imp.target}, no module of the tree")
        problems += long_files(root, client)
    return problems


def _report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


# --- the repository ------------------------------------------------------------------------------
def test_imports_follow_the_layers():
    problems = layering_violations(scan(REPO_ROOT), known_modules(REPO_ROOT))
    assert not problems, _report(problems)


def test_no_import_cycles():
    problems = cycle_messages(scan(REPO_ROOT))
    assert not problems, _report(problems)


def test_no_file_over_the_line_limit():
    problems = long_files(REPO_ROOT)
    assert not problems, _report(problems)


def test_no_mention_of_design_md():
    problems = design_md_mentions(REPO_ROOT)
    assert not problems, _report(problems)


def test_client_packages_sit_above_every_layer():
    problems = client_problems(REPO_ROOT)
    assert not problems, _report(problems)


def test_the_layer_table_matches_each_module_once():
    for module in sorted(known_modules(REPO_ROOT)):
        matches = [
            layer for layer, _, pats in LAYERS for p in pats if fnmatch.fnmatchcase(module, p)
        ]
        assert len(matches) <= 1, f"{module} matches layers {matches}: the table overlaps"


# --- the checker, on synthetic trees -------------------------------------------------------------
def make_tree(root: Path, files: dict[str, str]) -> Path:
    """Write ``{relative path: source}`` under ``root`` (empty __init__.py files added)."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for path in list(root.rglob("*.py")):
        for parent in path.relative_to(root).parents[:-1]:
            init = root / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
    return root


def check_tree(root: Path) -> tuple[list[str], list[str]]:
    imports = scan(root)
    return layering_violations(imports, known_modules(root)), cycle_messages(imports)


TE = "transformer_engine/pytorch"


def test_checker_accepts_a_downward_import(tmp_path):
    make_tree(
        tmp_path, {f"{TE}/device.py": "", f"{TE}/module/linear.py": "from ..device import x\n"}
    )
    assert check_tree(tmp_path) == ([], [])


def test_checker_catches_an_upward_import_inside_a_function(tmp_path):
    make_tree(tmp_path, {
        f"{TE}/device.py": "def f():\n    from .module import linear\n",
        f"{TE}/module/linear.py": "",
    })  # fmt: skip
    layering, cycles = check_tree(tmp_path)
    assert len(layering) == 1 and not cycles
    message = layering[0]
    assert f"{TE}/device.py:2" in message and "from .module import linear" in message
    assert "layer 1 (transformer_engine.pytorch.device)" in message
    assert "layer 8 (transformer_engine.pytorch.module.linear)" in message


def test_checker_catches_peers_importing_each_other(tmp_path):
    make_tree(tmp_path, {
        f"{TE}/ops/basic/bias.py": "import transformer_engine.pytorch.module.linear\n",
        f"{TE}/module/linear.py": "",
    })  # fmt: skip
    layering, _ = check_tree(tmp_path)
    assert (
        len(layering) == 1
        and "are peers" in layering[0]
        and f"{TE}/ops/basic/bias.py:1" in layering[0]
    )


def test_checker_resolves_relative_imports_and_submodule_names(tmp_path):
    modules = {"transformer_engine.pytorch.ops.op", "transformer_engine.pytorch.ops"}
    source = "from . import op, helper\nfrom .op import Thing\nfrom .. import ops\n"
    found = imports_of(source, "transformer_engine.pytorch.ops.fuser", False, modules)
    assert [(i.line, i.target) for i in found] == [
        (1, "transformer_engine.pytorch.ops"),  # helper: a name of the package
        (1, "transformer_engine.pytorch.ops.op"),  # op: a submodule
        (2, "transformer_engine.pytorch.ops.op"),
        (3, "transformer_engine.pytorch.ops"),
    ]
    in_init = imports_of("from .op import Thing\n", "transformer_engine.pytorch.ops", True, modules)
    assert [i.target for i in in_init] == ["transformer_engine.pytorch.ops.op"]
    dynamic = imports_of(
        'import importlib\nimportlib.import_module("transformer_engine.x")\n', "m", False, modules
    )
    assert [i.target for i in dynamic] == ["transformer_engine.x"]


def test_checker_reports_a_cycle_with_its_path(tmp_path):
    make_tree(tmp_path, {
        f"{TE}/ops/op.py": "from .fuser import Fuser\n",
        f"{TE}/ops/fuser.py": "def f():\n    from . import op\n",
    })  # fmt: skip
    layering, cycles = check_tree(tmp_path)
    assert not layering
    assert len(cycles) == 1
    op, fuser = "transformer_engine.pytorch.ops.op", "transformer_engine.pytorch.ops.fuser"
    assert cycles[0].startswith(f"import cycle {fuser} -> {op} -> {fuser}:")
    assert f"{TE}/ops/fuser.py:2" in cycles[0] and f"{TE}/ops/op.py:1" in cycles[0]


def test_find_cycles_on_plain_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    two = find_cycles({"a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"x", "a"}})
    assert two == [["a", "b", "a"], ["x", "y", "x"]]


def test_checker_fails_loudly_on_a_module_missing_from_the_table(tmp_path):
    make_tree(tmp_path, {f"{TE}/unplaced/core.py": "", f"{TE}/device.py": ""})
    layering, _ = check_tree(tmp_path)
    assert any(
        "transformer_engine.pytorch.unplaced.core" in p and "add it to the layer table" in p
        for p in layering
    )


def test_checker_reports_an_import_of_a_missing_module(tmp_path):
    make_tree(tmp_path, {f"{TE}/device.py": "import transformer_engine.pytorch.gone\n"})
    layering, _ = check_tree(tmp_path)
    assert any("transformer_engine.pytorch.gone, which is no module" in p for p in layering)


def test_long_files_and_design_md_checks(tmp_path):
    make_tree(tmp_path, {
        f"{TE}/device.py": "x = 1\n" * (MAX_LINES + 1),
        f"{TE}/reference.py": "x = 1\n" * MAX_LINES,
        "docs/a.md": "see\nDESIGN.md\n",
        "README.md": "fine\n",
    })  # fmt: skip
    assert long_files(tmp_path) == [
        f"{TE}/device.py has {MAX_LINES + 1} lines (the limit is {MAX_LINES})"
    ]
    mentions = design_md_mentions(tmp_path)
    assert len(mentions) == 1 and mentions[0].startswith("docs/a.md:2 mentions DESIGN.md")


def test_checker_catches_an_import_of_a_client_package(tmp_path):
    make_tree(tmp_path, {
        f"{TE}/device.py": "def f():\n    import transformer_engine_torch as tex\n",
        "transformer_engine_torch/__init__.py": "from transformer_engine.pytorch import device\n",
        "transformer_engine_torch/_gone.py": "import transformer_engine.pytorch.gone\n",
    })  # fmt: skip
    problems = client_problems(tmp_path)
    assert len(problems) == 2
    assert f"{TE}/device.py:2" in problems[0] and "never imports its clients" in problems[0]
    gone = "transformer_engine_torch/_gone.py:1 imports transformer_engine.pytorch.gone"
    assert gone in problems[1]
