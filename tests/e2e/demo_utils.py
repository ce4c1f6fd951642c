"""Shared by the short end-to-end demo tests (split over files so that parallel test workers take them apart)."""

import os
import subprocess
import sys


def processes_mentioning(text: str) -> list[str]:
    """Command lines of the live processes (but this one) that mention ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


def run_demo(out, *flags: str) -> subprocess.CompletedProcess:
    """``python -m forge_megatron.training.demo --out OUT FLAGS...`` on one thread per process; asserts it exited 0
    and that no process it started outlived it. Returns the finished process (stdout and stderr as text)."""
    cmd = [sys.executable, "-m", "forge_megatron.training.demo", "--out", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert not processes_mentioning(str(out)), "a demo process outlived the demo"
    return proc
