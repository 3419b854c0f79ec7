"""Benchmarks inside the package, so the installed ``moe-gmm bench`` command can run them.

``harness`` times implementations side by side, ``machine`` measures this machine's limits and the
roofline floor, ``gmm`` holds the grouped-matmul cases, ``table`` renders results.
"""
