"""The package's import graph: no module imports itself back through others, at any depth,
counting the imports inside functions too (a lazy import still ties two modules together)."""
import ast
from pathlib import Path

import exactspec

ROOT = Path(exactspec.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The exactspec modules `path` imports (a name imported from a package counts as its module
    when it is one, else as the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that reaches itself, with one path back (depth-first search)."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def test_no_import_cycles():
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) - {module_name(p)} for p in paths}
    # a package's __init__ re-exporting its modules is not a cycle of theirs
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m != name and name.startswith(m + ".")
                                                      and m != "exactspec")}
    assert not cycles(graph), cycles(graph)[:5]


# The layers of docs/design.md, lowest first: a module imports only from its own layer or below.
LAYERS = (
    ("core", {"noise", "penalties", "sampling", "verify", "constraints", "costmodel", "files",
              "processes", "threads", "distributed"}),
    ("models", {"models", "kernels", "cache"}),
    ("targets, drafters, policy", {"targets", "drafters", "policy", "controller",
                                   "batch_controller", "acceptance", "pricing"}),
    ("engine", {"rows", "logprobs", "batching", "driver", "engine"}),
    ("front ends", {"hf", "bench", "serve", "lab", "cli", "__main__"}),
)


def layer_of(module: str) -> int:
    """The layer of a module of the package (its top-level name: `exactspec.drafters.ngram` is in
    `drafters`'s); the package itself re-exports and is not placed."""
    top = module.split(".")[1]
    return next(i for i, (_, names) in enumerate(LAYERS) if top in names)


def test_imports_point_down_the_layers():
    paths = sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")
    modules = {module_name(p) for p in paths} | {"exactspec"}
    upward = [f"{module_name(p)} ({LAYERS[layer_of(module_name(p))][0]}) imports {m} "
              f"({LAYERS[layer_of(m)][0]})"
              for p in paths for m in sorted(imports_of(p, modules) - {"exactspec"})
              if layer_of(m) > layer_of(module_name(p))]
    assert not upward, upward


# The engine and the policy call the drafter, target and sampling protocols' members, which the
# base classes define: they never ask an object whether it has one.
PROTOCOL_USERS = ("rows", "batching", "driver", "engine", "policy", "controller",
                  "batch_controller", "acceptance", "pricing")


def probes(path: Path) -> list[str]:
    """`hasattr(...)` calls and `getattr(obj, name, default)` calls in a module, with their lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)):
            found.append(f"{path.name}:{node.lineno} {node.func.id}")
    return found


def test_the_engine_and_the_policy_do_not_probe_objects():
    found = [hit for name in PROTOCOL_USERS for hit in probes(ROOT / f"{name}.py")]
    assert not found, found
