"""The two LTX-2 runners under the import path the worker's runner registry names
(`ltx_mgpu.runners.ltx2.runners:Ltx2DistilledRunner`, `...:Ltx2TwoStageRunner`).

The runners themselves: `base.py` (shared stages; `resident.py`: setup), `distilled.py`, `two_stage.py`; see
docs/runners.md.
"""

from __future__ import annotations

from .distilled import Ltx2DistilledRunner
from .two_stage import DEFAULT_NEGATIVE_PROMPT, Ltx2TwoStageRunner

__all__ = ["DEFAULT_NEGATIVE_PROMPT", "Ltx2DistilledRunner", "Ltx2TwoStageRunner"]
