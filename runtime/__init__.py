"""kimi_iree.runtime: run a compiled module with iree.runtime and numpy alone (no torch, no compiler).

    from kimi_iree.runtime import Session
    session = Session("OUT")                   # OUT/model.json, model.vmfb, model.irpa
    logits = session.prefill([1, 2, 3])        # logits of the last prompt token
    logits = session.decode(token)
"""

from .errors import RuntimeUsageError
from .session import Session

__all__ = ["RuntimeUsageError", "Session"]
