#!/usr/bin/env python3
"""The card's SM clock and power while one backward point runs for seconds: ours (flashattn_cuda_bench) against
FlashAttention-2 (torch SDPA "flash"), alternating, per dtype. Answers whether a ratio that moves between fp16 and
bf16 follows the clock (a power-capped card lowers its clock more for operands that toggle more bits) or the code.

  python3 bench/clock_probe.py --bench build-gpu/bench/flashattn_cuda_bench --out DIR
                               [--dtypes bf16,f16] [--dim 128] [--seqlen 16384] [--causal 1]
                               [--seconds 8] [--rounds 2]

B = 16384 / S, H = 2048 / D (the standard sweep's shape). nvidia-smi samples every 100 ms; each phase keeps the
samples after its first second (the clock settles). Per phase: backward TFLOP/s (median of the timed calls),
SM clock and power (medians), and the share of samples whose clock-event reasons include the software power
cap (bit 0x4). Writes DIR/clock_probe.json and DIR/clocks.csv; prints the table last.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


def fa2_backward(dtype_name, d, s, causal, seconds):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
    b, h = 16384 // s, 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        times, start_wall = [], time.time()
        while time.time() - start_wall < seconds:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    flops = 2.5 * 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return flops / (statistics.median(times) * 1e-3) / 1e12


def ours_backward(bench, out_dir, tag, dtype_name, d, s, causal, seconds):
    b, h = 16384 // s, 2048 // d
    flops = 2.5 * 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    reps = max(10, int(seconds / (flops / 300e12)))  # ~`seconds` at 300 TFLOP/s
    path = os.path.join(out_dir, f"{tag}.json")
    subprocess.run([bench, "--json", path, "--dtypes", dtype_name, "--dims", str(d), "--seqlens", str(s),
                    "--causal", str(int(causal)), "--reps", str(reps), "--fwd-reps", "3"],
                   check=True, stdout=subprocess.DEVNULL)
    return json.load(open(path))["points"][0]["bwd_tflops"]


def read_samples(path):
    rows = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        if len(f) < 5:
            continue
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(f[1]), float(f[2]), float(f[3]), int(f[4], 16)))
        except ValueError:
            continue
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    csv = os.path.join(args.out, "clocks.csv")
    reasons = "clocks_event_reasons.active"
    if subprocess.run(["nvidia-smi", f"--query-gpu={reasons}", "--format=csv,noheader"],
                      capture_output=True).returncode != 0:
        reasons = "clocks_throttle_reasons.active"
    logger = subprocess.Popen(["nvidia-smi", f"--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,{reasons}",
                               "--format=csv,noheader,nounits", "-lms", "100"], stdout=open(csv, "w"),
                              stderr=subprocess.DEVNULL)
    phases = []
    try:
        for r in range(args.rounds):
            for dtype_name in args.dtypes.split(","):
                for who in ("ours", "fa2"):
                    begin = time.time()
                    if who == "ours":
                        tflops = ours_backward(args.bench, args.out, f"round-{r}-{dtype_name}", dtype_name, args.dim,
                                               args.seqlen, bool(args.causal), args.seconds)
                    else:
                        tflops = fa2_backward(dtype_name, args.dim, args.seqlen, bool(args.causal), args.seconds)
                    phases.append({"round": r, "who": who, "dtype": dtype_name, "begin": begin, "end": time.time(),
                                   "bwd_tflops": round(tflops, 1)})
                    print(json.dumps(phases[-1]), flush=True)
    finally:
        time.sleep(0.3)
        logger.terminate()
        logger.wait()
    samples = read_samples(csv)
    print(f"D = {args.dim}, S = {args.seqlen}, causal = {bool(args.causal)}, {args.seconds} s per phase, "
          f"{len(samples)} nvidia-smi samples")
    print(f"{'round':>5} {'who':>4} {'dtype':>5} | {'bwd TF/s':>8} | {'SM MHz':>6} {'power W':>7} {'temp C':>6} "
          f"{'power-capped':>12} {'n':>4}")
    for p in phases:
        inside = [x for x in samples if p["begin"] + 1.0 <= x[0] <= p["end"]]
        if inside:
            p["sm_mhz"] = statistics.median(x[1] for x in inside)
            p["power_w"] = statistics.median(x[2] for x in inside)
            p["temp_c"] = statistics.median(x[3] for x in inside)
            p["power_capped"] = sum(1 for x in inside if x[4] & POWER_CAP) / len(inside)
        p["samples"] = len(inside)
        print(f"{p['round']:>5} {p['who']:>4} {p['dtype']:>5} | {p['bwd_tflops']:>8.1f} | {p.get('sm_mhz', 0):>6.0f} "
              f"{p.get('power_w', 0):>7.1f} {p.get('temp_c', 0):>6.0f} {100 * p.get('power_capped', 0):>11.0f}% "
              f"{p['samples']:>4}")
    json.dump({"args": vars(args), "phases": phases}, open(os.path.join(args.out, "clock_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
