"""Top-k selection without a sort: radix select on order-preserving integer keys.

torch.topk exports as a full sort, which IREE runs as bubble-sort sweeps (about 140 ms for 8,192
keys, whatever k), and the SPIR-V sort is wrong on lavapipe from 1,024 keys and does not compile at
all for some shapes (IREE_NOTES §3). Selection here is counting only, so it lowers to plain
elementwise ops and reductions on every target:

  key(x)  an int32 whose signed order is the float order (-0 folded onto +0; -inf is the lowest)
  kth     the k-th largest key: the largest T with count(key >= T) >= k, found one hex digit at a
          time from the top: 8 steps, each counting the keys at or above 16 candidates (digit 0,
          which always holds k keys, is counted too: with 15, IREE 3.13's valhall codegen left a
          16-lane integer vector it cannot lower, README "Findings")
  keep    key > kth, plus the earliest keys equal to kth until k are kept (ties go to the earliest
          index, so the result depends only on the values, never on a compiler's sort order)

Up to PAIRWISE_MAX entries (a router's experts, its groups) a key's rank comes from comparing every pair
instead: one [n, n] reduction, where the radix select's eight rounds are some twenty small dispatches a
router (most of the dispatches of a decode step's routing). Both forms keep the same entries.

Everything works along the last dimension, with k static.
"""

from __future__ import annotations

import torch

INT32_MIN = -(2 ** 31)
DIGIT_BITS = 4
PAIRWISE_MAX = 256


def order_key(x: torch.Tensor) -> torch.Tensor:
    """int32 keys with key(a) < key(b) iff a < b for non-NaN floats (and key(-0.0) == key(+0.0))."""
    bits = x.to(torch.float32).view(torch.int32)
    # Negative floats order backwards by their bit pattern: map magnitude m to -1 - m (no int32
    # intermediate overflows, so every target's integer ops agree).
    key = torch.where(bits < 0, -1 - (bits & 0x7FFFFFFF), bits)
    return torch.where(bits == INT32_MIN, torch.zeros_like(key), key)   # -0.0 ties with +0.0


def kth_largest_key(key: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest of int32 keys along the last dim, keepdim ([..., 1]); needs k <= key.shape[-1]."""
    if not 1 <= k <= key.shape[-1]:
        raise ValueError(f"k={k} must be in 1..{key.shape[-1]}")
    # IREE-WORKAROUND(valhall): 16 candidates, digit 0 too (with 15 a 16-lane vector was left unsplit)
    steps = torch.arange(0, 2 ** DIGIT_BITS, dtype=torch.int32, device=key.device)   # candidate digits 0..15
    top = 32 - DIGIT_BITS
    threshold = torch.zeros_like(key[..., :1])
    for shift in range(top, -1, -DIGIT_BITS):
        # IREE-WORKAROUND(all): the top digit is signed, INT32_MIN + j * 2^28 written (j - 8) * 2^28, so no
        # intermediate overflows int32 (IREE's integer ops need not wrap like torch's).
        offset = 8 if shift == top else 0
        candidates = threshold + (steps - offset) * (1 << shift)                      # [..., 16]
        # IREE-WORKAROUND(cuda): counts summed as int32; torch's default int64 sum of bools over 257+ keys
        # failed CUDA's reduction distribution ("failed to distribute")
        counts = (key.unsqueeze(-2) >= candidates.unsqueeze(-1)).sum(-1, dtype=torch.int32)
        # counts fall as the candidate rises: the candidates still holding k keys are digits 0..digit
        digit = (counts >= k).sum(-1, keepdim=True).to(torch.int32) - 1
        threshold = threshold + (digit - offset) * (1 << shift)
    return threshold


def slot_numbers(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 as int32."""
    # IREE-WORKAROUND(valhall): a running count, not an iota compared inside a reduction (README "Findings")
    return torch.ones(n, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32) - 1


def place(key: torch.Tensor, ahead) -> torch.Tensor:
    """Each key's place along the last dim when `ahead(a, b)` (torch.gt: descending, torch.lt: ascending)
    orders them, ties to the earliest index: the keys ahead of it plus the equal keys before it (int32).
    [..., n, n] compares."""
    index = slot_numbers(key.shape[-1], key.device)
    other, this = key.unsqueeze(-2), key.unsqueeze(-1)                    # [..., i, j]: key j against key i
    # IREE-WORKAROUND(export): logical_* ops, torch-mlir lowers no bool `&`
    earlier_tie = torch.logical_and(other == this, index.unsqueeze(0) < index.unsqueeze(1))
    return torch.logical_or(ahead(other, this), earlier_tie).sum(-1, dtype=torch.int32)


def descending_rank(key: torch.Tensor) -> torch.Tensor:
    """Each int32 key's place in descending order along the last dim (0 = the largest), ties to the earliest index."""
    return place(key, torch.gt)


def topk_members(x: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask of the top-k entries of x along the last dim, ties to the earliest index.

    valid (broadcastable to x): entries that may be chosen; when fewer than k are valid, all valid
    entries are kept and no invalid one is.
    """
    if valid is not None:
        x = x.masked_fill(~valid, float("-inf"))
    key = order_key(x)
    if key.shape[-1] <= PAIRWISE_MAX:
        if valid is not None:
            key = key.masked_fill(~valid, INT32_MIN)        # below a valid -inf, as the radix form's ties are
        keep = descending_rank(key) < k
        return keep if valid is None else torch.logical_and(keep, valid)
    kth = kth_largest_key(key, k)
    above = key > kth
    tied = key == kth
    if valid is not None:
        tied = torch.logical_and(tied, valid)
    room = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    keep = torch.logical_or(above, torch.logical_and(tied, tied.to(torch.int32).cumsum(-1) <= room))
    return keep if valid is None else torch.logical_and(keep, valid)


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of x along the last dim, keepdim (exactly one of x's values)."""
    key = order_key(x)
    if key.shape[-1] <= PAIRWISE_MAX:
        if not 1 <= k <= key.shape[-1]:
            raise ValueError(f"k={k} must be in 1..{key.shape[-1]}")
        kth = key.masked_fill(descending_rank(key) != k - 1, INT32_MIN).amax(-1, keepdim=True)
    else:
        kth = kth_largest_key(key, k)
    return x.masked_fill(key != kth, float("-inf")).amax(-1, keepdim=True)


def member_slots(members: torch.Tensor, k: int) -> torch.Tensor:
    """One-hot [..., k, n] (float) of a mask [..., n] holding up to k members: slot j is the j-th
    member in index order, all zero when there are fewer."""
    # IREE-WORKAROUND(llvm-cpu): a comparison, not a scatter of indices (a scatter into a tiny mask failed
    # llvm-cpu translation inside the whole model)
    rank = members.to(torch.int32).cumsum(-1) - 1                        # [..., n]
    slots = torch.arange(k, dtype=torch.int32, device=members.device)
    onehot = torch.logical_and(members.unsqueeze(-2), rank.unsqueeze(-2) == slots.unsqueeze(-1))
    return onehot.to(torch.float32)


def stable_order(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable ascending sort of a 1-D integer tensor (values within int32) by counting: (order, rank)
    with keys[order] sorted, ties in index order, and rank the inverse permutation (order[rank[i]] == i).
    Pairwise comparisons, [n, n]: meant for the few hundred routed (token, expert) pairs of a block.
    IREE 3.13's valhall codegen cannot lower a reduction that compares iota values (it asks for a
    workgroup buffer of `index` values, README "Findings"): the positions are a running count, all int32."""
    keys = keys.to(torch.int32)
    index = slot_numbers(keys.shape[0], keys.device)
    rank = place(keys, torch.lt)                                             # [n]: place of element i
    at_place = rank.unsqueeze(0) == index.unsqueeze(1)                       # [r, i]
    order = (at_place * index.unsqueeze(0)).sum(1, dtype=torch.int32)       # the i at place r
    return order.to(torch.int64), rank.to(torch.int64)
