"""A test module imports its folder's conftest helpers at module level only. In a whole-suite run
every folder's conftest.py is imported as the module `conftest`, so after collection the name
means the last folder's one: an import inside a test or fixture body then gets another folder's
helpers (an AttributeError or ImportError in the whole suite only; CI12 and CI19 each failed on
one, while the file alone passed)."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _late_conftest_imports(tree: ast.AST) -> list[int]:
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module == "conftest":
                    lines.append(node.lineno)
                elif isinstance(node, ast.Import) and any(a.name == "conftest" for a in node.names):
                    lines.append(node.lineno)
    return lines


def test_no_test_imports_conftest_inside_a_function():
    late = [f"{path.relative_to(TESTS)}:{line}" for path in sorted(TESTS.rglob("*.py"))
            for line in _late_conftest_imports(ast.parse(path.read_text()))]
    assert not late, f"import conftest helpers at module level, not in a function body: {late}"


def test_the_check_finds_an_import_in_a_fixture_body():
    source = "import pytest\n\n@pytest.fixture\ndef f():\n    from conftest import helper\n    return helper\n"
    assert _late_conftest_imports(ast.parse(source)) == [5]
    assert _late_conftest_imports(ast.parse("from conftest import helper\n")) == []
