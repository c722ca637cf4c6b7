"""``mptier bench``: mptier side by side with the in-process thread-pool design and the
raw limit of the disk, measured in one run on the same files.

Designs: (a) :mod:`mptier.bench.engine`, (b) and (c) :mod:`mptier.bench.baseline`,
(d) :mod:`mptier.bench.raw`; the scheduler loop that drives them all is
:mod:`mptier.bench.harness`; figures and ratios :mod:`mptier.bench.report`, the chart
:mod:`mptier.bench.plot`, the command line :mod:`mptier.bench.cli`; what a phase kept busy
(CPUs, the disk) :mod:`mptier.bench.saturation`.
"""

from mptier.bench.cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
