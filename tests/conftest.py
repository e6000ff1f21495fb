"""Shared test setup: chunkgym's own packages must be the ones imported; tests that need data skip without it.

Mark a test (or a module, via ``pytestmark``) ``@pytest.mark.needs_data("mooncake", ...)`` with the
``data/sources.json`` names it reads: it is skipped, with a reason naming the missing source and the
fetch command, unless every file of those sources is in the data folder (or shipped in ``data/``).

The data folder is ``$CHUNKGYM_DATA``, else the per-user cache; when the variable is unset and a
data mirror sits beside the checkout (``../shared/data``, as on CI), the suite points it there, so
the data-dependent tests run rather than skip.
"""

import os

import pytest
import torch

import chunkgym
from chunkgym.data import FETCH_COMMAND, load_sources

os.environ.setdefault("WANDB_MODE", "disabled")
chunkgym.require_own_packages()

MIRROR_BESIDE_CHECKOUT = chunkgym.REPO_ROOT.parent / "shared" / "data"
if not os.environ.get(chunkgym.DATA_ENV_VAR) and MIRROR_BESIDE_CHECKOUT.is_dir():
    os.environ[chunkgym.DATA_ENV_VAR] = str(MIRROR_BESIDE_CHECKOUT)  # set before any test module reads it

SOURCES = {s.name: s for s in load_sources()}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_data(*sources): skip unless these data sources are present")


def pytest_runtest_setup(item: pytest.Item) -> None:
    names = [name for mark in item.iter_markers("needs_data") for name in mark.args]
    unknown = sorted(set(names) - set(SOURCES))
    if unknown:
        pytest.fail(f"needs_data: unknown source(s) {unknown}; valid: {', '.join(sorted(SOURCES))}")
    missing = [
        n for n in dict.fromkeys(names) if not all(chunkgym.data_file(p).exists() for p in SOURCES[n].paths())
    ]
    if missing:
        pytest.skip(f"needs data {', '.join(missing)} under {chunkgym.data_root()}: run `{FETCH_COMMAND}`")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny networks and models: extra threads only add synchronisation (and stall on a busy machine).
    Opt in per module with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
