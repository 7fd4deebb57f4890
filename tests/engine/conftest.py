"""Shared fixtures for the engine tests: tiny random-weight model folders, one per architecture.

Each folder is written once per test session by ``init_model`` (seed 0, float32, "tiny" preset).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlayer.engine.presets import init_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (untied embeddings, plain RoPE)."""
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2: q/k/v biases and tied embeddings."""
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    return init_model("tiny", folder, architecture="qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def mistral_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral (seed 2) with a 2048-token sliding window (longer than these tests' prompts)."""
    folder = tmp_path_factory.mktemp("models") / "tiny-mistral"
    return init_model("tiny", folder, seed=2, architecture="mistral", sliding_window=2048)
