#!/usr/bin/env python3
"""Side-by-side table of flashattn_decode_bench's JSON and peers_decode.py's JSON (same GPU, same run):
K/V TB/s of ours (contiguous, paged) against the streaming-read bandwidth and against torch SDPA cuDNN,
with the issue's targets: >= 90% of streaming read, >= 1.0x cuDNN, paged within 5% of contiguous.

  python3 bench/compare_decode.py ours.json peers.json
"""
import json
import sys


def main():
    ours = json.load(open(sys.argv[1]))
    peers = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {"points": [], "env": {}}
    cfg = ours["config"]
    hq, hk = cfg["heads_q"], cfg["heads_k"]
    read = ours["stream_read_tbs"]
    print(f"{ours['gpu']}: streaming read {read:.2f} TB/s (ours) / {peers['env'].get('stream_read_tbs', 0):.2f} "
          f"(torch sum); Hq={hq} Hk={hk} D={cfg['dim']} page {cfg['page']}")

    def peer(backend, b, s, heads_k):
        for p in peers["points"]:
            if (p.get("backend"), p.get("batch"), p.get("cache"), p.get("heads_q"), p.get("heads_k")) == (backend, b, s, hq, heads_k):
                return p.get("kv_tbs")
        return None

    table = {}
    for p in ours["points"]:
        table.setdefault((p["batch"], p["cache"]), {})[p["layout"]] = p
    print(f"{'B':>5} {'S':>7} | {'contig':>7} {'paged':>7} {'p/c':>6} {'vs read':>7} | {'cuDNN':>7} {'ours/cuDNN':>10} "
          f"| {'cuDNN MHA':>9} {'FA2':>6} | verdict")
    misses = 0
    for (b, s), row in sorted(table.items()):
        c, pg = row.get("contiguous", {}), row.get("paged", {})
        ct, pt = c.get("kv_tbs", -1), pg.get("kv_tbs", -1)
        if ct is None or ct <= 0:
            print(f"{b:5d} {s:7d} | {c.get('error', '')}{pg.get('error', '')}")
            continue
        cudnn = peer("cudnn", b, s, hk)
        cudnn_mha = peer("cudnn", b, s, hq)
        fa2 = peer("flash", b, s, hk)
        ok_read = ct >= 0.9 * read
        ok_peer = cudnn is None or ct >= cudnn
        ok_paged = pt <= 0 or pt >= 0.95 * ct
        verdict = "ok" if ok_read and ok_peer and ok_paged else "MISS(" + ",".join(
            n for n, ok in (("read", ok_read), ("cudnn", ok_peer), ("paged", ok_paged)) if not ok) + ")"
        misses += verdict != "ok"
        fmt = lambda x: f"{x:7.3f}" if x else "      -"
        print(f"{b:5d} {s:7d} | {ct:7.3f} {pt:7.3f} {pt / ct:6.3f} {ct / read:6.1%} | {fmt(cudnn)} "
              f"{(ct / cudnn if cudnn else 0):10.2f} | {fmt(cudnn_mha):>9} {fmt(fa2)[1:]} | {verdict}")
    print(f"{misses} point(s) miss a target")


if __name__ == "__main__":
    main()
