"""Test session setup.

Triton binds its CPU interpreter when it is first imported (its own modules included), and transformers'
modeling files import triton, so TRITON_INTERPRET=1 must be set before any test module is collected for
tests/test_triton.py to run the kernels on CPU tensors. Only without CUDA (or with OAL_TEST_DEVICE=cpu); nothing
else in the suite runs triton code.
"""

import os

import torch  # does not import triton

if (os.environ.get("OAL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
