"""One meaning of ``seq_idx`` (issue 17): a new segment starts wherever the id changes along the row, so a reused
id is a new segment. Every backend and chunk size agrees with running each segment on its own."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from mixer_plugins.errors import MixerInputError
from mixer_plugins.kernels import directional_scan, quasiseparable, scan_matrix, ssd
from mixer_plugins.kernels._scan import normalize_seq_idx

LENGTH = 23
# row 0 reuses id 0 (three segments: 0-4, 5-10, 11-17, then 18-22 with id 2); row 1 reuses 7 and has a
# one-token segment
ROWS = [[0] * 5 + [1] * 6 + [0] * 7 + [2] * 5, [7] * 9 + [3] + [7] * 13]
CHUNKS = (4, 7, 16, 64)  # 7 and 16 do not divide 23; 64 is one chunk holding every segment


def _segments(row):
    bounds = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]] + [len(row)]
    return list(zip(bounds[:-1], bounds[1:]))


def _inputs(seed=0, batch=2, heads=2, head_dim=3, groups=1, state=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, LENGTH, heads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.randn(batch, LENGTH, heads, generator=g, dtype=torch.float64)
    A = -torch.rand(heads, generator=g, dtype=torch.float64) - 0.5
    B = torch.randn(batch, LENGTH, groups, state, generator=g, dtype=torch.float64)
    C = torch.randn(batch, LENGTH, groups, state, generator=g, dtype=torch.float64)
    return x, dt, A, B, C


def _renumbered(rows):
    return normalize_seq_idx(torch.tensor(rows)) * 10 + 3  # distinct ids, same segments


def _per_segment(op, rows, x, dt, A, B, C, extra):
    """The independent oracle: each row's segments run one at a time, with no seq_idx, by the matrix."""
    y = torch.empty_like(x)
    for r, row in enumerate(rows):
        for lo, hi in _segments(row):
            sl = slice(lo, hi)
            part = {k: (v[r: r + 1, sl] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == LENGTH
                        else v) for k, v in extra.items()}
            y[r: r + 1, sl] = op(x[r: r + 1, sl], dt[r: r + 1, sl], A, B[r: r + 1, sl], C[r: r + 1, sl],
                                 backend="reference", **part)
    return y


OPS = {
    "ssd": (lambda *a, **k: ssd(*a, dt_softplus=True, **k), {}),
    "quasiseparable_shift": (quasiseparable, {"shift": True, "dt_softplus": True}),
    "quasiseparable_add": (quasiseparable, {"shift": False, "dt_softplus": True}),
    "directional_reverse": (directional_scan, {"reverse": True, "shift": True, "dt_softplus": True}),
    "directional_forward": (directional_scan, {"reverse": False, "dt_softplus": True}),
}


@pytest.mark.parametrize("op_name", list(OPS))
def test_reused_ids_mean_new_segments_in_every_backend_and_chunk_size(op_name):
    op, extra = OPS[op_name]
    x, dt, A, B, C = _inputs()
    if op_name.startswith("quasiseparable"):
        extra = {**extra, "diag": torch.randn(2, LENGTH, 2, dtype=torch.float64)}
    expected = _per_segment(op, ROWS, x, dt, A, B, C, extra)
    reused, renumbered = torch.tensor(ROWS), _renumbered(ROWS)
    for seq_idx in (reused, renumbered, reused.to(torch.int32)):
        got = op(x, dt, A, B, C, seq_idx=seq_idx, backend="reference", **extra)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        for chunk in CHUNKS:
            got = op(x, dt, A, B, C, seq_idx=seq_idx, backend="torch", chunk_size=chunk, **extra)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, msg=f"chunk {chunk}")


def test_ssd_states_with_reused_ids():
    """The initial state enters the first segment only; the final state is the last segment's."""
    x, dt, A, B, C = _inputs(seed=1)
    init = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    y_exp = torch.empty_like(x)
    finals = []
    for r, row in enumerate(ROWS):
        for n, (lo, hi) in enumerate(_segments(row)):
            sl = slice(lo, hi)
            y, final = ssd(x[r: r + 1, sl], dt[r: r + 1, sl], A, B[r: r + 1, sl], C[r: r + 1, sl], dt_softplus=True,
                           initial_states=init[r: r + 1] if n == 0 else None, return_final_states=True,
                           backend="reference")
            y_exp[r: r + 1, sl] = y
        finals.append(final)
    final_exp = torch.cat(finals)
    for backend, chunk in [("reference", 64)] + [("torch", c) for c in CHUNKS]:
        y, final = ssd(x, dt, A, B, C, chunk_size=chunk, dt_softplus=True, initial_states=init,
                       seq_idx=torch.tensor(ROWS), return_final_states=True, backend=backend)
        torch.testing.assert_close(y, y_exp, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(final, final_exp, rtol=1e-9, atol=1e-9)


def test_scan_matrix_reads_reused_ids_as_new_segments():
    _, dt, A, B, C = _inputs()
    reused = scan_matrix(dt.softmax(-1), A, B, C, seq_idx=torch.tensor(ROWS))
    assert reused[0, :, 12, 2].eq(0).all()          # token 12 (third segment) never reads token 2 (first)
    torch.testing.assert_close(reused, scan_matrix(dt.softmax(-1), A, B, C, seq_idx=_renumbered(ROWS)))


def test_normalize_seq_idx():
    assert normalize_seq_idx(torch.tensor([[0, 0, 1, 1, 0, 0]])).tolist() == [[0, 0, 1, 1, 2, 2]]
    assert normalize_seq_idx(torch.tensor([[5], [9]])).tolist() == [[0], [0]]
    assert normalize_seq_idx(torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4)


def test_every_backend_receives_normalised_ids():
    """Normalised once at the op's entry: whichever backend runs (mamba_ssm and triton included) sees
    equal ids <=> the same segment."""
    x, dt, A, B, C = _inputs()
    seen = {}

    def fake_resolve(op, backend, device, args):
        seen[op] = args.seq_idx
        return lambda a: None

    for name, op in (("ssd", ssd), ("quasiseparable", quasiseparable), ("directional_scan", directional_scan)):
        with mock.patch(f"mixer_plugins.kernels.{name}.resolve_backend", fake_resolve):
            op(x, dt, A, B, C, seq_idx=torch.tensor(ROWS))
        assert seen[name].tolist() == normalize_seq_idx(torch.tensor(ROWS)).tolist()
        assert seen[name].tolist()[0] == [0] * 5 + [1] * 6 + [2] * 7 + [3] * 5


@pytest.mark.parametrize("bad", [torch.zeros(2, LENGTH), torch.zeros(2, LENGTH - 1, dtype=torch.long),
                                 torch.zeros(2, LENGTH, dtype=torch.long, device="meta"), [[0] * LENGTH] * 2])
def test_seq_idx_is_validated(bad):
    x, dt, A, B, C = _inputs()
    for op in (ssd, quasiseparable, directional_scan):
        with pytest.raises(MixerInputError, match="seq_idx"):
            op(x, dt, A, B, C, seq_idx=bad)
