"""Test helpers that make real trouble and always clean up after it.

* :mod:`support.fusefs` - a FUSE passthrough file system whose operations hang or fail on
  demand (a hung NFS mount, an EIO disk), in its own process.
* :mod:`support.juicefs` - a JuiceFS volume (a real distributed POSIX file system) mounted
  twice, as two nodes would.
* :mod:`support.freezer` - processes frozen in a cgroup: SIGKILL cannot end them until
  thawed (cgroup v1), like a process stuck on a dead server.
* :mod:`support.pidns` - a Python process in another PID namespace that shares /dev/shm.
* :mod:`support.mounts` - mount bookkeeping and unmounting that never hangs.
* :mod:`support.nodes` - tiers as separate processes on a shared root, sampled while
  they run (the distributed-file-system tests).
* :mod:`support.fixtures` - the pytest fixtures over all of these (registered by
  ``tests/conftest.py``).

Facts measured with them are in ``docs/test-filesystems.md``.
"""
