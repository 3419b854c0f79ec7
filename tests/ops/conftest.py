"""Switch Triton to its CPU interpreter when no CUDA device exists.

Triton reads ``TRITON_INTERPRET`` when its kernels are defined, which moe-gmm does on the first
call into the triton backend; this runs at collection, before any test. With a CUDA device the
kernels compile for real and the same tests run on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
