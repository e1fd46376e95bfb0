"""kimi_iree.runtime: run a compiled module with iree.runtime and numpy alone (no torch, no compiler).

    from kimi_iree.runtime import Session
    session = Session("OUT")                   # OUT/model.json, model.vmfb, model.irpa
    logits = session.prefill([1, 2, 3])        # logits of the last prompt token
    logits = session.decode(token)

    # several sequences: one call a step on a `--max-batch` module (a call each on batch-1)
    a, b = session.new_sequence(), session.new_sequence()
    la, lb = session.prefill_rows([(a, [1, 2, 3]), (b, [4, 5])])
    la, lb = session.decode_rows([(a, 7), (b, 9)])
    session.release(a)
"""

from .errors import RuntimeUsageError
from .session import Session

__all__ = ["RuntimeUsageError", "Session"]
