"""Layer-test setup: without CUDA, the Triton kernels (``triton_gemv``) run in the interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel module is imported (see
tests/attention/conftest.py); nothing in this directory imports triton otherwise.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
