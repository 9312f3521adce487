"""Chaos scenarios share one failure-free reference run per job shape (see harness)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import Shape, reference_weights


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``reference(shape)``: the final weights of a failure-free run of that shape."""

    def get(shape: Shape) -> str:
        return reference_weights(shape, str(tmp_path_factory.mktemp("reference")))

    return get
