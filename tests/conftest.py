"""Shared test setup: chunkgym's own packages must be the ones imported."""

import os

import pytest
import torch

import chunkgym

os.environ.setdefault("WANDB_MODE", "disabled")
chunkgym.require_own_packages()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny networks and models: extra threads only add synchronisation (and stall on a busy machine).
    Opt in per module with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
