""":func:`gpuguard.samples.read_buckets`' grouped rows into its :class:`gpuguard.samples.Buckets`.

The grouped SQL pass gives one row per (bucket, clock-event mask), in bucket order:
``(bucket, mask, count, min t_ms, max t_ms, sum t_ms, sums..., maxes..., counts...)``
(sums and counts per value metric, maxes per metric whose maximum is read). A bucket
whose samples all share one mask (the usual case) is one row, and the rows are then
transposed column by column; otherwise a bucket's rows are merged one by one.
"""

from __future__ import annotations

from typing import Any


def fill_rows(out: Any, rows: list[tuple], names: list[str], maxed: list[str]) -> None:
    """:func:`gpuguard.samples.read_buckets`' lists from its grouped rows ``(bucket, mask, count, min t,
    max t, sum t, sums..., maxes..., counts...)`` in bucket order, a bucket's rows (one
    per clock-event mask) merged into one entry."""
    n_sum, n_max = len(names), len(maxed)
    sums = [out.sums[n] for n in names]
    maxes = [out.maxes[n] for n in maxed]
    counts = [out.counts[n] for n in names]
    bits = list(out.bits.values())
    bit_values = list(out.bits)
    last = None
    for r in rows:
        mask, c = r[1], r[2]
        if r[0] != last:
            last = r[0]
            out.n.append(c)
            out.t_min.append(r[3])
            out.t_max.append(r[4])
            out.t_sum.append(r[5])
            for i in range(n_sum):
                sums[i].append(r[6 + i])
                counts[i].append(r[6 + n_sum + n_max + i])
            for i in range(n_max):
                maxes[i].append(r[6 + n_sum + i])
            for lst, bit in zip(bits, bit_values, strict=True):
                lst.append(c if mask and mask & bit else 0)
            continue
        out.n[-1] += c
        out.t_min[-1] = min(out.t_min[-1], r[3])
        out.t_max[-1] = max(out.t_max[-1], r[4])
        out.t_sum[-1] += r[5]
        for i in range(n_sum):
            v = r[6 + i]
            if v is not None:
                sums[i][-1] = v if sums[i][-1] is None else sums[i][-1] + v
            counts[i][-1] += r[6 + n_sum + n_max + i]
        for i in range(n_max):
            v = r[6 + n_sum + i]
            if v is not None and (maxes[i][-1] is None or v > maxes[i][-1]):
                maxes[i][-1] = v
        if mask:
            for lst, bit in zip(bits, bit_values, strict=True):
                if mask & bit:
                    lst[-1] += c


def fill_columns(out: Any, rows: list[tuple], names: list[str], maxed: list[str]) -> None:
    """:func:`fill_rows` when every bucket is one row (one clock-event mask): the same
    values, transposed column by column."""
    if not rows:
        return
    cols = list(zip(*rows, strict=True))
    n_sum, n_max = len(names), len(maxed)
    masks, cnt = cols[1], cols[2]
    out.n, out.t_min, out.t_max, out.t_sum = list(cnt), list(cols[3]), list(cols[4]), list(cols[5])
    for i, name in enumerate(names):
        out.sums[name] = list(cols[6 + i])
        out.counts[name] = list(cols[6 + n_sum + n_max + i])
    for i, name in enumerate(maxed):
        out.maxes[name] = list(cols[6 + n_sum + i])
    for bit in out.bits:
        out.bits[bit] = [c if m and m & bit else 0 for m, c in zip(masks, cnt, strict=True)]
