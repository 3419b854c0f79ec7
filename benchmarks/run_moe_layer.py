"""MoE-layer benchmark: ``python -m benchmarks.run_moe_layer [--quick] [--dtype fp32,bf16] [--out FILE]``.

Thin wrapper; the cases, the harness and the tables live in ``moe_gmm.bench``.
"""

import sys

from moe_gmm.bench.moe_layer import main

if __name__ == "__main__":
    sys.exit(main())
