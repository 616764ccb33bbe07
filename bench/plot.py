"""Plots of benchmark JSON files (bench/results/, schema of MEASURE.md) as standalone SVG, with no
plotting library (the GPU machine and CI install none):

    python3 bench/plot.py bars  RESULT.json [--phase fwd+bwd] --out bench/plots/NAME.svg
        useful TFLOP/s per GPU of every implementation, grouped by shape and routing, with the
        dense-matmul ceiling of the run as a line;
    python3 bench/plot.py scaling RESULT.json [RESULT.json ...] --out bench/plots/NAME.svg
        epmoe and torch-native fwd+bwd TFLOP/s per GPU against the EP size, one panel per shape
        (balanced routing); each file contributes the EP sizes it holds.
    python3 bench/plot.py decode RESULT.json [--graph-only] --out bench/plots/NAME.svg
        the decode forward (phase decode-fwd) of every implementation as % of the HBM roofline for
        the bytes it reads, grouped by shape and routing; bars of rows with a ratio to bf16
        (NVFP4, MXFP8) carry it as "x bf16" (their time against the bf16 row of the same run).
"""
import argparse
import json
import os
from html import escape

PALETTE = {"epmoe": "#1f6feb", "epmoe-unfused": "#79a8f7", "epmoe-staged": "#79a8f7", "epmoe-gated": "#93c5fd",
           "torch-native": "#d97706", "torch._grouped_mm": "#6b7280"}
OTHER = ["#059669", "#9333ea", "#dc2626", "#0891b2"]


def load(paths):
    return [json.load(open(p)) for p in paths]


def color(impl, seen):
    if impl in PALETTE:
        return PALETTE[impl]
    seen.setdefault(impl, OTHER[len(seen) % len(OTHER)])
    return seen[impl]


class Svg:
    def __init__(self, w, h):
        self.w, self.h, self.items = w, h, []

    def rect(self, x, y, w, h, fill):
        self.items.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"/>')

    def line(self, x1, y1, x2, y2, stroke="#999", dash=None, width=1):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                          f'stroke="{stroke}" stroke-width="{width}"{d}/>')

    def polyline(self, pts, stroke):
        p = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        self.items.append(f'<polyline points="{p}" fill="none" stroke="{stroke}" stroke-width="2"/>')
        for x, y in pts:
            self.items.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{stroke}"/>')

    def text(self, x, y, s, size=11, anchor="middle", fill="#222", rotate=None):
        r = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
        self.items.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                          f'fill="{fill}" font-family="sans-serif"{r}>{escape(str(s))}</text>')

    def save(self, path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                    f'viewBox="0 0 {self.w} {self.h}">\n<rect width="100%" height="100%" fill="white"/>\n')
            f.write("\n".join(self.items))
            f.write("\n</svg>\n")


def groups_and_impls(rows):
    """The (shape, routing) groups and the implementations of rows, in their first order."""
    groups, impls = [], []
    for r in rows:
        if (r["shape"], r["routing"]) not in groups:
            groups.append((r["shape"], r["routing"]))
        if r["impl"] not in impls:
            impls.append(r["impl"])
    return groups, impls


def grouped_bars(svg, groups, impls, left, gap, bar_w, y0, draw):
    """One bar slot per implementation in each group, draw(x, shape, routing, impl) filling it,
    and the groups' labels and the legend below."""
    group_w = bar_w * len(impls) + gap
    seen = {}
    for g, (shape, routing) in enumerate(groups):
        x = left + gap / 2 + g * group_w
        for i, impl in enumerate(impls):
            draw(x + i * bar_w, shape, routing, impl, color(impl, seen))
        svg.text(x + group_w / 2 - gap / 2, y0 + 14, shape, 10)
        svg.text(x + group_w / 2 - gap / 2, y0 + 27, routing, 10, fill="#666")
    per_row = max(1, int((svg.w - left) // 170))  # legend entries wrap instead of leaving the canvas
    for i, impl in enumerate(impls):
        lx, ly = left + (i % per_row) * 170, y0 + 45 + (i // per_row) * 18
        svg.rect(lx, ly, 12, 12, color(impl, seen))
        svg.text(lx + 16, ly + 10, impl, 11, "start")


def canvas(groups, impls, left, right, bottom, plot_h, bar_w, gap):
    width = left + right + (bar_w * len(impls) + gap) * len(groups)
    legend_rows = -(-len(impls) // max(1, int((width - left) // 170)))
    return Svg(width, plot_h + bottom + 60 + 18 * (legend_rows - 1))


def bars(doc, phase, out):
    rows = [r for r in doc["rows"] if r.get("phase") == phase and r.get("useful_tflops")]
    groups, impls = groups_and_impls(rows)
    value = {(r["shape"], r["routing"], r["impl"]): r["useful_tflops"] for r in rows}
    ceiling = doc.get("ceilings", {}).get("bf16_matmul_tflops")
    top = max([v for v in value.values()] + [ceiling or 0]) * 1.12
    left, right, bottom, plot_h = 60, 20, 70, 300
    bar_w, gap = 22, 56
    svg = canvas(groups, impls, left, right, bottom, plot_h, bar_w, gap)
    y0 = 40 + plot_h

    def y(v):
        return y0 - plot_h * v / top

    ep = sorted({r.get("ep", 1) for r in rows})
    svg.text(svg.w / 2, 20, f"{phase} useful TFLOP/s per GPU · EP {','.join(map(str, ep))} · "
             f"{doc.get('gpu', '')} · {doc.get('sha', '')[:7]}", 13)
    for t in range(0, int(top) + 1, 100):
        svg.line(left, y(t), svg.w - right, y(t), "#eee")
        svg.text(left - 6, y(t) + 4, t, 10, "end")
    if ceiling:
        svg.line(left, y(ceiling), svg.w - right, y(ceiling), "#444", "5,4")
        svg.text(svg.w - right, y(ceiling) - 4, f"dense bf16 matmul {ceiling:.0f}", 10, "end")

    def draw(bx, shape, routing, impl, fill):
        v = value.get((shape, routing, impl))
        if v is not None:
            svg.rect(bx, y(v), bar_w - 2, y0 - y(v), fill)
            svg.text(bx + bar_w / 2, y(v) - 3, f"{v:.0f}", 8)

    grouped_bars(svg, groups, impls, left, gap, bar_w, y0, draw)
    svg.save(out)


def scaling(docs, out):
    points = {}  # (shape, impl) -> {ep: tflops}
    for doc in docs:
        for r in doc["rows"]:
            if r.get("phase") == "fwd+bwd" and r.get("routing") == "balanced" and r.get("useful_tflops") \
                    and r["impl"] in ("epmoe", "torch-native"):
                points.setdefault((r["shape"], r["impl"]), {})[r.get("ep", 1)] = r["useful_tflops"]
    shapes = []
    for shape, _ in points:
        if shape not in shapes:
            shapes.append(shape)
    eps = sorted({e for v in points.values() for e in v})
    top = max(v for p in points.values() for v in p.values()) * 1.15
    pw, ph, pad = 220, 200, 50
    svg = Svg(pad + len(shapes) * (pw + pad), ph + 110)
    svg.text(svg.w / 2, 20, "fwd+bwd useful TFLOP/s per GPU vs EP size (balanced routing)", 13)
    seen = {}
    for s, shape in enumerate(shapes):
        x0, y0 = pad + s * (pw + pad), 40 + ph

        def px(e):
            return x0 + (eps.index(e) + 0.5) * pw / len(eps)

        def py(v):
            return y0 - ph * v / top

        svg.line(x0, y0, x0 + pw, y0, "#888")
        svg.line(x0, y0, x0, y0 - ph, "#888")
        for t in range(0, int(top) + 1, 200):
            svg.text(x0 - 4, py(t) + 4, t, 9, "end")
        for e in eps:
            svg.text(px(e), y0 + 14, f"EP {e}", 10)
        svg.text(x0 + pw / 2, y0 + 32, shape, 11)
        for impl in ("epmoe", "torch-native"):
            p = points.get((shape, impl), {})
            if p:
                svg.polyline([(px(e), py(v)) for e, v in sorted(p.items())], color(impl, seen))
                for e, v in p.items():
                    svg.text(px(e) + 4, py(v) - 6, f"{v:.0f}", 9, "start")
    for i, impl in enumerate(("epmoe", "torch-native")):
        svg.rect(pad + i * 150, ph + 85, 12, 12, color(impl, seen))
        svg.text(pad + i * 150 + 16, ph + 95, impl, 11, "start")
    svg.save(out)


def decode(doc, out, graph_only=False):
    rows = [r for r in doc["rows"] if r.get("phase") == "decode-fwd" and r.get("roofline_fraction")]
    if graph_only:
        rows = [r for r in rows if r["impl"].endswith("-graph")]
    groups, impls = groups_and_impls(rows)
    cell = {(r["shape"], r["routing"], r["impl"]): r for r in rows}
    left, right, bottom, plot_h = 60, 20, 70, 300
    bar_w, gap = 26, 56
    svg = canvas(groups, impls, left, right, bottom, plot_h, bar_w, gap)
    y0, top = 40 + plot_h, 110.0

    def y(v):
        return y0 - plot_h * min(v, top) / top

    svg.text(svg.w / 2, 20, f"decode forward, % of the HBM roofline of the bytes read · "
             f"{doc.get('gpu', '')} · {doc.get('sha', '')[:7]}", 13)
    for t in range(0, 101, 20):
        svg.line(left, y(t), svg.w - right, y(t), "#eee")
        svg.text(left - 6, y(t) + 4, f"{t} %", 10, "end")

    def draw(bx, shape, routing, impl, fill):
        r = cell.get((shape, routing, impl))
        if r is None:
            return
        v = 100.0 * r["roofline_fraction"]
        svg.rect(bx, y(v), bar_w - 2, y0 - y(v), fill)
        svg.text(bx + bar_w / 2, y(v) - 3, f"{v:.0f}", 8)
        if r.get("ratio_to_bf16"):
            svg.text(bx + bar_w / 2, y(v) - 13, f"x{r['ratio_to_bf16']:.2f}", 8, fill="#b91c1c")

    grouped_bars(svg, groups, impls, left, gap, bar_w, y0, draw)
    svg.save(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["bars", "scaling", "decode"])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--phase", default="fwd+bwd")
    ap.add_argument("--graph-only", action="store_true", help="decode: the CUDA-graph rows only")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    docs = load(a.files)
    if a.kind == "bars":
        bars(docs[0], a.phase, a.out)
    elif a.kind == "decode":
        decode(docs[0], a.out, a.graph_only)
    else:
        scaling(docs, a.out)
    print(a.out)


if __name__ == "__main__":
    main()
