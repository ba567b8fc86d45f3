"""The RQ wing's upper part: the RQ worker class and everything its loop does that knows RQ (see `worker.rq`)."""
