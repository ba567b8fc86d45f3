"""What the worker shares with the producer and every other client: Redis key names and job states, the
request schema and its limits, job events, cancellation, the RQ job class and RQ access, ACL generation and
the Redis connection. Light (pydantic, redis and rq; never torch or boto3): the producer image copies this
folder and nothing else of worker/ (tests/test_import_contracts.py holds both)."""
