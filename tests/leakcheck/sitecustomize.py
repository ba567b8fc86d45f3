"""Loaded by every Python process of a leak-check run (PYTHONPATH): records each named POSIX semaphore a
`multiprocessing` lock creates (they live in /dev/shm as sem.mp-*) into $LTX_LEAKCHECK_LOG, so a test can
tell which ones its own processes made and check that none outlives them (tests/test_leftovers.py)."""

import os

_LOG = os.environ.get("LTX_LEAKCHECK_LOG")

if _LOG:
    import multiprocessing.synchronize as _synchronize

    _original_init = _synchronize.SemLock.__init__

    def _recording_init(self, *args, **kwargs):
        _original_init(self, *args, **kwargs)
        name = getattr(self._semlock, "name", None)
        if name:
            with open(_LOG, "a") as fh:
                fh.write(f"{os.getpid()} {name}\n")

    _synchronize.SemLock.__init__ = _recording_init
