"""This user's private directory on this host: the job-id locks of ``inprocess-run``
and the node groups' directories (:mod:`inprocess.node`) live in it.

A shared temporary directory (``/tmp``) is writable by everyone: another local
user can create ``inprocess-<uid>`` there first (a directory of theirs, or a
symlink). Such a path is never used, nor followed. :func:`user_dir` takes
the first of:

* ``$INPROCESS_USER_DIR``, when it names a directory of ours that only we can
  use (set by the first process of a job that found one, so that every
  process it starts uses the same);
* ``<base>/inprocess-<uid>``, when it is ours and private, or can be made so;
* else the first (by name) ``<base>/inprocess-<uid>-*`` that is ours and
  private, or a fresh one (``mkdtemp``): processes that start on their own
  find the same one, since nobody else can make a directory of ours.

A directory of ours of those names with a wider mode is made private
(``chmod 0700``); ``lstat`` decides, so a symlink is never taken for a
directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

from .ownership import OTHERS_ANY, distrust

log = logging.getLogger(__name__)

#: environment variable naming the directory found (inherited by the job's processes)
USER_DIR_ENV = "INPROCESS_USER_DIR"
#: Unix socket paths longer than this do not fit ``sockaddr_un`` (with room for
#: the names the node groups put below)
_MAX_BASE = 60


def _ours(path: str, make_private: bool = True) -> bool:
    """Whether ``path`` is a directory (not a symlink) of this user that only it can
    use; one of ours with a wider mode is made private first if ``make_private``
    (only for the names this module makes)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if distrust(info, directory=True, others=0) is not None:
        return False
    if info.st_mode & OTHERS_ANY:
        if not make_private:
            return False
        try:
            os.chmod(path, 0o700, follow_symlinks=False)
        except OSError:
            return False
    return True


def user_dir(base: str | None = None) -> str:
    """This user's private directory (see the module's doc), created if needed.

    ``base``: where to look (default: the temporary directory, ``/tmp`` when a
    long ``$TMPDIR`` would leave sockets below it no room); given a ``base``,
    ``$INPROCESS_USER_DIR`` is not consulted (a location of its own).

    Raises:
        OSError: no private directory can be made in ``base``.
    """
    if base is None:
        inherited = os.environ.get(USER_DIR_ENV)
        if inherited and os.path.isabs(inherited) and _ours(inherited, make_private=False):
            return inherited
        base = tempfile.gettempdir()
        if len(base) > _MAX_BASE:
            base = "/tmp"
        found = _find(base)
        os.environ[USER_DIR_ENV] = found  # the processes this one starts use it too
        return found
    return _find(base)


def _find(base: str) -> str:
    uid = os.getuid()
    primary = os.path.join(base, f"inprocess-{uid}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(primary, 0o700)
    if _ours(primary):
        return primary
    prefix = f"inprocess-{uid}-"
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(base)):
            path = os.path.join(base, name)
            if name.startswith(prefix) and _ours(path):
                return path
    log.warning(
        "%s is not a private directory of this user (another user's, or a symlink): "
        "using a fresh one beside it",
        primary,
    )
    return tempfile.mkdtemp(prefix=prefix, dir=base)
