"""What operators see: structured logs, Prometheus metrics and the health probe server, the health snapshot in
Redis, public error ids, and /proc process helpers."""
