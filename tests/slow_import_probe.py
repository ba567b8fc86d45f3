"""Old path of `tests.support.slow_import_probe`, kept so branches that import it still work.

New code imports from `tests.support.slow_import_probe`."""

from tests.support.slow_import_probe import *  # noqa: F403
