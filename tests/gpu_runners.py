"""Old path of `tests.support.gpu_runners`, kept so branches that import it still work.

New code imports from `tests.support.gpu_runners`."""

from tests.support.gpu_runners import *  # noqa: F403
