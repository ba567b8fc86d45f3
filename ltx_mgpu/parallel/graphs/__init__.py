"""The graph-ready forward: host work hoisted out of the transformer forward (`hoist`, its caches `capture_cache`), the
forward captured once per shape and replayed as a CUDA graph (`cuda_graph`), and the audit that finds host syncs
without a GPU (`graph_audit`)."""
