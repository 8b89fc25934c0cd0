"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def stories_model_dir() -> Path:
    """Hugging Face directory of llama2.c's stories260K model, converted once into the kvpilot cache."""
    from kvpilot.tools.convert_llama2c import ensure_stories260k

    return ensure_stories260k()
