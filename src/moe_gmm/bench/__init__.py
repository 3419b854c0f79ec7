"""The benchmark library, inside the package so the installed ``moe-gmm bench`` command can run it.

``harness`` times implementations side by side, ``machine`` measures this machine's limits and the
roofline floor, ``gmm`` and ``moe_layer`` (cases in ``layer_cases``) are the two suites, ``memory``
the layer's peak memory, ``ep`` and ``glue`` the expert-parallel and glue runs, ``table`` renders
results, ``baseline`` and ``compare`` keep and judge against a machine's accepted numbers, and
``command`` is ``moe-gmm bench``.
"""
