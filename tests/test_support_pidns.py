"""Another PID namespace (tests/support/pidns.py): the process inside sees its own pid
numbers, not ours, while sharing /dev/shm with us - the container case of issue 9."""

from __future__ import annotations

import os
import uuid

import psutil
import pytest
from support.fixtures import skip_unless
from support.pidns import PidNamespace, ns_pids, pidns_unavailable_reason


def test_inside_our_pid_is_not_visible_and_outside_its_pid_differs(make_pid_namespace):
    ns = make_pid_namespace()
    assert ns.real_pid != ns.ns_pid
    assert ns.eval("os.getpid()") == ns.ns_pid
    assert ns_pids(ns.real_pid) == [ns.real_pid, ns.ns_pid]  # the kernel's own record
    assert psutil.Process(ns.real_pid).is_running()
    ns.run("""
        import os
        def visible(pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True
    """)
    assert ns.eval(f"visible({os.getpid()})") is False
    assert ns.eval(f"visible({ns.ns_pid})") is True
    assert ns.eval("sorted(int(p) for p in os.listdir('/proc') if p.isdigit())") == [1, ns.ns_pid]


def test_dev_shm_is_shared_both_ways(make_pid_namespace):
    ns = make_pid_namespace()
    name = f"/dev/shm/pidns-test-{uuid.uuid4().hex}"
    try:
        ns.run(f"open({name!r}, 'w').write('from inside')")
        with open(name) as f:
            assert f.read() == "from inside"
        with open(name, "w") as f:
            f.write("from outside")
        assert ns.eval(f"open({name!r}).read()") == "from outside"
    finally:
        os.unlink(name)


def test_chosen_inner_pid_may_equal_a_live_outer_pid(make_pid_namespace):
    ns = make_pid_namespace(inner_pid=os.getpid())
    assert ns.ns_pid == os.getpid()  # same number, another process
    assert ns.real_pid != os.getpid()


def test_errors_inside_come_back_with_their_traceback(make_pid_namespace):
    ns = make_pid_namespace()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        ns.eval("1 / 0")
    ns.run("x = 41")
    assert ns.eval("x + 1") == 42  # the scope survives an error


def test_close_ends_every_process_of_the_namespace():
    skip_unless(pidns_unavailable_reason())
    ns = PidNamespace()
    ns.run("import subprocess, sys; "
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])")
    server = psutil.Process(ns.real_pid)
    inner = server.children(recursive=True)
    assert len(inner) == 1
    ns.close()
    _, alive = psutil.wait_procs([*inner, server], timeout=10)
    assert not alive
    ns.close()  # idempotent


def test_inner_pid_below_3_is_refused():
    skip_unless(pidns_unavailable_reason())
    with pytest.raises(ValueError, match="inner_pid must be >= 3"):
        PidNamespace(inner_pid=1)
