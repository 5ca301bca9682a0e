"""User-facing errors: the CLI prints their message on one line and exits non-zero."""

from __future__ import annotations

import errno
import os
import shutil


class UserError(Exception):
    """A mistake in the user's input (config, file, data, arguments), not a bug in moetrain."""


class ConfigError(UserError, ValueError):
    """A configuration error: the message names the key, where it came from, and what is valid."""


# What an operating-system failure means to the user, by errno (the rest use the OS's own text).
_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a path component is a file, not a directory",
    errno.EISDIR: "is a directory",
    errno.EEXIST: "already exists",
    errno.ENOENT: "no such file or directory",
    errno.ENAMETOOLONG: "file name too long",
    errno.EMFILE: "too many open files",
    errno.EIO: "input/output error",
}


def os_reason(err: OSError) -> str:
    """A short phrase for an OSError: 'disk full', 'read-only file system', ... ."""
    return _REASONS.get(err.errno, err.strerror or type(err).__name__)


def free_bytes(path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent), or None."""
    p = os.path.abspath(path)
    while p and not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def os_error(err: OSError, doing: str, *, needed_bytes: int | None = None, after: str = "") -> UserError:
    """A UserError for an OSError met while ``doing`` something ('saving checkpoint step_20').

    One line: what was being done, why it failed (in words, not an errno), the path, and for a
    full disk how many bytes were needed and are free. ``after`` is appended (e.g. what is intact).
    """
    path = err.filename if err.filename is not None else None
    parts = [f"{doing}: {os_reason(err)}"]
    if path is not None:
        parts[0] += f" ({path})"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path) if path is not None else None
        if needed_bytes is not None:
            parts.append(f"needs {format_bytes(needed_bytes)}" + (f", {format_bytes(free)} free" if free is not None else ""))
        elif free is not None:
            parts.append(f"{format_bytes(free)} free")
    if after:
        parts.append(after)
    return UserError("; ".join(parts))


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
