"""The package's import graph: no cycle, and a runtime that never reaches for the planner.

Every ``import`` counts, wherever it is written: at module level, inside a function (the lazy
imports that keep start-up short) or under ``TYPE_CHECKING``. A cycle of any of them means two
modules that cannot be read, tested or moved one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fxckpt"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _executed(tree: ast.Module) -> list[ast.stmt]:
    """The import statements that run when the module is imported: module and class bodies and
    the branches of ``if``/``try``/``with``, not function bodies or ``if TYPE_CHECKING:``."""
    found: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                found.append(stmt)
            elif isinstance(stmt, ast.If):
                test = stmt.test
                checking = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
                visit(stmt.orelse)
                if not checking:
                    visit(stmt.body)
            elif isinstance(stmt, ast.Try):
                for part in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse,
                             stmt.finalbody):
                    visit(part)
            elif isinstance(stmt, (ast.With, ast.ClassDef)):
                visit(stmt.body)

    visit(tree.body)
    return found


def _graph(at_import: bool = False) -> nx.DiGraph:
    """Module -> module it imports (``from a.b import c`` names ``a.b.c`` when that is a
    module); a package's edges to its own modules and to the root are left out. ``at_import``
    keeps only the imports that run when the module is imported."""
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in (_executed(tree) if at_import else ast.walk(tree)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for target in names:
                if (target in modules and target != "fxckpt" and target != module
                        and not target.startswith(module + ".")):
                    graph.add_edge(module, target)
    return graph


def test_the_graph_sees_the_package() -> None:
    graph = _graph()
    assert graph.number_of_nodes() > 100
    assert graph.has_edge("fxckpt.runtime.offload", "fxckpt.runtime.segment")
    assert graph.has_edge("fxckpt.serve.whole_graph", "fxckpt.planning.fit")  # module level
    assert graph.has_edge("fxckpt.cost.annotate", "fxckpt.measure.meta_run")  # a moved module
    # imported inside functions
    assert graph.has_edge("fxckpt.serve.dispatch", "fxckpt.serve.whole_graph")


def test_the_top_level_holds_at_most_twelve_modules() -> None:
    """The package's top level is its vocabulary (the API, config, strategy, budget, plan,
    errors and the few types users name); running and measuring a step, showing plans, the
    command line and every phase of the compiler live in the package whose concern they are."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules at fxckpt/'s top level: {', '.join(top)}"


def test_no_module_imports_itself_through_others() -> None:
    cycles = sorted(sorted(c) for c in nx.simple_cycles(_graph()))
    assert not cycles, f"import cycles: {cycles}"


def test_the_runtime_never_imports_the_planner() -> None:
    """A transformed or loaded module runs on ``fxckpt.runtime`` alone: the passes, the solver
    and the planner stay out of its imports (and out of a saved export's)."""
    graph = _graph()
    planning = ("fxckpt.passes", "fxckpt.solver", "fxckpt.serve", "benchmarks")
    reached = {m for r in graph if r.startswith("fxckpt.runtime")
               for m in nx.descendants(graph, r)}
    assert not sorted(m for m in reached if m.startswith(planning))


FRAMEWORKS = ("transformers", "diffusers", "peft", "accelerate", "lightning")
"""Frameworks whose rules live in ``fxckpt/integrations/`` (``benchmarks/`` builds their models
from outside the package)."""


def _outside_integrations() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "integrations"]


def test_framework_rules_live_in_integrations() -> None:
    """No module outside ``integrations/`` imports a framework or names one of its modules in
    code (docstrings and messages may mention them)."""
    found = []
    for path in _outside_integrations():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docstrings):
                names = [w for w in node.value.replace("(", " ").split()
                         if w.startswith(tuple(f + "." for f in FRAMEWORKS))]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in FRAMEWORKS]
    assert not found, "\n".join(found)


def test_each_phase_of_the_compiler_imports_only_earlier_phases() -> None:
    """capture -> cost -> passes -> planning -> pipeline -> serve: no package reaches a later
    one (fit lowers each candidate plan to verify it, so the rewrites come before the
    planning; serve runs them all for a call)."""
    order = ["fxckpt.capture", "fxckpt.cost", "fxckpt.passes", "fxckpt.planning",
             "fxckpt.pipeline", "fxckpt.serve"]
    graph = _graph()
    later = []
    for i, phase in enumerate(order):
        for module in (m for m in graph if m.startswith(phase + ".")):
            later += [f"{module} -> {target}" for target in graph.successors(module)
                      if target.startswith(tuple(s + "." for s in order[i + 1:]))]
    assert not later, "\n".join(later)


def test_importing_runs_a_chain_of_at_most_eleven_modules() -> None:
    """The deepest chain of imports that run at import time (serve.whole_graph -> planning ->
    cost -> runtime) is 11 modules. Imports inside functions (the CLI and inspect reaching the
    whole stack lazily) make a chain of 20 and are not counted: they run only when that function
    is called."""
    graph = _graph(at_import=True)
    # only inside functions
    assert not graph.has_edge("fxckpt.serve.dispatch", "fxckpt.serve.whole_graph")
    assert graph.has_edge("fxckpt.serve.whole_graph", "fxckpt.planning.fit")
    chain = nx.dag_longest_path(graph)
    assert len(chain) <= 11, " -> ".join(chain)
