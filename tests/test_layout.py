"""The package's size rule: no module over 400 lines, no function or method over 60 (decorators
and docstring included), so that a reader can hold a module's topic and a function's steps."""
import ast
from pathlib import Path

import exactspec

ROOT = Path(exactspec.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def functions(tree: ast.AST):
    """(qualified name, first line, lines) of every function and method, nested ones too."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                yield f"{prefix}{child.name}", first, child.end_lineno - first + 1
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def test_no_module_over_400_lines():
    long = [f"{path.relative_to(ROOT.parent)}: {n} lines"
            for path in modules() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_60_lines():
    long = [f"{path.relative_to(ROOT.parent)}:{first} {name}: {n} lines"
            for path in modules()
            for name, first, n in functions(ast.parse(path.read_text()))
            if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
