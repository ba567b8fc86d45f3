"""LTX-2 pipeline runners on real checkpoints (see docs/runners.md).

- `runners`: the registry import path of `Ltx2DistilledRunner` ("ltx2-distilled") and
  `Ltx2TwoStageRunner` ("ltx2-two-stage"), which live in `distilled`, `two_stage` and their shared
  `base` (the job's stages)
- `denoise`: the denoising math (states, guidance, Euler loop pieces, upsampling) from ltx-core pieces
- `components`, `text`: loading every component through ltx-core's builders, meta-checked
- `images`: conditioning images in (PyAV)
- `synthetic`: checkpoint sets in the released layouts with seeded random weights (`tiny`, `full` 19B);
  `tiny`: the cached tiny set the tests use

Import by module path; this package imports nothing heavy.
"""
