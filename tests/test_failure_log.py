"""tests/failure_log.py: with `DELTAJAX_FAILURE_LOG` set, each failing test's report is in the file once, with
its reason, whether pytest runs the tests itself or through xdist workers."""

import os
import subprocess
import sys

import pytest

from failure_log import FAILURE_LOG

TESTS = os.path.dirname(os.path.abspath(__file__))

SAMPLE = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 2 + 2 == 5, "the planted failure"

@pytest.fixture
def broken():
    raise RuntimeError("the planted setup error")

def test_errors_in_setup(broken):
    pass
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["in_process", "xdist"])
def test_each_failure_is_written_once_with_its_reason(tmp_path, workers):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    log = tmp_path / "failures.log"
    env = dict(os.environ, **{FAILURE_LOG: str(log)}, PYTHONPATH=os.pathsep.join(
        [TESTS, os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run in a worker
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "failure_log", "-p", "no:cacheprovider",
                             *workers, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    text = log.read_text()
    assert text.count("test_sample.py::test_fails (call) FAILED") == 1, text
    assert "the planted failure" in text
    assert text.count("test_sample.py::test_errors_in_setup (setup) FAILED") == 1, text
    assert "the planted setup error" in text
    assert "test_passes" not in text

