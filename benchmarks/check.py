"""One benchmark target checked on one subject: PASS, FAIL or SKIP, with the numbers."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["Check", "ok"]


@dataclasses.dataclass(frozen=True)
class Check:
    """One target on one subject."""

    target: str
    subject: str
    passed: Optional[bool]
    """True (PASS), False (FAIL) or None (SKIP: nothing to check, with the reason in ``detail``).
    """
    detail: str

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]


def ok(row: Optional[dict[str, Any]]) -> bool:
    """The row was measured (its ``status`` is ``"ok"``)."""
    return row is not None and row.get("status") == "ok"
