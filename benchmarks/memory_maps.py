"""Where a process's own memory lies: its anonymous pages by the kind of mapping that holds them.

A soak that finds a process's own memory (``RssAnon``) growing needs to know next what grows: malloc's
heap, a thread's stack, or memory mapped outside malloc (Python's object arenas, a GPU driver's host
buffers, large arrays). ``/proc/PID/smaps`` gives the anonymous pages of every mapping; the kinds are
told apart by the layout glibc gives them on 64-bit Linux:

- *malloc heap*: ``[heap]``, the main arena's heap;
- *malloc arenas*: the other threads' arenas, whose heaps are each reserved as 64 MiB aligned to 64 MiB,
  the part in use readable and writable, the rest inaccessible after it;
- *thread stacks*: a writable mapping right above a small inaccessible one, its guard page;
- *other anonymous*: every other anonymous mapping (mmap outside malloc's arenas, malloc's own large blocks);
- *file copies*: pages of files mapped privately and then written (relocated data of shared libraries);
  an anonymous mapping given a name (``[anon:...]``) counts as anonymous;
- *main stack*: ``[stack]``.

The kinds are read from layout, not from who made a mapping: a library that reserves and guards memory
as glibc does is counted with glibc's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

ARENA_BYTES: Final = 64 * 1024 * 1024
# Larger than a thread's guard page (one page unless a program asks for more), smaller than the regions a
# GPU driver reserves inaccessible.
MAX_GUARD_BYTES: Final = 64 * 1024
KINDS: Final = ("malloc heap", "malloc arenas", "thread stacks", "other anonymous", "file copies", "main stack")


@dataclass(frozen=True)
class Mapping:
    """One mapping of ``/proc/PID/smaps``: its address range, permissions, name and anonymous KiB."""

    start: int
    end: int
    perms: str
    name: str
    anonymous_kib: int

    @property
    def from_file(self) -> bool:
        return self.name.startswith("/")

    @property
    def inaccessible(self) -> bool:
        return self.perms.startswith("---") and not self.from_file


def parse_smaps(text: str) -> list[Mapping]:
    """The mappings of a ``/proc/PID/smaps`` text, in address order."""
    mappings: list[Mapping] = []
    header: tuple[int, int, str, str] | None = None
    anonymous = 0
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):
            if header is not None:
                mappings.append(Mapping(*header, anonymous))
            start, end = (int(address, 16) for address in fields[0].split("-"))
            header, anonymous = (start, end, fields[1], " ".join(fields[5:])), 0
        elif fields[0] == "Anonymous:":
            anonymous = int(fields[1])
    if header is not None:
        mappings.append(Mapping(*header, anonymous))
    return mappings


def kind_of(mapping: Mapping, below: Mapping | None, above: Mapping | None) -> str:
    """The kind (one of :data:`KINDS`) of ``mapping``, given its neighbours in address order."""
    if mapping.name == "[heap]":
        return "malloc heap"
    if mapping.name == "[stack]":
        return "main stack"
    if mapping.from_file:
        return "file copies"
    size = mapping.end - mapping.start
    # A heap's reserved rest runs to the next 64 MiB boundary; an arena's heaps that lie next to each other
    # are one mapping (whole heaps, then the one in use), with no rest after them when all are whole.
    reserved_rest = (
        above is not None and above.start == mapping.end and above.inaccessible and above.end % ARENA_BYTES == 0
    )
    if mapping.start % ARENA_BYTES == 0 and (reserved_rest or size % ARENA_BYTES == 0):
        return "malloc arenas"
    guarded = (
        below is not None
        and below.end == mapping.start
        and below.inaccessible
        and below.end - below.start <= MAX_GUARD_BYTES
    )
    if guarded and "w" in mapping.perms:
        return "thread stacks"
    return "other anonymous"


def split_by_kind(mappings: list[Mapping]) -> dict[str, float]:
    """MiB of anonymous pages per kind, every kind present (0 where none)."""
    totals = dict.fromkeys(KINDS, 0.0)
    for index, mapping in enumerate(mappings):
        if mapping.anonymous_kib:
            below = mappings[index - 1] if index else None
            above = mappings[index + 1] if index + 1 < len(mappings) else None
            totals[kind_of(mapping, below, above)] += mapping.anonymous_kib / 1024
    return {kind: round(mib, 1) for kind, mib in totals.items()}


def own_memory_by_kind(pid: int) -> dict[str, float]:
    """:func:`split_by_kind` of process ``pid``, read now (a mapping's name need not be UTF-8)."""
    return split_by_kind(parse_smaps(Path(f"/proc/{pid}/smaps").read_bytes().decode(errors="replace")))
