"""Fixtures shared by the e2e HiCache tests."""

import pytest

from sglang.test.engine_utils import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen3 checkpoint (deterministic from its seed), one per test module."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")), "qwen3")
