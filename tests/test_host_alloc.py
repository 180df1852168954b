"""``runtime/worker/host_alloc.cache_host_frees``: a freed sub-32 MiB buffer's memory is reused.

Each check runs in a fresh interpreter (mallopt is process-wide). Without the fixed thresholds,
glibc maps a 24 MiB allocation fresh (it is above the 128 KiB initial mmap threshold; freeing it
raises the threshold to 24 MiB, and the next 24 MiB request is at that threshold: mapped fresh
again), so both first writes fault in every 4 KiB page (mallopt(3)); with them, the first comes
from the heap and faults, the second reuses it and faults in (almost) none. Minor-fault counts
(``getrusage``; transparent huge pages off in the process, ``PR_SET_THP_DISABLE``), not seconds:
exact on any glibc machine.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt only")

NBYTES = 24 * 1024 * 1024
PAGES = NBYTES // 4096

SCRIPT = f"""
import ctypes, json, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: one fault per 4 KiB page on any kernel
import torch
from nereus.runtime.worker.host_alloc import cache_host_frees
ok = cache_host_frees() if sys.argv[1] == "1" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
for _ in range(2):
    f0 = faults()
    t = torch.empty({NBYTES}, dtype=torch.uint8)
    t.fill_(1)
    out.append(faults() - f0)
    del t
print(json.dumps({{"ok": ok, "faults": out}}))
"""


def _run(cache: bool) -> dict:
    p = subprocess.run([sys.executable, "-c", SCRIPT, "1" if cache else "0"], capture_output=True, text=True,
                       timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                         "PYTHONPATH": ":".join(sys.path)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_freed_buffer_reused_with_fixed_thresholds():
    r = _run(cache=True)
    assert r["ok"] is True
    first, second = r["faults"]
    assert first >= PAGES // 2  # the heap grew: its pages were touched for the first time
    assert second < PAGES // 100  # the same memory again: no page faulted in


def test_default_thresholds_map_the_second_buffer_fresh():
    first, second = _run(cache=False)["faults"]
    assert first >= PAGES // 2 and second >= PAGES // 2  # glibc's dynamic threshold: fresh each time
