"""On/off switches read from the environment (``MTPROBE_...=0`` or ``1``)."""

from __future__ import annotations

import os

ON = ("", "1", "true", "on", "yes")
OFF = ("0", "false", "off", "no")


def switch(name: str, what: str) -> bool:
    """The variable ``name`` as a bool, on where it is unset; ValueError for another value than those of
    :data:`ON` and :data:`OFF`, its message ending in ``what`` (what 0 and 1 mean)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ON:
        return True
    if raw in OFF:
        return False
    raise ValueError(f"{name}={raw!r}: {what}")
