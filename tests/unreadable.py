"""For tests of unreadable (chmod 000) files: root reads any file, so a child process started as root
drops the two capabilities that allow it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) before exec."""

import os


def without_root_read_override():
    """`preexec_fn` for subprocess: drop root's read-anything capabilities from the bounding set."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")


def preexec():
    """The preexec_fn to pass: only needed (and only allowed) as root."""
    return without_root_read_override if os.geteuid() == 0 else None
