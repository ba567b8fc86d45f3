"""The exit codes of a worker process (`ltx-worker one`) and of the supervisor (`ltx-worker`), in one place.

The supervisor decides from them whether restarting can help. Only a configuration error cannot clear
by itself (settings, storage credentials, a missing GPU, Redis refusing our credentials, a Redis URL
naming a server that is not Redis): the supervisor
stops the other workers and exits with it. Everything else (a fleet that could not be rebuilt, a crash,
a kill) is restarted with exponential back-off and never given up on: a cause outside the worker (a Redis
filled by a tenant, an outage) can make every restart fail quickly for a while, and once it clears the
service must be back without an operator.
"""

from __future__ import annotations

__all__ = ["EXIT_BAD_CONFIG", "EXIT_FLEET_UNRECOVERABLE", "EXIT_OK", "PERMANENT_EXITS"]

EXIT_OK = 0  #: stopped on request (SIGTERM/SIGINT), or burst/max-jobs finished
EXIT_BAD_CONFIG = 2  #: a configuration error, said in one line; also the supervisor's code for it
EXIT_FLEET_UNRECOVERABLE = 3  #: the fleet could not be (re)built `max_rebuild_failures` times in a row

#: worker exit codes after which the supervisor does not restart (restarting cannot fix them)
PERMANENT_EXITS = frozenset({EXIT_BAD_CONFIG})
