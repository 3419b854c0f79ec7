"""The cpu backend's three passes one at a time, as an A/B between two checkouts:
``python -m benchmarks.run_passes time --out FILE`` in each checkout, in turns, then
``python -m benchmarks.run_passes compare --base BASE.json ... --new NEW.json ... [--markdown FILE]``.

Thin wrapper; the timing and the comparison live in ``moe_gmm.bench.passes``.
"""

import sys

from moe_gmm.bench.passes import main

if __name__ == "__main__":
    sys.exit(main())
