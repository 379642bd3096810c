#!/usr/bin/env python3
"""Draws a Chrome trace (fsdp_plan --trace) as an SVG timeline: one row per
stream, each op a box coloured by what it is (matmul and attention, other
kernels, all-gather, reduce-scatter, all-reduce). For docs/planning.md's
picture; Perfetto (ui.perfetto.dev) opens the trace itself.

  scripts/trace_to_svg.py trace.json picture.svg [--width 1200]
"""
import argparse
import json


def colour(event):
    name = event["name"]
    if event.get("cat") == "communication":
        if name.startswith("all_gather"):
            return "#4c78a8"
        if name.startswith("reduce_scatter"):
            return "#f58518"
        return "#54a24b"
    if event["args"].get("flops", 0) > 0:
        return "#b279a2"
    return "#bab0ac"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("svg")
    parser.add_argument("--width", type=int, default=1200)
    args = parser.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    ops = [e for e in events if e.get("ph") == "X"]
    used = sorted({e["tid"] for e in ops})
    end = max(e["ts"] + e["dur"] for e in ops)
    label, row_height, top = 190, 26, 30
    scale = (args.width - label - 10) / end
    height = top + row_height * len(used) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{args.width}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{args.width}" height="{height}" fill="white"/>',
           f'<text x="10" y="18">simulated step: {end / 1000:.1f} ms</text>']
    for i, tid in enumerate(used):
        y = top + i * row_height
        out.append(f'<text x="10" y="{y + 16}">{rows.get(tid, tid)}</text>')
        # Ops closer than half a pixel in one colour are drawn as one box.
        boxes = []
        for e in sorted((e for e in ops if e["tid"] == tid), key=lambda e: e["ts"]):
            x0, x1, fill = e["ts"] * scale, (e["ts"] + e["dur"]) * scale, colour(e)
            if boxes and boxes[-1][2] == fill and x0 - boxes[-1][1] < 0.5:
                boxes[-1][1] = max(boxes[-1][1], x1)
            else:
                boxes.append([x0, x1, fill])
        for x0, x1, fill in boxes:
            out.append(f'<rect x="{label + x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 0.5):.1f}" '
                       f'height="{row_height - 6}" fill="{fill}"/>')
    legend = [("matmul / attention", "#b279a2"), ("other kernels", "#bab0ac"), ("all-gather", "#4c78a8"),
              ("reduce-scatter", "#f58518"), ("all-reduce", "#54a24b")]
    y = top + row_height * len(used) + 15
    for j, (text, fill) in enumerate(legend):
        x = label + j * 170
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{fill}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 11}">{text}</text>')
    out.append("</svg>")
    with open(args.svg, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
