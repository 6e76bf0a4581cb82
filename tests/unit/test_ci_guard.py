"""tests/conftest.py under CI=true: a test group skipped for a missing optional dependency fails the run
(at collection and inside a test), other skips stay skips, and every run prints how many it skipped."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import output_of, run

_TESTS = '''
import pytest

{module_level}

def test_imports_inside():
    pytest.importorskip("roll_no_such_module_b")

def test_needs_a_gpu():
    pytest.skip("needs a GPU")

def test_passes():
    assert True
'''


def _pytest(tmp_path, ci: str, module_level: str = ""):
    test_file = tmp_path / "test_guarded.py"
    test_file.write_text(_TESTS.format(module_level=module_level))
    (tmp_path / "test_other.py").write_text("def test_other():\n    assert True\n")
    # The repo's conftest as a plugin, on a file outside tests/ (so it is not loaded twice).
    return run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-ra",
                "--rootdir", str(tmp_path), str(tmp_path)], timeout=120, CI=ci, PYTHONPATH=".")


def test_missing_module_skips_without_ci_and_fails_under_ci(tmp_path):
    local = _pytest(tmp_path, ci="")
    assert local.returncode == 0, output_of(local)
    assert "2 passed, 2 skipped" in local.stdout, output_of(local)
    assert "skipped: 2 test(s) (1 x could not import 'roll_no_such_module_b'" in local.stdout, \
        output_of(local)

    ci = _pytest(tmp_path, ci="true")
    assert ci.returncode == 1, output_of(ci)
    assert "1 failed, 2 passed, 1 skipped" in ci.stdout, output_of(ci)  # the GPU skip stays a skip
    assert "CI=true: could not import 'roll_no_such_module_b'" in ci.stdout, output_of(ci)
    assert "skipped: 1 test(s) (1 x needs a GPU)" in ci.stdout, output_of(ci)


@pytest.mark.parametrize("ci, code", [("", 0), ("true", 2)])
def test_a_module_skipped_whole_at_collection(tmp_path, ci, code):
    proc = _pytest(tmp_path, ci=ci, module_level='pytest.importorskip("roll_no_such_module_a")')
    assert proc.returncode == code, output_of(proc)
    if ci:  # pytest stops at a collection error: nothing ran
        assert "CI=true: could not import 'roll_no_such_module_a'" in proc.stdout, output_of(proc)
    else:
        assert "1 passed, 1 skipped" in proc.stdout, output_of(proc)
        summary = "skipped: 1 test(s) (1 x could not import 'roll_no_such_module_a'"
        assert summary in proc.stdout, output_of(proc)
