"""Fixtures shared by the method tests."""

from __future__ import annotations

import pytest

from tests.helpers import prepared_coordinator


@pytest.fixture
def coordinator(make_config, tmp_path):
    """A coordinator over in-process clients for a tiny digits config, prepared as a run is (its methods checked)."""

    def build(**sections):
        return prepared_coordinator(make_config(**sections), tmp_path / "run")

    return build
