"""Whether a file or directory is this user's own to trust.

One rule for every place where the job reads or writes what another local
user could have planted or could change: the snapshot directory and what is
in it, the launcher's state and log directories, the user's private
directory. A path is trusted when it is not a symlink (seen with ``lstat``;
a caller that resolved the symlinks it trusts passes a ``stat``), is of the
kind asked for, is owned by this user, and nobody else may write to it (or,
for a directory that must be private, use it at all).

A place the job writes for as long as it runs (its state, log and records
locations) is also trusted only with its *chain*: the directories above it,
which another user must not be able to rename entries of
(:func:`distrust_chain`), else they could swap the place for one of theirs
after it was checked.
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


#: most symlinks :func:`distrust_chain` follows on one path (the kernel's own limit)
MAX_SYMLINKS = 40


def distrust_chain(path: str | os.PathLike[str]) -> str | None:
    """Why another user could change what ``path`` names; ``None``: only this user
    and root can.

    Whoever may rename the entries of a directory on the way can swap what lies
    below it for something of theirs at any time, also after a check of the path
    itself: so every step from the root down is looked at (with ``lstat``),
    symlinks followed. Each entry on the way, and ``path`` itself, must be owned
    by this user or root; each directory on the way that group or others may
    write must have the sticky bit (``/tmp``'s mode: then nobody renames or
    removes what they do not own). What does not exist yet ends the walk: the
    caller makes it, as its own.

    Invariant this gives the caller: a chain found trusted stays so, since only
    this user and root can change any step of it.

    The reason is a whole clause naming the step ("/srv/pub is owned by uid
    65534, not by this user (0) or root: that user can swap what is in it").
    """
    uid = os.getuid()
    pending = list(os.path.abspath(os.fspath(path)).split(os.sep)[1:])
    here = os.sep
    why = _step_distrust(here, os.lstat(here), uid)
    if why is not None:
        return why
    hops = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            here = os.path.dirname(here)
            continue
        step = os.path.join(here, name)
        try:
            info = os.lstat(step)
        except FileNotFoundError:
            return None  # the rest is made by the caller
        except OSError as ex:
            return f"{step} cannot be looked at ({ex.strerror or ex})"
        why = _step_distrust(step, info, uid)
        if why is not None:
            return why
        if stat.S_ISLNK(info.st_mode):
            hops += 1
            if hops > MAX_SYMLINKS:
                return f"{path} has too many levels of symlinks"
            target = os.readlink(step)
            if os.path.isabs(target):
                here = os.sep
            pending[:0] = target.split(os.sep)
            continue
        here = step
    return None


def _step_distrust(step: str, info: os.stat_result, uid: int) -> str | None:
    """Why ``step`` (seen as ``info``) lets another user change what lies at or below it."""
    if info.st_uid not in (uid, 0):
        return (
            f"{step} is owned by uid {info.st_uid}, not by this user ({uid}) or root: "
            "that user can swap what is in it"
        )
    mode = info.st_mode
    if stat.S_ISDIR(mode) and mode & OTHERS_WRITE and not mode & stat.S_ISVTX:
        return (
            f"{step} {WRITABLE_BY_OTHERS} without the sticky bit (mode "
            f"{stat.S_IMODE(mode):o}): another user can swap what is in it"
        )
    return None
