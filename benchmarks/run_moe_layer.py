"""MoE-layer benchmark: ``python -m benchmarks.run_moe_layer [--quick] [--dtype fp32,bf16] [--out FILE]``.

The train-step table comes first (``--modes train``: zero_grad, forward, ``loss.backward()``, AdamW
plain and fused, over transformers' block and small causal LMs; ``--lm``, ``--train-modes``), then
the ``autograd.grad`` modes (``fwd``, ``bwd``, ``fwdbwd``).

Thin wrapper; the cases, the harness and the tables live in ``moe_gmm.bench``.
"""

import sys

from moe_gmm.bench.moe_layer import main

if __name__ == "__main__":
    sys.exit(main())
