"""Shared fixtures of the Python tests.

Run from the repository root after building the extension (pip install ., or the CMake target
flashattn_ext, which writes python/flashattn/_ext*.so for PYTHONPATH=python):
    python -m pytest tests/python
Tests that need torch or jax skip (with the reason) where that framework is not installed.
"""

import os
import sys
import zlib

import numpy as np
import pytest

# A source-tree build (python/flashattn/_ext*.so) is used when flashattn is not installed.
_here = os.path.dirname(os.path.abspath(__file__))
_python_dir = os.path.join(_here, "..", "..", "python")
try:
    import flashattn  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.abspath(_python_dir))
    import flashattn  # noqa: F401


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh inputs per case, reproducible reruns."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
