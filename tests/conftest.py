"""Test session setup.

The suite runs under pytest-xdist (`-n auto --dist loadfile`, README): module-scoped fixtures stay per file.

Triton binds its CPU interpreter when it is first imported (its own modules included), and transformers'
modeling files import triton, so TRITON_INTERPRET=1 must be set before any test module is collected for
tests/test_triton.py to run the kernels on CPU tensors. Only without CUDA (or with OAL_TEST_DEVICE=cpu); nothing
else in the suite runs triton code.
"""

import os

if os.environ.get("OAL_TEST_DEVICE") != "cuda":
    # The interpreter multiplies tiles with numpy; on a small shared CPU, two BLAS threads per tiny matmul
    # stall each other (seen here: 35 ms instead of 0.06 ms). Set before numpy is first imported.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The chunked operator reads CPU settings tuned on this machine from the user's cache (oal.ops.tuning); the suite
# runs the fixed defaults, which its block-size tests set through the module constants.
os.environ.setdefault("OAL_NO_TUNE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402  (does not import triton)

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Under pytest-xdist each worker runs one test file at a time: share the cores out rather than have every
    # worker's torch start one thread per core (oversubscribed, they wait on each other's barriers).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

if (os.environ.get("OAL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":  # a quarter of the interpreter's time saved (tests/triton_interpreter.py)
        from triton_interpreter import install  # tests/ is on sys.path, as for the other helper modules

        install()


def pytest_collection_modifyitems(items):
    """The files that hold a `slow` test run first. Under `--dist loadfile` a worker takes the next file when it
    ends one, so the longest go out first and no long file is left running alone at the end while the other worker
    idles. The sort is stable: each file's tests keep their order (and their module fixtures)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture
def tiny_gguf(tmp_path):
    """A tiny GGUF model file (tests/_tiny_gguf.py), for the tests of the GGUF folders in the user's cache."""
    pytest.importorskip("gguf")
    from _tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path / "tiny.gguf")
