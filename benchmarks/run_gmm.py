"""Grouped-matmul benchmark: ``python -m benchmarks.run_gmm [--quick] [--dtype fp32,bf16] [--out FILE]``.

Thin wrapper; the cases, the harness and the table live in ``moe_gmm.bench``.
"""

import sys

from moe_gmm.bench.gmm import main

if __name__ == "__main__":
    sys.exit(main())
