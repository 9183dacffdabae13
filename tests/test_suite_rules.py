"""The test suite's own rules (tests/suite_plugin.py; issue 32).

- every test item carries exactly one area marker (engine, kernels, serve, course, bench), and every test file
  has an area by its name, so `make test-<area>` together run everything;
- no test asserts an upper bound on a wall time: a busy machine is slower, not wrong. Budgets are numbers in a
  report (the chapter timings table); a ratio of two times measured in the same run is allowed.
"""
import ast
import re
from pathlib import Path

import pytest

from tests import suite_plugin

TESTS = Path(__file__).resolve().parent


def test_every_test_item_in_this_session_has_exactly_one_area(request):
    items = request.session.items
    assert request.node in items
    wrong = [(item.nodeid, [m.name for m in item.iter_markers() if m.name in suite_plugin.AREAS]) for item in items
             if len([m for m in item.iter_markers() if m.name in suite_plugin.AREAS]) != 1]
    assert wrong == [], wrong[:20]


def test_every_test_file_has_an_area_by_its_name():
    files = sorted(p.name for p in TESTS.glob("test_*.py")) + ["browser_lab.py"]
    assert [f for f in files if suite_plugin.area_of_file(f) is None] == []
    assert suite_plugin.area_of_file("01_rmsnorm.ipynb") == "course"


def test_the_markers_are_registered_and_make_has_a_target_for_each_area():
    import tomllib
    ini = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in ini["addopts"]
    assert sorted(m.split(":")[0] for m in ini["markers"]) == sorted([*suite_plugin.AREAS, "slow"])
    makefile = (TESTS.parent / "Makefile").read_text()
    for area in suite_plugin.AREAS:
        assert re.search(rf"^[^:\n#]*\btest-{area}\b[^:\n]*:", makefile, re.M), area
    assert re.search(r"^test-fast:", makefile, re.M) and '-m "not slow"' in makefile


# -- no wall-time assertion ----------------------------------------------------------------------------------------
TIMED = re.compile(r"perf_counter|monotonic|process_time|time\.time\(|\bseconds\b|\belapsed\b|\btook\b|\bwall\b")


def _upper_bounds_on_time(source: str, name: str = "<test>") -> list[str]:
    """The assert statements in `source` that bound a measured time from above by something not measured in the
    same run (`time.perf_counter() - t < 30`, `grade.seconds <= budget`); a lower bound (`> 0`) and a ratio of
    two measured times (`longest < total / 3`) are not budgets."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            operands = [cmp.left, *cmp.comparators]
            for op, left, right in zip(cmp.ops, operands, operands[1:]):
                if isinstance(op, (ast.Gt, ast.GtE)):
                    left, right = right, left                      # now: left < right
                elif not isinstance(op, (ast.Lt, ast.LtE)):
                    continue
                if TIMED.search(ast.unparse(left)) and not TIMED.search(ast.unparse(right)):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node.test)[:120]}")
    return found


def test_the_wall_time_scan_finds_upper_bounds_and_leaves_ratios_and_lower_bounds():
    src = '''
def t():
    assert time.perf_counter() - start < 30, tag
    assert grade.seconds <= budget, "slow"
    assert 60 > time.monotonic() - t
    assert longest_wait < done["seconds"] / 3
    assert all(s.seconds > 0 for s in trace)
    assert len(rest) < 190
'''
    assert [f.split(": ", 1)[1] for f in _upper_bounds_on_time(src)] == [
        "time.perf_counter() - start < 30", "grade.seconds <= budget", "60 > time.monotonic() - t"]


def test_no_test_asserts_an_upper_bound_on_a_wall_time():
    found = []
    for path in sorted(TESTS.glob("*.py")):
        found += _upper_bounds_on_time(path.read_text(encoding="utf-8"), path.name)
    assert found == [], "\n".join(found)


def test_the_slow_table_names_test_functions_that_exist():
    """tests/suite_plugin.SLOW names tests by file and function: a renamed or removed test must leave it too."""
    stale = []
    for pattern, tests in suite_plugin.SLOW.items():
        if tests == "*":
            assert pattern.startswith("*") or (TESTS / pattern).is_file(), pattern
            continue
        tree = ast.parse((TESTS / pattern).read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        stale += [f"{pattern}::{t}" for t in tests if t not in defined]
    assert stale == []


def test_the_together_table_names_test_functions_that_exist_and_gives_each_group_one_scope():
    """tests/suite_plugin.TOGETHER (tests that share a module fixture, run on one worker) names tests by file and
    function, and every test of a group gets the group's one xdist scope."""
    for file, tests in suite_plugin.TOGETHER.items():
        tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert [t for t in tests if t not in defined] == [], file
        for test, group in tests.items():
            assert suite_plugin.together_group(f"tests/{file}::{test}[case]") == f"tests/{file}::{group}"
    assert suite_plugin.together_group("tests/test_course_grading.py::test_grade_refuses_bad_arguments") is None
