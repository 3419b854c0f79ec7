"""Padded against contiguous weight rows:
``python -m benchmarks.run_row_stride [--filter E256] [--pad 32 | --pad 16,64,256]``.

Thin wrapper; the comparison lives in ``moe_gmm.bench.row_stride``.
"""

import sys

from moe_gmm.bench.row_stride import main

if __name__ == "__main__":
    sys.exit(main())
