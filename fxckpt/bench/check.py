"""One benchmark target checked on one subject: PASS, FAIL or SKIP, with the numbers."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["Check"]


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
