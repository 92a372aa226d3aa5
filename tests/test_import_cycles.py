"""No two modules of the package import each other, directly or round a longer loop, counting every
import statement: module level, inside functions and under TYPE_CHECKING alike. An import inside
a function still ties the two modules together (each needs the other to make sense, and a change
to one ripples into the other); it only hides the loop from Python at import time, and from a test
that reads the module level alone.

`from package import name` depends on the module `package.name` when there is one, else on the
package itself (a name its __init__ defines or imports); on the package too when its __init__
imports modules of ours at module level, since importing `package.name` runs that first. A facade
__init__ that imports nothing at module level (`lmfoundry.compile`, whose call imports the API)
is no dependency of the modules imported through it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_layers import imports, modules


def dependencies(path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that any import statement of the file names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in mods else node.module)
                if sub in mods and node.module in mods and _runs_imports(mods[node.module]):
                    found.add(node.module)
    return {m for m in found if m in mods}


def _runs_imports(path: Path) -> bool:
    """Whether a package __init__ imports modules of ours at module level (when it is imported)."""
    return path.name == "__init__.py" and any(top for _, top in imports(path, ""))


def import_graph() -> dict[str, list[str]]:
    mods = modules()
    return {name: sorted(dependencies(path, mods) - {name}) for name, path in mods.items()}


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (a set of modules every one of
    which reaches every other), as a sorted list: Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def loop_through(component: list[str], graph: dict[str, list[str]]) -> list[str]:
    """One import loop inside a component, for the failure message: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:  # breadth first from start, within the component, back to start
        node = queue.pop(0)
        for nxt in graph[node]:
            if nxt == start:
                return paths[node] + [start]
            if nxt in members and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return component


def test_no_import_cycle_counting_every_import() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (every import statement counted), a loop of each:\n" + "\n".join(
        f"{' -> '.join(loop_through(c, graph))}  ({len(c)} modules: {', '.join(c)})" for c in found)


def test_the_graph_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The rule bites: imports inside a function and under TYPE_CHECKING are edges, `from
    package import module` is an edge to the module, and a loop of such edges is a cycle."""
    planted = tmp_path / "planted.py"
    planted.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from lmfoundry.errors import UserError\n\n"
                       "def f():\n    from lmfoundry.model import reference\n    import lmfoundry.model.config\n")
    assert dependencies(planted, modules()) == {"lmfoundry.errors", "lmfoundry.model.reference",
                                                "lmfoundry.model.config"}
    # through a facade (nothing at module level) only the submodule; through a package whose
    # __init__ imports at module level, the package too
    planted.write_text("from lmfoundry.compile import sass\nfrom lmfoundry.api import llm\n")
    mods = modules()
    api_runs = _runs_imports(mods["lmfoundry.api"])
    assert dependencies(planted, mods) == {"lmfoundry.compile.sass", "lmfoundry.api.llm"} | (
        {"lmfoundry.api"} if api_runs else set())
    assert cycles({"a": ["b"], "b": ["a"], "c": ["a"]}) == [["a", "b"]]
    assert cycles({"a": ["b"], "b": ["c"], "c": []}) == []
    assert loop_through(["a", "b", "c"], {"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
