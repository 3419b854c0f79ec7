"""permute/unpermute and SwiGLU benchmark, native kernels vs composed torch ops:
``python -m benchmarks.run_glue [--quick] [--dtype fp32,bf16] [--out FILE] [--markdown FILE]``.

Thin wrapper; the cases and the timing live in ``moe_gmm.bench.glue``.
"""

import sys

from moe_gmm.bench.glue import main

if __name__ == "__main__":
    sys.exit(main())
