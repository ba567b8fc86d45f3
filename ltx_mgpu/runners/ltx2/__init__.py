"""LTX-2 pipeline runners on real checkpoints (see docs/runners.md).

- `runners`: `Ltx2DistilledRunner` ("ltx2-distilled"), `Ltx2TwoStageRunner` ("ltx2-two-stage")
- `pipeline`: the denoising math (states, guidance, Euler loop pieces, upsampling) from ltx-core pieces
- `components`, `text`: loading every component through ltx-core's builders, meta-checked
- `media`: conditioning images in (PyAV), mp4 out
- `local`: `LocalRunner`, a runner in the calling process as a world of one
- `tiny`: deterministic tiny checkpoints in the released layouts (tests, CI, GPU smoke runs)

Import by module path; this package imports nothing heavy.
"""
