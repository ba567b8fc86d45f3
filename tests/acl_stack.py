"""Old path of `tests.support.acl_stack`, kept so branches that import it still work.

New code imports from `tests.support.acl_stack`."""

from tests.support.acl_stack import *  # noqa: F403
