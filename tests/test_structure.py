"""The package's shape: no import circles (module-level, inside functions, or through the `__init__` of a package an
import runs), no arrow from the engine side up to the trainer or the measuring instruments, no module past the size a
reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "trl_roundalign"
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path], source: str | None = None) -> set[str]:
    """Modules of the package that `name` imports anywhere: at module level, inside functions and classes, under
    `if TYPE_CHECKING:`. A deferred import still ties the two modules together: it only hides a circle until
    the function runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from pkg import submodule` depends on the submodule
                deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    deps = {d for d in deps if d in mods and d != name}
    # Importing `a.b.c` runs the `__init__` of `a` and `a.b` first, unless the importer is inside them (then it is
    # already running): a package `__init__` that imports the importer back closes a circle too.
    inside = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} | {name}
    for d in list(deps):
        parts = d.split(".")
        deps |= {p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in mods and p not in inside}
    return deps - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_circles():
    mods = _modules()
    cycles = _cycles({m: _imports(m, p, mods) for m, p in mods.items()})
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_circle_through_a_function_level_import_is_found():
    """The check counts imports inside functions: the two circles it once missed would fail it again."""
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    for a, b, path, stmt in [
        ("trl_roundalign.engine.dispatch", "trl_roundalign.weight_transfer", mods["trl_roundalign.engine.dispatch"],
         "def f():\n    from ..weight_transfer import BACKEND\n"),
        ("trl_roundalign.analysis.per_layer", "trl_roundalign.analysis.compare",
         mods["trl_roundalign.analysis.per_layer"], "def f():\n    from .compare import apply_condition\n"),
    ]:
        assert _imports(a, path, mods, stmt) == {b}
        assert a in {m for c in _cycles({**graph, a: graph[a] | {b}}) for m in c}, (a, b)


def test_no_module_is_too_long():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_an_import_counts_the_package_init_it_runs():
    """`from ..weight_transfer.backend import X` in the engine runs weight_transfer/__init__.py, which imports the
    engine back: the circle the check once missed because it ignored package `__init__` edges."""
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    a = "trl_roundalign.engine.dispatch"
    deps = _imports(a, mods[a], mods, "def f():\n    from ..weight_transfer.backend import BACKEND\n")
    assert deps == {"trl_roundalign.weight_transfer.backend", "trl_roundalign.weight_transfer"}
    assert a in {m for c in _cycles({**graph, a: graph[a] | deps}) for m in c}
    # a module inside a package does not run that package's __init__ again
    assert "trl_roundalign.engine" not in _imports(a, mods[a], mods, "from .gemm import linear\n")


# Floors: a module imports only from its own floor or below. The engine side knows nothing of the trainer or of the
# measuring instruments; the trainer knows nothing of the measuring instruments (`analysis/`, `cli`).
_ABOVE = {
    # The model families answer their facts to the engine side (`models.linear_shapes` for `engine.gemm`'s measurement):
    # they import nothing of it (what they read of the machine or a linear's schedule lives below: `machine`, `ops`).
    "trl_roundalign.models": ("trl_roundalign.engine", "trl_roundalign.trainer", "trl_roundalign.analysis",
                              "trl_roundalign.cli"),
    "trl_roundalign.engine": ("trl_roundalign.trainer", "trl_roundalign.analysis", "trl_roundalign.cli"),
    "trl_roundalign.trainer": ("trl_roundalign.analysis", "trl_roundalign.cli"),
}


def test_no_arrow_runs_back_up():
    mods = _modules()
    back = []
    for m, p in mods.items():
        for floor, above in _ABOVE.items():
            if m == floor or m.startswith(floor + "."):
                back += [f"{m} -> {d}" for d in _imports(m, p, mods) if d.startswith(above)]
    assert not back, "imports from a higher floor: " + "; ".join(sorted(back))


def test_the_old_flat_module_paths_import_the_moved_modules():
    """Code and docs written against the flat layout (`trl_roundalign.config`, `.gemm`, `.verify`, ...) keep working:
    each old path imports the very module object of its new home."""
    import importlib

    import trl_roundalign

    for old, new in trl_roundalign._MOVED.items():
        assert importlib.import_module(f"trl_roundalign.{old}") is importlib.import_module(f"trl_roundalign.{new}"), old
        # The module keeps its own spec: a spec naming the old path makes every relative import inside it raise
        # "ImportWarning: __package__ != __spec__.parent" (an error under warnings-as-errors, as in CI).
        module = importlib.import_module(f"trl_roundalign.{new}")
        assert module.__spec__.name == module.__name__ == f"trl_roundalign.{new}", old
    import warnings

    from trl_roundalign.trainer import options

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from ..models import ARCH_SPECS", dict(vars(options)))  # a relative import in the module's globals
    from trl_roundalign.config import RoundAlignGRPOConfig  # noqa: F401

    from trl_roundalign.engine import EngineInfo, build_llm, engine_info, profile_for_engine  # noqa: F401
    from trl_roundalign.trainer import RoundAlignGRPOTrainer, check_trl_internals  # noqa: F401


def test_no_test_fixes_a_port():
    """Every port a test or its scripts listen on is one the kernel hands out (`helpers.env.free_port`): a fixed one
    fails whenever anything else on the machine holds it (EADDRINUSE on port 29500 on the Intel AMX machine)."""
    import re

    fixed = re.compile(
        r"""(main_process_port["']?\s*,\s*["']\d{4,5}["'])|(MASTER_PORT["']?\s*[=:,]\s*["']\d{4,5}["'])"""
        r"""|(\bport\s*=\s*\d{4,5}\b)|(127\.0\.0\.1:\d{4,5})"""
    )
    tests = PKG.parent / "tests"
    found = [
        f"{path.relative_to(tests)}:{i}: {line.strip()}"
        for path in sorted(tests.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if fixed.search(line)
    ]
    assert not found, "fixed ports in the tests:\n" + "\n".join(found)


def test_every_cli_command_a_message_or_page_names_exists():
    """A message or page that tells the user to run `trl-roundalign X` names a command the CLI has (a `serve` was named
    in the layout's refusal, the prefill-alone comment and docs/numerics.md before it existed)."""
    import re

    from trl_roundalign.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)
    root = PKG.parent
    named = {}
    for path in [*PKG.rglob("*.py"), *(root / "docs").rglob("*.md"), root / "README.md"]:
        # a command as written: in backticks, or at the start of a line of a shell block
        for cmd in re.findall(r"(?:`|^\s*(?:\$ )?)trl-roundalign ([a-z][a-z-]+)", path.read_text(), re.M):
            named.setdefault(cmd, path.relative_to(root))
    missing = {c: str(p) for c, p in named.items() if c not in commands}
    assert not missing, f"commands named but not in the CLI ({sorted(commands)}): {missing}"
