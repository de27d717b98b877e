"""Skip marks shared by the Triton kernel tests. tests/conftest.py sets TRITON_INTERPRET=1 before any
test module imports Triton (CPU runs: the kernels run in the interpreter); the GPU host runs
`TRITON_INTERPRET=0 pytest -m gpu ...` for compiled kernels at full shapes."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA and compiled Triton (TRITON_INTERPRET=0)")
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
