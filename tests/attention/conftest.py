"""Attention-test setup: without CUDA, Triton kernels run in the interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel module is imported, so
it is set here at import time (pytest imports this file before the test modules of this
directory). Other test directories import torch but never triton, so they are unaffected.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
