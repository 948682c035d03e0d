"""The seed window (decode/seed_state.py, SeedWindow) against a plain list: after any sequence
of appends (contiguous, with gaps, longer than the window) it holds the last ``max_rows``
contiguous rows at the right positions, whatever its buffer did underneath."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specmesh.decode.seed_state import SeedWindow

APPENDS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(max_rows=st.integers(1, 6), appends=APPENDS)
def test_window_equals_a_list_of_the_last_contiguous_rows(max_rows, appends):
    w = SeedWindow(max_rows=max_rows)
    ref_start, ref = 0, None
    pos = 0
    for n, gap in appends:
        pos += gap
        w.append(pos, torch.arange(pos, pos + n, dtype=torch.float64)[:, None].repeat(1, 3))
        if n:
            if ref is None or pos != ref_start + len(ref):
                ref_start, ref = pos, []
            ref += list(range(pos, pos + n))
            if len(ref) > max_rows:
                ref_start, ref = ref_start + len(ref) - max_rows, ref[-max_rows:]
        pos += n
        if ref is None:
            assert w.rows is None
            continue
        assert (w.start, w.end) == (ref_start, ref_start + len(ref))
        assert w.rows[:, 0].tolist() == ref and w.rows[:, 2].tolist() == ref
        assert w.rows_from(ref_start)[:, 0].tolist() == ref
        assert w.rows_from(ref_start - 1) is None
