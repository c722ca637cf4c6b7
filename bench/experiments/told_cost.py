"""What the caretaker's accounting costs per block another worker stored (what it does
for every path it reads from the workers' rings: RootMaintainer.record_told, then
record_created), thread CPU per block over 20,000 paths, without a budget and with one.
Run it with two trees to compare them:

    PYTHONPATH=/tmp/old python bench/experiments/told_cost.py
    python bench/experiments/told_cost.py
"""

import os
import shutil
import tempfile
import time

import mptier
from mptier.storage import RootMaintainer

BLOCK = 256 << 10
root = tempfile.mkdtemp(dir="/dev/shm", prefix="told-cost-")
os.makedirs(f"{root}/m_r0")
out = []
for capacity in (0, 1 << 40):
    m = RootMaintainer(root, capacity_bytes=capacity, block_bytes=BLOCK, locks_work=False)
    m.step(100)
    top = os.path.join(m.root, "m_r0")
    paths = [f"{h[:3]}/{h[3:5]}_g0/{h}.bin" for h in (os.urandom(32).hex()
                                                      for _ in range(20000))]
    t0 = time.thread_time()
    told_ns = time.time_ns()
    for rank, path in enumerate(paths):
        full = os.path.join(top, path)
        m.record_told(full, BLOCK)
        m.record_created(full, BLOCK, rank, told_ns)
    out.append(f"{'with' if capacity else 'without'} a budget "
               f"{(time.thread_time() - t0) / len(paths) * 1e6:.1f} us")
shutil.rmtree(root)
print(os.path.dirname(mptier.__file__), "per told block:", ", ".join(out))
