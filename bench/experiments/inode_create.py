"""What creating an empty file costs on a root, quiet and at times after deleting many
(ext4 without a journal, as this VM's root is, checks the deletion time of every
candidate inode: fs/ext4/ialloc.c recently_deleted(); with a journal it does not).
Thread CPU and wall time per file over 2,000 creations.

    python bench/experiments/inode_create.py --root /var/tmp
"""

import argparse
import os
import shutil
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--root", default="/var/tmp")
ap.add_argument("--deleted", type=int, default=5000)
a = ap.parse_args()
base = tempfile.mkdtemp(dir=a.root, prefix="inode-create-")


def create(n: int, folder: str) -> str:
    os.makedirs(folder)
    c0, t0 = time.thread_time(), time.perf_counter()
    for i in range(n):
        os.close(os.open(f"{folder}/f{i}", os.O_CREAT | os.O_WRONLY, 0o644))
    return (f"create us/file: CPU {(time.thread_time() - c0) / n * 1e6:.1f} "
            f"wall {(time.perf_counter() - t0) / n * 1e6:.1f}")


print("fresh", create(2000, f"{base}/a"))
os.sync()
time.sleep(12)
print("quiet", create(2000, f"{base}/b"))
for wait in (0, 3, 6, 10, 15, 25):
    doomed = f"{base}/del{wait}"
    os.makedirs(doomed)
    for i in range(a.deleted):
        os.close(os.open(f"{doomed}/x{i}", os.O_CREAT | os.O_WRONLY, 0o644))
    os.sync()
    time.sleep(12)
    shutil.rmtree(doomed)
    time.sleep(wait)
    print(f"{wait:2d} s after deleting {a.deleted}:", create(2000, f"{base}/c{wait}"))
shutil.rmtree(base)
