"""8 virtual CPU devices: sequence-parallel rules and data/sequence-parallel train steps vs one device.

Each case runs in its own process because the device count is fixed when jax starts (and the test session has
already started jax with one device).
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("case", ["rules", "train_step"])
def test_multidevice(case):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, os.path.join(HERE, "multidevice_cases.py"), case], env=env,
                            capture_output=True, text=True, timeout=600)
    print(result.stdout[-4000:], result.stderr[-4000:])
    assert result.returncode == 0 and "passed" in result.stdout
