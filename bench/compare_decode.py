#!/usr/bin/env python3
"""Side-by-side table of flashattn_decode_bench's JSON and peers_decode.py's JSON (same GPU, same run):
K/V TB/s of ours (contiguous, paged) against the streaming-read bandwidth and against torch SDPA cuDNN,
with the issue's targets: >= 90% of streaming read, >= 1.0x cuDNN, paged within 5% of contiguous.
Two streaming rates of the same run are shown. "vs sum" is the issue's yardstick, "a sum over 2 GiB" (torch.sum in
peers_decode.py, the faster of fp32 and bf16 data; about 4.25 TB/s on the H200 of ../shared/anchors): the verdict's
read target. "vs read" is against flashattn_decode_bench's own read-only kernel over 4 GiB (16-byte loads), which
reads 4-5% faster than the sum on the H200: a stricter yardstick, reported beside it (the last line counts the points
at >= 90% of it). Peers files without "sum_read_tbs" (before 2026-12-03 23:30 UTC) are judged against ours.
"floor" is the same bytes read by a read-only kernel launched like the calls, as a fraction of the verdict's
streaming rate: the most any kernel reading them could show there. "lay p/c" is the layout floor's
paged / contiguous speed: a read-only kernel that reads each sequence's K/V head rows in the cache's own layout
(through the shuffled block table when paged), best of its split counts; where it is below 0.95 itself, the
scattered blocks alone cost a reader of these bytes more than the paged target allows ("paged*").

  python3 bench/compare_decode.py ours.json peers.json [more_peers.json ...]

With several rounds in ours (flashattn_decode_bench --rounds N) or several peers files, each cell is the median
of its measurements (kv_tbs, and the read floor's time).
  python3 bench/compare_decode.py --sweep sweep.json [more.json ...]

The table takes ours' library points at the heuristic's split count (runner "lib", splits_asked 0); a
"paged-seq" layout (block ids in order) is shown beside the shuffled one when present. --sweep prints one
compact line per (layout, B, S, runner, pdl) of a tuning sweep (flashattn_decode_tiles --splits /
--runners / --pdl): K/V TB/s per split count asked (0 = heuristic, whose count is in brackets),
the best marked with '*'; then per (layout, B, S) the five fastest configurations.
"""
import json
import statistics
import sys


def sweep(paths):
    points = []
    for path in paths:
        try:
            points += [p for p in json.load(open(path))["points"] if p.get("kv_tbs", -1) > 0]
        except (OSError, ValueError) as e:
            print(f"({path}: {e})")
    curves, shapes = {}, {}
    for p in points:
        key = (p["layout"], p["batch"], p["cache"], p.get("runner", "lib"), p.get("pdl", -1))
        curves.setdefault(key, []).append(p)
        shapes.setdefault(key[:3], []).append(p)
    for key, ps in sorted(curves.items()):
        if len(ps) < 2:
            continue
        best = max(p["kv_tbs"] for p in ps)
        cells = []
        for p in sorted(ps, key=lambda p: p.get("splits_asked", 0)):
            asked = p.get("splits_asked", 0)
            label = f"h{p['splits']}" if asked == 0 else str(asked)
            cells.append(f"{label}:{p['kv_tbs']:.2f}{'*' if p['kv_tbs'] == best else ''}")
        layout, b, s, runner, pd = key
        print(f"{layout[:6]:6s} B{b} S{s} {runner} pd{pd}| " + " ".join(cells))
    for p in points:  # a variant whose output is not the library's (rel. L2 > 1e-2; -2: the call failed)
        c = p.get("check_rel_l2", -1)
        if c > 1e-2 or c < -1.5:
            print(f"CHECK FAIL {p['layout']} B{p['batch']} S{p['cache']} {p.get('runner')} s{p['splits']}: {c}")
    for (layout, b, s), ps in sorted(shapes.items()):
        top = sorted(ps, key=lambda p: -p["kv_tbs"])[:5]
        print(f"TOP {layout[:6]:6s} B{b} S{s}| " + " ".join(
            f"{p.get('runner', 'lib')}/s{p['splits']}/pd{p.get('pdl', -1)}:{p['kv_tbs']:.2f}"
            f"({p['us_per_call']:.1f}us)" for p in top))


def main():
    if sys.argv[1] == "--sweep":
        return sweep(sys.argv[2:])
    ours = json.load(open(sys.argv[1]))
    peer_files = [json.load(open(path)) for path in sys.argv[2:]] or [{"points": [], "env": {}}]
    peers = {"env": peer_files[0].get("env", {}), "points": [p for f in peer_files for p in f["points"]]}
    cfg = ours["config"]
    hq, hk = cfg["heads_q"], cfg["heads_k"]
    read = ours["stream_read_tbs"]  # ours: the read-only kernel over 4 GiB (the stricter rate)
    sum_read = peers["env"].get("sum_read_tbs")  # the yardstick: a sum over 2 GiB (peers_decode.py)
    target_read = sum_read or read  # the verdict's streaming rate
    print(f"{ours['gpu']}: streaming read {read:.2f} TB/s (ours, 4 GiB) / "
          + (f"{sum_read:.2f} (torch sum over 2 GiB, the issue's yardstick: "
             + ", ".join(f"{k} {v:.2f}" for k, v in peers["env"].get("sum_read_by_dtype", {}).items()) + ")"
             if sum_read else f"{peers['env'].get('stream_read_tbs', 0):.2f} (torch sum over 4 GiB, files before the 2 GiB sum)")
          + f"; Hq={hq} Hk={hk} D={cfg['dim']} page {cfg['page']}")
    print(f"read target: 90% of {target_read:.2f} TB/s ({'the 2 GiB sum' if sum_read else 'ours'})")

    def peer(backend, b, s, heads_k):
        found = [p["kv_tbs"] for p in peers["points"]
                 if (p.get("backend"), p.get("batch"), p.get("cache"), p.get("heads_q"), p.get("heads_k")) ==
                 (backend, b, s, hq, heads_k) and p.get("kv_tbs")]
        return statistics.median(found) if found else None

    rounds = {}
    for p in ours["points"]:
        if p.get("runner", "lib") != "lib" or p.get("splits_asked", 0) != 0:
            continue
        rounds.setdefault((p["batch"], p["cache"], p["layout"]), []).append(p)
    table = {}
    for (b, s, layout), ps in rounds.items():  # the median round (kv_tbs), with the median read floor
        timed = [p for p in ps if p.get("kv_tbs", -1) > 0]
        if not timed:
            table.setdefault((b, s), {})[layout] = ps[0]
            continue
        med = dict(sorted(timed, key=lambda p: p["kv_tbs"])[len(timed) // 2])
        med["kv_tbs"] = statistics.median(p["kv_tbs"] for p in timed)
        for key in ("us_read_floor", "us_layout_floor"):
            floors = [p[key] for p in timed if p.get(key, -1) > 0]
            if floors:
                med[key] = statistics.median(floors)
        med["rounds"] = len(timed)
        table.setdefault((b, s), {})[layout] = med
    print(f"{'B':>5} {'S':>7} | {'contig':>7} {'paged':>7} {'p/c':>6} {'vs sum':>6} {'vs read':>7} | {'cuDNN':>7} {'ours/cuDNN':>10} "
          f"| {'cuDNN MHA':>9} {'FA2':>6} | {'floor':>6} {'lay p/c':>7} | verdict")
    misses = beyond_floor = paged_beyond_floor = strict_ok = timed_points = 0
    for (b, s), row in sorted(table.items()):
        c, pg, seq = row.get("contiguous", {}), row.get("paged", {}), row.get("paged-seq", {})
        ct, pt = c.get("kv_tbs", -1), pg.get("kv_tbs", -1)
        if ct is None or ct <= 0:
            errors = [e for e in dict.fromkeys((c.get('error', ''), pg.get('error', ''))) if e]  # once when both say the same
            print(f"{b:5d} {s:7d} | {'; '.join(errors)}")
            continue
        cudnn = peer("cudnn", b, s, hk)
        cudnn_mha = peer("cudnn", b, s, hq)
        fa2 = peer("flash", b, s, hk)
        # floor: the same bytes read by a read-only kernel launched alike (decode_bench.cu, time_read_floor), as
        # a fraction of the verdict's streaming rate; where it is below 90% itself, no kernel can reach the read target.
        floor_us = c.get("us_read_floor", -1)
        floor = (c["kv_bytes"] / (floor_us * 1e-6) / 1e12) / target_read if floor_us and floor_us > 0 else None
        floor_cell = f"{floor:6.1%}" if floor else "     -"
        # The layout floor (decode_bench.cu, time_layout_floor): paged / contiguous speed of a read-only kernel that
        # reads the cache as attention must, in each layout.
        lay_c, lay_p = c.get("us_layout_floor", -1), pg.get("us_layout_floor", -1)
        lay = lay_c / lay_p if lay_c and lay_c > 0 and lay_p and lay_p > 0 else None
        lay_cell = f"{lay:7.3f}" if lay else "      -"
        ok_read = ct >= 0.9 * target_read
        strict_ok += ct >= 0.9 * read
        timed_points += 1
        ok_peer = cudnn is None or ct >= cudnn
        ok_paged = pt <= 0 or pt >= 0.95 * ct
        read_name = "read*" if floor is not None and floor < 0.9 else "read"
        paged_name = "paged*" if lay is not None and lay < 0.95 else "paged"
        verdict = "ok" if ok_read and ok_peer and ok_paged else "MISS(" + ",".join(
            n for n, ok in ((read_name, ok_read), ("cudnn", ok_peer), (paged_name, ok_paged)) if not ok) + ")"
        misses += verdict != "ok"
        beyond_floor += not ok_read and read_name == "read*"
        paged_beyond_floor += not ok_paged and paged_name == "paged*"
        fmt = lambda x: f"{x:7.3f}" if x else "      -"
        print(f"{b:5d} {s:7d} | {ct:7.3f} {pt:7.3f} {pt / ct:6.3f} {ct / target_read:6.1%} {ct / read:7.1%} | {fmt(cudnn)} "
              f"{(ct / cudnn if cudnn else 0):10.2f} | {fmt(cudnn_mha):>9} {fmt(fa2)[1:]} | {floor_cell} {lay_cell} | {verdict}"
              + (f" (paged in order {seq['kv_tbs'] / ct:.3f})" if seq.get("kv_tbs", -1) > 0 else ""))
    print(f"{misses} point(s) miss a target; read*: {beyond_floor} of them miss the read target where the same bytes, "
          "read by a read-only kernel launched alike, stay below 90% of the streaming rate themselves (floor); "
          f"paged*: {paged_beyond_floor} miss the paged target where a read-only kernel in the cache's layout is itself "
          "more than 5% slower paged (lay p/c)")
    print(f"against ours ({read:.2f} TB/s, the stricter rate): {strict_ok} of {timed_points} points read at >= 90%")


if __name__ == "__main__":
    main()
