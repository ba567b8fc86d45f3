"""The exit codes of a worker process (`ltx-worker one`) and of the supervisor (`ltx-worker`), in one place.

The supervisor decides from them whether restarting can help. Only a configuration error cannot clear
by itself (settings, storage credentials, a missing GPU, Redis refusing our credentials, a Redis URL
naming a server that is not Redis): the supervisor
stops the other workers and exits with it. Everything else (a fleet that could not be rebuilt, a crash,
a kill) is restarted with exponential back-off and never given up on: the review that found a tenant
filling Redis saw the workers die at registration, the supervisor give up after five quick exits, and
the service stay down after Redis had memory again.
"""

from __future__ import annotations

__all__ = ["EXIT_BAD_CONFIG", "EXIT_FLEET_UNRECOVERABLE", "EXIT_OK", "PERMANENT_EXITS"]

EXIT_OK = 0  #: stopped on request (SIGTERM/SIGINT), or burst/max-jobs finished
EXIT_BAD_CONFIG = 2  #: a configuration error, said in one line; also the supervisor's code for it
EXIT_FLEET_UNRECOVERABLE = 3  #: the fleet could not be (re)built `max_rebuild_failures` times in a row

#: worker exit codes after which the supervisor does not restart (restarting cannot fix them)
PERMANENT_EXITS = frozenset({EXIT_BAD_CONFIG})
