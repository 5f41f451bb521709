"""Fixtures shared by the test suite (no expecttest import: the GPU machine lacks it)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import use_lowering_mode

import csa_ops  # noqa: F401  (registers torch.ops.csa.*)
from csa_ops import kernel_cache, native


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    """Kernels the tests compile go to a cache of the test session (inherited by the
    subprocesses tests start), not to the user's; a cache named by the user is kept."""
    if "CSA_OPS_CACHE_DIR" in os.environ:
        yield
        return
    user_cache = kernel_cache.directory()
    os.environ["CSA_OPS_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernel-cache"))
    try:
        if torch.cuda.is_available():
            _native_library_into(kernel_cache.directory(), user_cache)
        yield
    finally:
        del os.environ["CSA_OPS_CACHE_DIR"]


def _native_library_into(root, user_cache) -> None:
    """GPU sessions run the native launch path (csa_ops.native) from their first call: its
    library comes from the user's cache where built there (tests/gpu/run_h200.sh builds it
    first), else it is built now."""
    if not native.enabled():
        return
    built = native.library_path(user_cache)
    if built.exists():
        target = native.library_path(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)
    else:
        native.build(root)


@pytest.fixture
def compile_env():
    """Fresh dynamo state and no Inductor caches: the FX-graph and AOTAutograd caches do not
    key on registered decompositions or lowerings, so a hit could hand back code compiled
    before one was registered."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


@pytest.fixture
def lowering_mode(request):
    """csa_ops.lowering policy for one test (indirect parameter), restored afterwards."""
    with use_lowering_mode(request.param):
        yield request.param


@pytest.fixture
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=warn_only)


def pytest_collection_modifyitems(config, items):
    """CSA_TEST_SHARD=i/n keeps every n-th test from the i-th: the GPU script runs the
    JIT-heavy files as parallel processes, one shard each, to use the host's cores."""
    shard = os.environ.get("CSA_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    kept = items[index::count]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
