"""Whether a file or directory is this user's own to trust.

One rule for every place where the job reads or writes what another local
user could have planted or could change: the snapshot directory and what is
in it, the launcher's state and log directories, the user's private
directory. A path is trusted when it is not a symlink (seen with ``lstat``;
a caller that resolved the symlinks it trusts passes a ``stat``), is of the
kind asked for, is owned by this user, and nobody else may write to it (or,
for a directory that must be private, use it at all).
"""

from __future__ import annotations

import os
import stat

#: mode bits that let another user change what a file or directory holds
OTHERS_WRITE = 0o022
#: mode bits that let another user use a directory at all
OTHERS_ANY = 0o077
#: how :func:`distrust` begins a reason about the mode (a ``chmod`` fixes it)
WRITABLE_BY_OTHERS = "is writable by group or others"


def distrust(
    info: os.stat_result, *, directory: bool = False, others: int = OTHERS_WRITE
) -> str | None:
    """Why a path with ``info`` is not this user's own to trust; ``None``: it is.

    The reason reads after the path's name ("is a symlink", "is not a
    directory", "is owned by uid 1001, not by this user (1000)", "is writable
    by group or others (mode 777)"). ``directory``: it must be one;
    ``others``: the mode bits nobody else may have (0: the mode is not
    looked at).
    """
    uid = os.getuid()
    if stat.S_ISLNK(info.st_mode):
        return "is a symlink"
    if directory and not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != uid:
        return f"is owned by uid {info.st_uid}, not by this user ({uid})"
    if info.st_mode & others:
        mode = stat.S_IMODE(info.st_mode)
        if others & ~OTHERS_WRITE:
            return f"can be used by group or others (mode {mode:o})"
        return f"{WRITABLE_BY_OTHERS} (mode {mode:o})"
    return None
