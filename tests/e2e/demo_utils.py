"""Shared by the short end-to-end demo tests (split over files so that parallel test workers take them apart)."""

import os


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
