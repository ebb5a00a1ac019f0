"""mtprobe.cpu.machine: the load meter whose share a cached measurement records, so that one made on a
busy machine is measured again once the machine is quiet."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mtprobe.cpu import machine
from mtprobe.cpu.machine import BUSY_SHARE, OtherLoad


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_other_load_sees_a_process_spinning_beside_it():
    # One other process spinning on a core: at least a third of the machine's CPU time while this
    # process sleeps (half of it on 2 cores, less where the machine has more cores than it can fill).
    spin = "import time\nt = time.time()\nwhile time.time() - t < 3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)
        with OtherLoad() as load:
            time.sleep(1.5)
    finally:
        child.wait()
    assert load.share is not None
    cores = machine.os.cpu_count() or 1
    assert load.share >= min(0.3, 0.9 / cores)
    assert load.busy == (load.share > BUSY_SHARE)
    assert load.describe().endswith("% of the CPU")


def test_other_load_is_the_machines_busy_time_less_this_process(monkeypatch):
    # Over the block: 4 s of CPU time on the machine (2 cores x 2 s), 3 s of it busy, 1 s of that
    # this process's own: others used (3 - 1) / 4.
    hz = machine.os.sysconf("SC_CLK_TCK")
    ticks = iter([(10 * hz, 50 * hz), (13 * hz, 54 * hz)])
    own = iter([7.0, 8.0])
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(machine, "_own_cpu_seconds", lambda: next(own))
    with OtherLoad() as load:
        pass
    assert load.share == pytest.approx(0.5) and load.busy and load.describe() == "50% of the CPU"
    # A block too short for the clock's ticks to say anything.
    ticks = iter([(0, 0), (0, hz // 10)])
    own = iter([0.0, 0.0])
    with OtherLoad() as short:
        pass
    assert short.share is None and not short.busy


def test_other_load_says_nothing_without_proc_stat(monkeypatch):
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: None)
    with OtherLoad() as load:
        pass
    assert load.share is None and not load.busy and load.describe() == "unknown"
