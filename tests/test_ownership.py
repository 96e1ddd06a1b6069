"""The one rule for what is this user's own to trust (``inprocess.ownership``), on
stat results made up for each case: no second user needed."""

from __future__ import annotations

import os
import stat

import pytest

from inprocess.ownership import OTHERS_ANY, distrust


def info(kind: int, mode: int, uid: int | None = None) -> os.stat_result:
    uid = os.getuid() if uid is None else uid
    return os.stat_result((kind | mode, 1, 1, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("st", "directory", "others", "reason"),
    [
        (info(stat.S_IFDIR, 0o755), True, 0o022, None),
        (info(stat.S_IFREG, 0o600), False, 0o022, None),
        (info(stat.S_IFLNK, 0o777), False, 0o022, "is a symlink"),
        (info(stat.S_IFREG, 0o700), True, 0o022, "is not a directory"),
        (info(stat.S_IFDIR, 0o700, uid=os.getuid() + 1), True, 0o022,
         f"is owned by uid {os.getuid() + 1}, not by this user ({os.getuid()})"),
        (info(stat.S_IFDIR, 0o775), True, 0o022, "is writable by group or others (mode 775)"),
        (info(stat.S_IFREG, 0o602), False, 0o022, "is writable by group or others (mode 602)"),
        (info(stat.S_IFDIR, 0o750), True, OTHERS_ANY, "can be used by group or others (mode 750)"),
        (info(stat.S_IFDIR, 0o777), True, 0, None),  # the mode not looked at
    ],
)  # fmt: skip
def test_distrust_names_the_first_reason(st, directory, others, reason):
    assert distrust(st, directory=directory, others=others) == reason


def test_the_first_reason_wins_a_strangers_symlink_is_a_symlink():
    assert distrust(info(stat.S_IFLNK, 0o777, uid=os.getuid() + 1)) == "is a symlink"
