"""The M:N cluster run shared by test_m_to_n.py and test_m_to_n_faults.py (one cluster)."""

from __future__ import annotations

import pytest
from _mn_setup import run_driver


@pytest.fixture(scope="session")
def m_to_n(tiny_model_dir, cpu_kernels):
    """(driver report, reference): see tests/multinode/_mn_setup.py (the kernel cache warm
    before its roles start)."""
    yield from run_driver(tiny_model_dir)
