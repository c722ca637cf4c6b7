"""mptier's log records inside vLLM: they reach vLLM's handlers, in vLLM's format.

vLLM configures only its own ``vllm`` logger (its handlers, its format, no propagation),
so without the plug-in joining it mptier's start line would be lost and its warnings
printed bare by Python's last-resort handler. Each case runs in a fresh interpreter:
logging is per process, and pytest's own handlers on the root logger would count as
"the user configured logging".
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed in this interpreter; make the environment "
    "with scripts/vllm-env.sh and run .venv-vllm/bin/python -m pytest -m vllm")]

TESTS = os.path.dirname(os.path.abspath(__file__))

# A tier built by vLLM's factory over vLLM's shared region, as in a real engine; the
# spec comes from the integration tests. {events} asks for KV events while vLLM's are
# off, which makes the tier warn.
SCENARIO = """
import gc, logging, sys
sys.path.insert(0, {tests!r})
{before}
# What vLLM's engine core does at start (vLLM 0.32 and 0.33 alike).
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from test_vllm_integration import OUR_TIER, SMALL, make_spec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

spec = make_spec()
region = SharedOffloadRegion(engine_id=spec.config.engine_id, num_chunks=spec.num_chunks,
                             rank=None, kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                             cpu_page_size=spec.cpu_page_size_per_worker)
tier = None
try:
    tier = SecondaryTierFactory.create_secondary_tier(
        {{**OUR_TIER, **SMALL, "root_dir": {root!r}, "enable_kv_events": True}},
        region.create_kv_memoryview(), spec)
    tier.shutdown()
    from mptier.integrations.vllm import join_vllm_logging
    print("JOINED", join_vllm_logging(), len(logging.getLogger("mptier").handlers))
finally:
    del tier
    gc.collect()
    region.cleanup()
"""

# vLLM's default format: "[prefix](process pid=N) LEVEL MM-DD HH:MM:SS [file:line] msg"
# (0.32 and 0.33 agree from the level on).
VLLM_LINE = r"{level} \d\d-\d\d \d\d:\d\d:\d\d \[vllm\.py:\d+\] "


def run(tmp_path, before: str = "", **env: str) -> subprocess.CompletedProcess:
    code = SCENARIO.format(tests=TESTS, root=str(tmp_path / "kv"), before=before)
    environ = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stdout", **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert done.returncode == 0, done.stderr
    return done


def test_start_line_and_warnings_reach_vllms_handler_in_its_format(tmp_path):
    done = run(tmp_path)
    start = re.findall(VLLM_LINE.format(level="INFO") + r"mptier tier 'MPFileSystemTierManager'"
                       r": blocks under \S+, 1\+1 worker processes", done.stdout)
    assert len(start) == 1, done.stdout
    warned = re.findall(VLLM_LINE.format(level="WARNING") + r"MPFileSystemTierManager: "
                        r"enable_kv_events is ignored", done.stdout)
    assert len(warned) == 1, done.stdout
    # Joined once (a second call adds nothing), and nothing printed bare on stderr.
    assert "JOINED True 1" in done.stdout
    assert "enable_kv_events is ignored" not in done.stderr


def test_users_own_logging_is_left_alone(tmp_path):
    # basicConfig on the root: the user decided where records go (stderr, their format).
    done = run(tmp_path, before='logging.basicConfig(level=logging.INFO, '
                                'format="USER %(name)s %(message)s")')
    assert "JOINED False 0" in done.stdout
    assert "mptier tier 'MPFileSystemTierManager'" not in done.stdout.replace(
        "JOINED", "")
    assert re.search(r"^USER mptier\.integrations\.vllm mptier tier ", done.stderr, re.M), \
        done.stderr


def test_a_handler_on_the_mptier_logger_is_left_alone(tmp_path):
    done = run(tmp_path, before='h = logging.StreamHandler(sys.stderr); '
                                'h.setFormatter(logging.Formatter("OWN %(message)s")); '
                                'logging.getLogger("mptier").addHandler(h); '
                                'logging.getLogger("mptier").setLevel(logging.INFO)')
    assert "JOINED False 1" in done.stdout
    assert re.search(r"^OWN mptier tier ", done.stderr, re.M), done.stderr
    assert not re.search(VLLM_LINE.format(level="INFO") + "mptier tier", done.stdout)
