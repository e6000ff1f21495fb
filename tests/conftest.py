"""Shared test setup: chunkgym's own packages must be the ones imported."""

import os

import chunkgym

os.environ.setdefault("WANDB_MODE", "disabled")
chunkgym.require_own_packages()
