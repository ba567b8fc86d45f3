"""LTX-2 pipeline runners on real checkpoints (see docs/runners.md).

Import the runners by module path (`ltx_mgpu.runners.ltx2.runners`); this package imports nothing heavy.
"""
