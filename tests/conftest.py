import os
import sys
import warnings

# Shared test helpers (tests/testing_utils.py) importable from every test folder.
sys.path.insert(0, os.path.dirname(__file__))

warnings.filterwarnings("ignore", message=".*pallas.*triton.*", category=DeprecationWarning)
