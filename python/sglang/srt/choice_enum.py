"""ChoiceEnum: a closed set of string choices (a flag's values) with one parse rule."""

from __future__ import annotations

import re
from enum import Enum


class ChoiceEnum(str, Enum):
    """``parse`` turns a flag value (or a member) into a member, or raises ValueError naming the
    setting and every allowed value. Subclasses override ``label`` when the flag name differs
    from the class name spelled out ("HostLayout" -> "host layout")."""

    @classmethod
    def label(cls) -> str:
        return re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()

    @classmethod
    def parse(cls, value):
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown {cls.label()} {value!r}; allowed: {allowed}") from None
