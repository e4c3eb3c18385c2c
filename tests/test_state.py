"""No module-level state in `src/exactspec`: what generations remember belongs to an object the
user can see and pass (`models.loaded.Memory`, held by a `LoadedModel`), not to a module.

The rule, checked on the source with `ast` (every module, bindings at its top level, including
those inside a top-level `if` or `try`):

- a **weak dictionary, weak set, defaultdict, Counter or deque** at module level fails, whatever
  its name: those exist to be filled as the process runs (a registry);
- a **dict, list or set** (a literal, a comprehension, or a call of dict / list / set /
  OrderedDict) at module level fails unless its name is ALL_CAPS (a constant: `JSON_LAYOUT`,
  `PRODUCTS`, `_SUM_TOLERANCE`) and no module of the package ever changes it: no item assigned or
  deleted, no augmented assignment, no mutating method (append, update, setdefault, pop, ...)
  called on it. `__all__` is exempt. Tuples, frozensets, strings and numbers are constants;
- a **`global` statement** fails: a module's name rebound at run time is state too.

A function's cache (`functools.cache`, `lru_cache`) is allowed: it keeps a pure load's answer (a
GGUF file's llama.cpp model, its token list, the process's gloo group), the same whatever ran
before.

Nothing is skipped: a registry that is still here fails this test until it has an owner.
"""
import ast
from pathlib import Path

import exactspec

ROOT = Path(exactspec.__file__).parent

REGISTRIES = {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "defaultdict", "Counter", "deque"}
CONTAINERS = {"dict", "list", "set", "OrderedDict"}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
            "setdefault", "add", "discard", "sort", "reverse", "__setitem__", "__delitem__",
            "appendleft", "extendleft", "move_to_end"}


def called(node) -> str | None:
    """The name a call's function goes by (`weakref.WeakKeyDictionary()`: WeakKeyDictionary)."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def kind(value) -> str | None:
    """"registry", "container" or None (a constant, or something this test does not judge)."""
    if called(value) in REGISTRIES:
        return "registry"
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return "container"
    return "container" if called(value) in CONTAINERS else None


def top_level(tree: ast.Module):
    """The statements at a module's top level, through top-level `if`, `try` and `with`."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            pending += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            pending += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
        else:
            yield node


def bindings(tree: ast.Module):
    """(name, value, line) of each module-level assignment to a plain name."""
    for node in top_level(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id, node.value, node.lineno
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            yield node.target.id, node.value, node.lineno


def identifier(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def mutated(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """name → where (module:line) something named so is changed in place, in any module."""
    found: dict[str, list[str]] = {}
    for where, tree in trees.items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                names += [identifier(t.value) for t in targets if isinstance(t, ast.Subscript)]
                if isinstance(node, ast.AugAssign):
                    names.append(identifier(node.target))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATORS:
                names.append(identifier(node.func.value))
            for name in filter(None, names):
                found.setdefault(name, []).append(f"{where}:{node.lineno}")
    return found


def test_no_module_level_state():
    trees = {str(path.relative_to(ROOT.parent)): ast.parse(path.read_text())
             for path in sorted(ROOT.rglob("*.py"))}
    changed = mutated(trees)
    problems = []
    for where, tree in trees.items():
        for name, value, line in bindings(tree):
            what = kind(value)
            if name == "__all__" or what is None:
                continue
            if what == "registry":
                problems.append(f"{where}:{line} {name}: a {called(value)} at module level")
            elif not name.lstrip("_").isupper():
                problems.append(f"{where}:{line} {name}: a mutable container at module level "
                                "(a constant table's name is ALL_CAPS)")
            elif name in changed:
                problems.append(f"{where}:{line} {name}: a table changed at {', '.join(changed[name])}")
        problems += [f"{where}:{node.lineno} global {', '.join(node.names)}: a module's name "
                     "rebound at run time" for node in ast.walk(tree) if isinstance(node, ast.Global)]
    assert not problems, "module-level state:\n" + "\n".join(problems)
