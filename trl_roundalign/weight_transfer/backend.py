"""The name this package registers its weight-transfer backend under (``--weight-transfer-config '{"backend": "gloo"}'``).

A module of its own so that `trl_roundalign._compat` (which the weight-transfer modules call) can recognise a
gloo-served engine without importing the weight-transfer package back.
"""

from __future__ import annotations

BACKEND = "gloo"
