"""Expert-parallel benchmark: ``python -m benchmarks.run_ep [--quick] [--ep 2,4] [--out FILE]``.

Thin wrapper; the cases and the measurement live in ``moe_gmm.bench.ep``.
"""

import sys

from moe_gmm.bench.ep import main

if __name__ == "__main__":
    sys.exit(main())
