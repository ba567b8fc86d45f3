"""The sequence-parallel core: the all2all head exchange (`all2all`: interface, registry, custom ops; `backends`), the
attention callables routed through it (`attention`), and the wrapper and builder that run an LTX-2 transformer on a
rank's slice of the video tokens (`wrapper`, `builder`)."""
