"""Helpers of the N-process runs (the runs themselves: test_parallel.py, test_cli.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mhmoe.launch import launch_local, split_tokens


@pytest.mark.parametrize("total", [0, 1, 7, 96, 1000])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_split_tokens(total, world):
    counts = split_tokens(total, world)
    assert len(counts) == world and sum(counts) == total and min(counts) >= 0
    if world >= 3:
        assert counts[-1] == 0  # a rank with no tokens: the ragged all-to-all edge
    assert counts == sorted(counts, reverse=True)  # uneven on purpose


# ---------------------------------------------------------------------------------------
# Signals: torch's launcher turns SIGINT (and SIGTERM, SIGHUP, SIGQUIT) into its own
# SignalException, an Exception that the command would report as a bug (exit 3).
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt),
                                         (signal.SIGTERM, SystemExit)], ids=["int", "term"])
def test_launch_local_turns_the_launcher_s_signal_exception_into_python_s(monkeypatch, sig,
                                                                          raised):
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing import SignalException

    def elastic_launch(config, entrypoint):
        def run(*args):
            # as the launcher does: its handlers in place, the processes stopped, then this
            signal.signal(signal.SIGINT, lambda *_: None)
            raise SignalException(f"Process 1 got signal: {sig}", sigval=sig)
        return run

    monkeypatch.setattr(launcher, "elastic_launch", elastic_launch)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(raised) as info:
        launch_local(2, ["-c", "pass"])
    if raised is SystemExit:
        assert info.value.code == 128 + signal.SIGTERM  # 143, as a shell reports it
    assert signal.getsignal(signal.SIGINT) is before  # the launcher's handler is gone


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
        if ppid == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the processes in /proc")
def test_ctrl_c_of_demo_nproc_exits_130_without_a_traceback():
    # It exited 3 with "internal error (SignalException: ... got signal: 2)".
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mhmoe", "demo", "--nproc", "2", "--device",
                             "cpu", "--experts", "2", "--tokens", "512", "--runs", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(_children(proc.pid)) < 2:  # the launcher has started the processes
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(2)
        proc.send_signal(signal.SIGINT)  # to the launcher alone; it stops the processes
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, (proc.returncode, err)
    # The launcher's own lines (each rank reports on its own, "mhmoe demo (rank r): ...").
    assert [line for line in err.splitlines() if line.startswith("mhmoe demo: ")] == \
        ["mhmoe demo: error: interrupted"], err
    assert "SignalException" not in err and "in launch_local" not in err, err
    assert "head-parallel" not in out, out
