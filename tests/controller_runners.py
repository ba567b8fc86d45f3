"""Old path of `tests.support.controller_runners`, kept so branches that import it still work.

New code imports from `tests.support.controller_runners`."""

from tests.support.controller_runners import *  # noqa: F403
