"""Which experts a Qwen3-MoE router picks: top-k of the router's probabilities, ties broken as
transformers breaks them.

transformers picks with `torch.topk`, and on the CPU (aten/native/cpu/SortingKernel.cpp, topk_impl_loop)
that is libstdc++'s `std::nth_element` (or `std::partial_sort` when k * 64 <= experts) over (value,
index) pairs compared by value alone. Between experts with EXACTLY equal probabilities -- identical
router rows, a zero router -- the one it keeps is whatever that selection algorithm leaves in front
(for 4 equal experts and k=2: experts 2 and 3), not the lowest index. Which experts a token uses
changes its output, so the model's definition on a tie is torch's choice, and both forwards take it
from here: `top_k` is the plain stable sort where no tie straddles the k-th place (the usual case,
where every algorithm agrees) and a step-by-step replay of libstdc++'s algorithms where one does.
The order within the k (a summation order) is the replay's too, so ties cost no exactness.
"""
from __future__ import annotations

import numpy as np


def _greater(a, b) -> bool:  # the comparator of topk_impl_loop (largest=True; NaN sorts first)
    return (np.isnan(a[0]) and not np.isnan(b[0])) or a[0] > b[0]


def _insertion_sort(q, lo, hi) -> None:
    for i in range(lo + 1, hi):
        val = q[i]
        if _greater(val, q[lo]):
            q[lo + 1:i + 1] = q[lo:i]
            q[lo] = val
        else:
            j = i
            while _greater(val, q[j - 1]):
                q[j] = q[j - 1]
                j -= 1
            q[j] = val


def _move_median_to_first(q, result, a, b, c) -> None:
    if _greater(q[a], q[b]):
        pick = b if _greater(q[b], q[c]) else c if _greater(q[a], q[c]) else a
    else:
        pick = a if _greater(q[a], q[c]) else c if _greater(q[b], q[c]) else b
    q[result], q[pick] = q[pick], q[result]


def _unguarded_partition(q, first, last, pivot) -> int:
    while True:
        while _greater(q[first], q[pivot]):
            first += 1
        last -= 1
        while _greater(q[pivot], q[last]):
            last -= 1
        if not first < last:
            return first
        q[first], q[last] = q[last], q[first]
        first += 1


def _adjust_heap(q, first, hole, length, value) -> None:
    top, child = hole, hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _greater(q[first + child], q[first + child - 1]):  # comp(child, child - 1)
            child -= 1
        q[first + hole] = q[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        q[first + hole] = q[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and _greater(q[first + parent], value):  # push_heap: comp(parent, value)
        q[first + hole] = q[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    q[first + hole] = value


def _make_heap(q, first, last) -> None:
    length = last - first
    for parent in range((length - 2) // 2, -1, -1):
        _adjust_heap(q, first, parent, length, q[first + parent])


def _heap_select(q, first, middle, last) -> None:
    _make_heap(q, first, middle)
    for i in range(middle, last):
        if _greater(q[i], q[first]):  # pop_heap(first, middle, i)
            value, q[i] = q[i], q[first]
            _adjust_heap(q, first, 0, middle - first, value)


def _sort_heap(q, first, last) -> None:
    while last - first > 1:
        last -= 1
        value, q[last] = q[last], q[first]
        _adjust_heap(q, first, 0, last - first, value)


def _nth_element(q, nth) -> None:  # libstdc++ std::__introselect
    first, last = 0, len(q)
    depth = 2 * (len(q).bit_length() - 1)
    while last - first > 3:
        if depth == 0:
            _heap_select(q, first, nth + 1, last)
            q[first], q[nth] = q[nth], q[first]
            return
        depth -= 1
        mid = first + (last - first) // 2
        _move_median_to_first(q, first, first + 1, mid, last - 1)
        cut = _unguarded_partition(q, first + 1, last, first)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(q, first, last)


def torch_topk(values, k: int) -> list[int]:
    """The indices torch.topk(values, k) returns on the CPU, in its order (libstdc++ replayed)."""
    q = [(float(v), j) for j, v in enumerate(values)]
    if k * 64 <= len(q):
        _heap_select(q, 0, k, len(q))
        _sort_heap(q, 0, k)
    else:
        _nth_element(q, k - 1)
        if k - 1 > 16:
            raise ValueError(f"top-k: k={k}: std::sort of more than 16 elements is not replayed")
        _insertion_sort(q, 0, k - 1)  # std::sort of k - 1 <= 16 elements is one insertion sort
    return [j for _, j in q[:k]]


def top_k(probs, k: int) -> np.ndarray:
    """probs [tokens, experts] -> the chosen experts [tokens, k], row by row as torch.topk chooses them."""
    order = np.argsort(-probs, axis=-1, kind="stable")                      # [tokens, experts]
    chosen = order[:, :k].copy()                                            # [tokens, k]
    if k < probs.shape[1]:
        rows = np.arange(len(probs))
        straddled = probs[rows, order[:, k - 1]] == probs[rows, order[:, k]]  # a tie across the k-th place
        for row in np.flatnonzero(straddled):
            chosen[row] = torch_topk(probs[row], k)
    return chosen
