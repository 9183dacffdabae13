"""Two workload profiles of one call side by side (issue 29's A/B): `bench/gpu_run.sh ab4` profiles a
baseline engine and this tree's engine one after the other on the same GPU (nanovllm_bench/workload_profile.py,
each in its own process), then

    python -m nanovllm_bench.ab BASE.json NEW.json [--out AB.json]

prints one table (throughput as the bench times it, batch-1, where the time went, the probes) with the ratio
new / base, and writes the pair into AB.json. Only a pair from one call is a comparison: the script refuses two
records whose machines or workloads differ.
"""
import argparse
import json
import sys


def _row(name, a, b, fmt=",.0f", higher_is_better=True):
    if a is None or b is None:
        return f"{name:34s} {'-':>12} {'-':>12}"
    ratio = b / a if a else float("nan")
    better = (ratio > 1) == higher_is_better
    return f"{name:34s} {a:>12{fmt}} {b:>12{fmt}} {ratio:>8.3f}x {'better' if better else 'worse'}"


def compare(base: dict, new: dict) -> list[str]:
    """The table's lines (module docstring). Raises ValueError for records of different workloads or GPUs."""
    for key in ("output_tokens", "prompt_tokens"):
        if base["workload"][key] != new["workload"][key]:
            raise ValueError(f"the two records ran different workloads ({key}: {base['workload'][key]} vs "
                             f"{new['workload'][key]})")
    if base["machine"]["device_name"] != new["machine"]["device_name"]:
        raise ValueError("the two records ran on different devices")
    sb, sn = base["summary"], new["summary"]
    lines = [f"A/B, one call on {new['machine']['device_name']}: base {base['run']} ({base['machine'].get('commit')}) "
             f"vs new {new['run']} ({new['machine'].get('commit')})",
             f"{'':34s} {'base':>12} {'new':>12} {'new/base':>9}",
             _row("throughput, plain generate (tok/s)", base["plain_tok_s"], new["plain_tok_s"]),
             _row("batch-1 (tok/s)", base.get("batch1_tok_s"), new.get("batch1_tok_s")),
             _row("instrumented run (s)", sb["total_s"], sn["total_s"], ".3f", False),
             _row("prefill wall (s)", sb["prefill"]["wall_s"], sn["prefill"]["wall_s"], ".3f", False),
             _row("decode device (s)", sb["decode"]["device_s"], sn["decode"]["device_s"], ".3f", False),
             _row("GPU idle (s)", sb["gpu_idle_s"], sn["gpu_idle_s"], ".3f", False)]
    fb, fn = sb.get("decode_fit"), sn.get("decode_fit")
    if fb and fn:
        lines += [_row("decode fixed cost a step (ms)", fb["fixed_ms"], fn["fixed_ms"], ".3f", False),
                  _row("decode cost a row (us)", 1000 * fb["per_row_ms"], 1000 * fn["per_row_ms"], ".2f", False),
                  _row("decode cost a KV token (ns)", fb["per_kv_token_ns"], fn["per_kv_token_ns"], ".2f", False)]
    probes_b = {(p["rows"], p["context"]): p for p in base.get("probes", [])}
    for p in new.get("probes", []):
        q = probes_b.get((p["rows"], p["context"]))
        if q is not None:
            lines.append(_row(f"probe {p['rows']}:{p['context']} step (ms)", q["step_ms"], p["step_ms"], ".3f", False))
            if q.get("graph_replay_ms") and p.get("graph_replay_ms"):
                lines.append(_row(f"probe {p['rows']}:{p['context']} graph replay (ms)", q["graph_replay_ms"],
                                  p["graph_replay_ms"], ".3f", False))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanovllm_bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with open(args.base) as f:
        base = json.load(f)
    with open(args.new) as f:
        new = json.load(f)
    try:
        lines = compare(base, new)
    except ValueError as exc:
        print(f"not comparable: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(table=lines, base=base, new=new), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
