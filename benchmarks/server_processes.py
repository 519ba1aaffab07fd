"""A server's processes by role (tritonserver, stub:MODEL, a gateway's workers) and the CPU each kept busy.

Triton runs every Python-backend model instance as a process of its own (a stub), so the CPU a stub
used over a run hints at whether that model's host side could be the limit: a process whose threads
together stay near one core may be held by Python's interpreter lock. A single thread near one core
is busy, or spinning in a CUDA synchronisation (CUDA's default while a process has fewer contexts than
the host has cores), so it tells no more than that alone. ``memory_soak`` labels the processes it
samples the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.bench_stack import children


def labelled_processes(root: int, label: str) -> dict[str, int]:
    """Label -> pid of ``root`` (as ``label``) and its descendants: tritonserver, stub:MODEL."""
    labels: dict[str, int] = {}
    pending = [(root, label)]
    while pending:
        pid, label = pending.pop()
        # A gateway's worker processes share a name: numbered from the lowest pid (a respawned one renumbers).
        unique, copy = label, 2
        while unique in labels:
            unique, copy = f"{label} {copy}", copy + 1
        labels[unique] = pid
        for child in sorted(children(pid), reverse=True):  # popped lowest first
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
                continue
            pending.append((child, child_label(label, [arg.decode(errors="replace") for arg in argv]) or str(child)))
    return labels


def child_label(parent: str, argv: Sequence[str]) -> str:
    """tritonserver, stub:MODEL, or the parent's label and the child's role: its worker processes, the
    resource tracker of Python's multiprocessing, inductor's compile workers."""
    name = Path(argv[0]).name
    if name == "triton_python_backend_stub":
        # argv: stub, model path, shm region, ... ; the model path ends in NAME/VERSION/model.py
        return f"stub:{Path(argv[1]).parent.parent.name}"
    if not name.startswith("python"):
        return name
    command = " ".join(argv)
    roles = {"resource_tracker": "resource tracker", "compile_worker": "compile worker", "spawn_main": "worker"}
    role = next((role for marker, role in roles.items() if marker in command), name)
    return f"{parent} {role}"


def cpu_seconds(stat: str) -> float:
    """User plus system CPU seconds in a ``/proc/.../stat`` line (a process's or one thread's)."""
    # pid (comm) state ...: comm may hold spaces and parentheses, so split after its last ')'.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of ``pid`` so far, its ended threads' included; None once it has ended (a zombie included)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if stat.rpartition(")")[2].split()[0] in ("Z", "X") else cpu_seconds(stat)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Thread id -> CPU seconds of each live thread of ``pid``; empty once it has been reaped."""
    found: dict[int, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return found
    for task in tasks:
        try:
            found[int(task.name)] = cpu_seconds((task / "stat").read_text())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return found


class CpuUse:
    """CPU cores each process under ``roots`` (label -> pid) kept busy from :meth:`start` to :meth:`cores`, and its
    busiest thread's.

    Processes are labelled as :func:`labelled_processes` does and listed at :meth:`start` (one started
    later is not counted). A process's figure counts all its threads, those that ended meanwhile too;
    the busiest thread is one alive at the end (a thread started later counts from zero).
    """

    def __init__(self, roots: dict[str, int]) -> None:
        self._roots = roots
        self._pids: dict[str, int] = {}
        self._before: dict[str, tuple[float, dict[int, float]]] = {}
        self._started = 0.0

    def start(self) -> None:
        self._pids = {
            label: pid
            for root_label, root in self._roots.items()
            for label, pid in labelled_processes(root, root_label).items()
        }
        self._before = {
            label: (process_cpu_seconds(pid) or 0.0, thread_cpu_seconds(pid)) for label, pid in self._pids.items()
        }
        self._started = time.monotonic()

    def cores(self, least: float = 0.05) -> dict[str, dict[str, float]]:
        """Label -> {"process": cores, "thread": the busiest thread's cores}, busiest process first, those
        under ``least`` cores left out."""
        wall = max(time.monotonic() - self._started, 1e-9)
        used: dict[str, dict[str, float]] = {}
        for label, pid in self._pids.items():
            process_before, threads_before = self._before[label]
            process = process_cpu_seconds(pid)
            threads = thread_cpu_seconds(pid)
            if process is None or not threads:  # it has ended
                continue
            total = (process - process_before) / wall
            busiest = max(seconds - threads_before.get(tid, 0.0) for tid, seconds in threads.items()) / wall
            if total >= least:
                used[label] = {"process": round(total, 2), "thread": round(busiest, 2)}
        return dict(sorted(used.items(), key=lambda item: -item[1]["process"]))


def cores_cell(cores: dict[str, dict[str, float]], top: int = 4) -> str:
    """The busiest processes for a report's cell: ``stub:token2wav 1.1 (0.93)``, the busiest thread in brackets."""
    if not cores:
        return "-"
    return ", ".join(f"{label} {use['process']:g} ({use['thread']:g})" for label, use in list(cores.items())[:top])
