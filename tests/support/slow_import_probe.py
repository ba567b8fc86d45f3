"""Imported by `ImportingRunner` through `background_imports`: remembers which thread imported it and when,
and takes a while to import, like a large modeling package does."""

import threading
import time

IMPORTED_BY = threading.current_thread().name
time.sleep(0.5)
IMPORTED_AT = time.time()
