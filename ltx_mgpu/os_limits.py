"""The process's open-files limit, raised to what the system allows before a fleet starts.

Tensors cross process boundaries as file descriptors (torch's default `file_descriptor` sharing: one per
storage in flight, plus the pipes and sockets of every rank), and the soft `RLIMIT_NOFILE` of an ordinary
user is often 1,024 while its hard limit is far higher (20,000 on our CI machines; root's soft limit there
is 20,000 too). A non-root run of the suite hit `EMFILE` in a two-rank LoRA swap (`reduce_storage` ->
`DupFd`) and under a flood of metrics clients; services such as nginx and PostgreSQL raise the soft limit
at start for the same reason. Raising the soft limit up to the hard one needs no privilege; ranks inherit it.
"""

from __future__ import annotations

__all__ = ["raise_open_files_limit"]

#: the most this asks for: well above what a fleet uses, below limits that make `select`-based code unsafe
WANTED_OPEN_FILES = 65536


def raise_open_files_limit(wanted: int = WANTED_OPEN_FILES) -> int | None:
    """Raise the soft open-files limit toward min(hard limit, `wanted`); never lowers it. Returns the soft
    limit now, or None where the platform has none or refuses (nothing else changes then)."""
    try:
        import resource
    except ImportError:  # (not POSIX)
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    except (ValueError, OSError):
        return None
    return soft
