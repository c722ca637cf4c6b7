"""Tiers as separate processes ("nodes") on a shared root, sampled while they run.

The distributed-file-system tests start a few Python processes, each a tier on one
mount storing as fast as it can, watch the root's bytes on disk from the test's process
while they run, and read each node's JSON summary (its last line of output) at the end.
:func:`run_nodes` is that loop, once: a node still running at the end is killed and
reaped, whatever failed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO


@dataclass
class NodesRun:
    """What :func:`run_nodes` saw: each node's summary (in the order started), the
    largest sample taken inside the sampling window, every such sample, and each
    node's standard error (its tier's warnings: what a failed assertion should show)."""

    summaries: list[dict] = field(default_factory=list)
    peak: int = 0
    samples: list[int] = field(default_factory=list)
    stderrs: list[str] = field(default_factory=list)

    def warnings(self, *words: str) -> list[str]:
        """The lines of the nodes' standard error naming any of ``words``, each
        prefixed with its node's index."""
        return [f"node {i}: {line}" for i, text in enumerate(self.stderrs)
                for line in text.splitlines() if any(w in line for w in words)]


def run_nodes(argvs: Sequence[Sequence[str]], sample: Callable[[], int], *,
              sample_for_s: float, limit_s: float, every_s: float,
              envs: Sequence[dict[str, str] | None] | None = None,
              exit_timeout_s: float = 60.0) -> NodesRun:
    """Start one process per ``argvs`` entry (its output piped), call ``sample()`` every
    ``every_s`` while any runs (at most ``limit_s``; samples count for the peak during
    the first ``sample_for_s``), then wait for each (``exit_timeout_s``) and parse its
    last line of output as JSON. A node that exits non-zero fails the test with its
    output; one still running at the end (a failure in between) is killed. Each node's
    standard error goes to a temporary file (kept in ``stderrs``, and copied to this
    process's standard error for pytest to show)."""
    with contextlib.ExitStack() as files:
        errs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in argvs]
        return _run(argvs, sample, errs, sample_for_s=sample_for_s, limit_s=limit_s,
                    every_s=every_s, envs=envs, exit_timeout_s=exit_timeout_s)


def _run(argvs: Sequence[Sequence[str]], sample: Callable[[], int], errs: list[IO[str]], *,
         sample_for_s: float, limit_s: float, every_s: float,
         envs: Sequence[dict[str, str] | None] | None, exit_timeout_s: float) -> NodesRun:
    """:func:`run_nodes` with each node's standard error going to ``errs``."""
    nodes = [subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=errs[i],
                              text=True, env=None if envs is None else envs[i])
             for i, argv in enumerate(argvs)]
    run = NodesRun()
    try:
        started = time.monotonic()
        while any(node.poll() is None for node in nodes) \
                and time.monotonic() - started < limit_s:
            size = sample()
            if time.monotonic() - started < sample_for_s:
                run.peak = max(run.peak, size)
                run.samples.append(size)
            time.sleep(every_s)
        for node in nodes:
            stdout, _ = node.communicate(timeout=exit_timeout_s)
            assert node.returncode == 0, stdout
            run.summaries.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
        for i, err in enumerate(errs):
            err.seek(0)
            run.stderrs.append(err.read())
            if run.stderrs[-1]:
                sys.stderr.write(f"-- node {i}'s standard error --\n{run.stderrs[-1]}")
    return run
