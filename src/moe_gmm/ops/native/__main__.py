import sys

from moe_gmm.ops.native import main

sys.exit(main())
