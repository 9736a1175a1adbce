#!/usr/bin/env python3
"""Where FoxyVegas's window settles, and why, from a bench/foxyvegas.py results file.

  bench/foxyvegas_equilibrium.py bench/results/foxyvegas-table1.json [--alpha 2 --beta 4]
                                 [--rate KBps] [--skip-s 2]

Vegas holds its window W (segments) where the queue it estimates, diff = W * (rtt - base) / rtt
with rtt the round's smallest sample, lies between alpha and beta. When the path's RTT has a
floor above the all-time smallest sample `base` that is not queueing (a TCG receiver's ACK
latency, host scheduling), that floor alone makes diff reach alpha..beta at

    W* = (alpha..beta) * rtt / (rtt - base)

whatever the link could carry. For every run with FoxyVegas on this prints, from the device's
own log (`--foxyvegas-log`, in the results file): the window it wrote (p10/p50/p90 after the
first --skip-s seconds), its RTT samples (p10/p50) and base, the diff those imply at the p10 and
median RTT, W* for the p10 RTT (the round minimum is near the low samples), and the link's
bandwidth-delay product (--rate, default the run's own bottleneck rate from the results file).
The window is reported in KB (1000 bytes) and segments of 1448 bytes.
"""
import argparse
import json
import statistics

MSS = 1448


def quantile(xs, q):
    """The q-quantile (0..1) of xs, by statistics.quantiles' exclusive method (n=100)."""
    if len(xs) < 2:
        return xs[0]
    return statistics.quantiles(xs, n=100)[max(0, min(98, round(q * 100) - 1))]


def analyse(rep, alpha, beta, rate_kbps, skip_s):
    trace = rep.get("device_window_trace") or []
    samples = rep.get("device_rtt_samples_ms") or []
    if not trace or len(trace) != len(samples) or not rep.get("base_rtt_us"):
        return None
    pairs = [(w, s) for (t, w), s in zip(trace, samples) if t >= skip_s]
    if len(pairs) < 10:
        return None
    windows = [w for w, _ in pairs]
    rtts = [s for _, s in pairs]
    base = rep["base_rtt_us"] / 1000.0
    w50 = statistics.median(windows) / MSS
    r10, r50 = quantile(rtts, 0.10), statistics.median(rtts)
    floor = max(r10 - base, 1e-6)
    return {
        "cc": rep["cc"], "rep": rep["rep"], "kBps": rep["kBps"],
        "window_kb": [round(quantile(windows, q) / 1000) for q in (0.1, 0.5, 0.9)],
        "window_segs_p50": round(w50),
        "rtt_p10_ms": round(r10, 2), "rtt_p50_ms": round(r50, 2), "base_ms": round(base, 2),
        "diff_at_p10": round(w50 * (r10 - base) / r10, 1),
        "diff_at_p50": round(w50 * (r50 - base) / r50, 1),
        "w_star_segs": (round(alpha * r10 / floor), round(beta * r10 / floor)),
        "bdp_segs": round(rate_kbps * 1000 * base / 1000 / MSS),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--alpha", type=float, default=2)
    ap.add_argument("--beta", type=float, default=4)
    ap.add_argument("--rate", type=float, default=None, help="bottleneck KB/s (default: the run's)")
    ap.add_argument("--skip-s", type=float, default=2.0)
    a = ap.parse_args()
    d = json.load(open(a.results))
    rate = a.rate or d.get("params", {}).get("rate")
    if rate is None:
        raise SystemExit("no --rate given and none in the results file's params")
    print(f"# {a.results}: bottleneck {rate:.0f} KB/s, alpha {a.alpha:g}, beta {a.beta:g}")
    print("| sender | rep | KB/s | window KB p10/p50/p90 | W p50 (segs) | device RTT p10 / p50 ms | base ms "
          "| diff at p10 / p50 RTT | W* for the p10 RTT (segs) | BDP (segs) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rep in d["reps"]:
        if rep.get("config") != "on":
            continue
        r = analyse(rep, a.alpha, a.beta, rate, a.skip_s)
        if r is None:
            continue
        print(f"| {r['cc']} | {r['rep']} | {r['kBps']:.0f} | {'/'.join(map(str, r['window_kb']))} | "
              f"{r['window_segs_p50']} | {r['rtt_p10_ms']} / {r['rtt_p50_ms']} | {r['base_ms']} | "
              f"{r['diff_at_p10']} / {r['diff_at_p50']} | {r['w_star_segs'][0]}-{r['w_star_segs'][1]} | "
              f"{r['bdp_segs']} |")


if __name__ == "__main__":
    main()
