"""The measurement table: run the checks, collect rows, render them (terminal, Markdown, JSON, PNG).

``validate`` fills the table, ``train`` compares fused and eager training losses; ``model`` is the
row/report data, ``render`` and ``plots`` write it out (``moe-gmm bench`` lives in :mod:`moe_gmm.bench.command`).
"""

from moe_gmm.report.model import Report, Row

__all__ = ["Report", "Row"]
