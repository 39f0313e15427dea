"""The name this package registers its weight-transfer backend under (``--weight-transfer-config '{"backend": "gloo"}'``).

Defined by the engine's dispatcher (`trl_roundalign.engine.dispatch.GLOO_BACKEND`), which must recognise a gloo-served
engine without importing this package back.
"""

from __future__ import annotations

from ..engine.dispatch import GLOO_BACKEND as BACKEND

__all__ = ["BACKEND"]
