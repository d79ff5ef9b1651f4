#!/usr/bin/env python3
# w-tl9: summary of a decode timeline dump (ATTNKIT_EXP_TIMELINE, 24 stamps per CTA):
# 0 start (after griddepcontrol.wait), 1 seq_len, 2 first K (thread 0), 3-6 loop end of warps 0-3,
# 7 after the drain barrier, 8 warp states stored (thread 0), 9 after their barrier, 10 first
# combine item done, 11 partials written, 12 counted, 13 is_last, 14 merge: LSE pass done,
# 15 merge end, 16 smid; 17-22 clock64 at 7-12. Times in us (globaltimer), cycles (clock64).
import sys
import numpy as np

path, label = sys.argv[1], sys.argv[2]
raw = open(path, 'rb').read()
slots, cap, nxt, ns = (int(x) for x in np.frombuffer(raw[:32], dtype=np.int64))
meta_dt = np.dtype([('seq', '<i8'), ('gx', '<i4'), ('gy', '<i4'), ('gz', '<i4'),
                    ('captured', '<i4'), ('splits', '<i4'), ('pdl', '<i4')])
meta = np.frombuffer(raw[32:32 + meta_dt.itemsize * slots], dtype=meta_dt)
data = np.frombuffer(raw[32 + meta_dt.itemsize * slots:], dtype=np.uint64).reshape(slots, cap, ns)
calls = [i for i in range(slots) if meta[i]['captured'] == 1 and meta[i]['seq'] >= 0]
if not calls:
    print(label, 'no captured calls')
    sys.exit(0)
m0 = meta[calls[0]]
ctas = int(m0['gx']) * int(m0['gy']) * int(m0['gz'])
splits = int(m0['splits'])
print(f"== {label}: {len(calls)} captured calls, grid {m0['gx']}x{m0['gy']}x{m0['gz']} = {ctas} CTAs,"
      f" splits {splits}, pdl {m0['pdl']}")
recs = sorted((data[i, :ctas, :].astype(np.int64) for i in calls), key=lambda r: r[:, 0].min())
acc = {}
def add(k, v):
    acc.setdefault(k, []).append(float(v))
for r in recs:
    t0 = r[:, 0].min()
    us = lambda i: (r[:, i] - t0) / 1000.0
    le = np.max([us(i) for i in range(3, 7)], axis=0)
    ls = np.min([us(i) for i in range(3, 7)], axis=0)
    last = r[:, 13] == 1 if splits > 1 else np.zeros(ctas, bool)
    end = np.where(last, us(15), us(12) if splits > 1 else us(11))
    add('seq_len p50 us', np.median(us(1)))
    add('first K p50 us', np.median(us(2)))
    add('loop end p10 us', np.percentile(le, 10))
    add('loop end p50 us', np.median(le))
    add('loop end max us', le.max())
    add('kernel end us', end.max())
    add('warp loop-end spread in a CTA p50 us', np.median(le - ls))
    add('last warp -> drain barrier p50 us', np.median(us(7) - le))
    for a, b, name in [(7, 8, 'drain barrier -> states stored'), (8, 9, 'states stored -> barrier'),
                       (9, 10, 'barrier -> first item done'), (10, 11, 'first item -> partials written'),
                       (11, 12, 'partials written -> counted')]:
        if b == 12 and splits <= 1:
            continue
        add(f'{name} p50 us', np.median(us(b) - us(a)))
        add(f'{name} p50 cycles', np.median(r[:, b + 10] - r[:, a + 10]))
        add(f'{name} max us', np.max(us(b) - us(a)))
    if splits > 1:
        gx = int(m0['gx'])
        grp = np.arange(ctas) // gx  # (row, KV head) of each CTA: x is the split
        gaps, lates, merger_le = [], [], []
        for g_ in np.unique(grp):
            sel = np.where(grp == g_)[0]
            les = np.sort(le[sel])
            T = les[-1]
            gaps.append(T - les[-2])
            i_last = sel[np.argmax(le[sel])]
            others = sel[sel != i_last]
            lates.append(us(12)[others].max() - T)  # last count among the others, after T
            mg = sel[last[sel]]
            if len(mg):
                merger_le.append(1.0 if le[mg[0]] == T else 0.0)
        gaps, lates = np.array(gaps), np.array(lates)
        crit = int(np.argmax([le[grp == g_].max() for g_ in np.unique(grp)]))
        add('groups: last - 2nd loop end p50 us', np.median(gaps))
        add('groups: others counted after last loop end p50 us', np.median(lates))
        add('groups: others counted after last loop end min us', lates.min())
        add('critical group: last - 2nd loop end us', gaps[crit])
        add('critical group: others counted after last loop end us', lates[crit])
        add('groups: merger is the last loop end (share)', np.mean(merger_le) if merger_le else 0)
    if splits > 1 and last.any():
        add('last CTAs: count -> LSE pass done p50 us', np.median(us(14)[last] - us(12)[last]))
        add('last CTAs: LSE pass -> merge end p50 us', np.median(us(15)[last] - us(14)[last]))
        add('last CTA (of the call): its loop end us', le[last].max())
        add('tail: last loop end -> kernel end us', end.max() - le.max())
for k, v in acc.items():
    v = np.array(v)
    print(f"  {k:48s} median {np.median(v):9.3f}  (min {v.min():9.3f} max {v.max():9.3f})")
