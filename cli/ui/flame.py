"""Sampled stacks as files: collapsed text, speedscope JSON, or a self-contained SVG flamegraph.

Stacks are ``[["root;child;leaf", count], ...]`` (root first), as ``GET /profile`` answers
and as ``py-spy record --format raw`` writes them. The page draws the same data in
JavaScript; these writers are for ``probe PID profile -o FILE``.
"""

from __future__ import annotations

import html
import json

from probe.util.printable import stack_text

__all__ = ["to_collapsed", "to_speedscope", "to_svg", "FORMATS"]

FORMATS = ("collapsed", "speedscope", "svg")


def to_collapsed(stacks: list) -> str:
    """One ``stack count`` line per stack.

    >>> to_collapsed([["a;b", 2]])
    'a;b 2\\n'
    """
    return "".join(f"{stack_text(s)} {int(n)}\n" for s, n in stacks)


def to_speedscope(stacks: list, name: str) -> str:
    """A speedscope 'sampled' profile: one sample per distinct stack, weighted by its count."""
    frames: dict[str, int] = {}
    samples, weights = [], []
    for stack, n in stacks:
        samples.append([frames.setdefault(f, len(frames)) for f in stack.split(";")])
        weights.append(n)
    total = sum(weights)
    return json.dumps(
        {
            "$schema": "https://www.speedscope.app/file-format-schema.json",
            "name": name,
            "exporter": "probe",
            "shared": {"frames": [{"name": f} for f in frames]},
            "profiles": [
                {
                    "type": "sampled",
                    "name": name,
                    "unit": "none",
                    "startValue": 0,
                    "endValue": total,
                    "samples": samples,
                    "weights": weights,
                }
            ],
        }
    )


def _tree(stacks: list) -> dict:
    root = {"name": "all", "value": 0, "children": {}}
    for stack, n in stacks:
        node = root
        root["value"] += n
        for f in stack.split(";"):
            node = node["children"].setdefault(f, {"name": f, "value": 0, "children": {}})
            node["value"] += n
    return root


def _color(name: str) -> str:
    h = 0
    for ch in name:
        h = (h * 31 + ord(ch)) & 0xFFFF
    if name.startswith("thread ") or name.startswith("rank "):
        return "rgb(190,190,200)"
    return f"rgb({205 + h % 50},{90 + (h >> 4) % 110},{40 + (h >> 8) % 40})"


def to_svg(stacks: list, title: str, width: int = 1200, row: int = 17) -> str:
    """A static flamegraph (root at the bottom), each box titled with its samples and share."""
    root = _tree(stacks)
    total = root["value"] or 1
    boxes = []
    depth_max = 0

    def walk(node, x, depth):
        nonlocal depth_max
        depth_max = max(depth_max, depth)
        boxes.append((node, x, depth))
        for child in sorted(node["children"].values(), key=lambda c: c["name"]):
            walk(child, x, depth + 1)
            x += child["value"]

    walk(root, 0, 0)
    height = (depth_max + 1) * row + 40
    scale = (width - 20) / total
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="monospace" font-size="11">',
        f'<text x="10" y="18" font-size="14">{html.escape(title)}</text>',
    ]
    for node, x, depth in boxes:
        w = node["value"] * scale
        if w < 0.5:
            continue
        y = height - (depth + 1) * row
        share = 100.0 * node["value"] / total
        label = html.escape(node["name"])
        out.append(
            f"<g><title>{label} ({node['value']} samples, {share:.1f}%)</title>"
            f'<rect x="{10 + x * scale:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
            f'fill="{_color(node["name"])}" rx="2"/>'
        )
        chars = int(w / 7)
        if chars >= 3:
            text = node["name"] if len(node["name"]) <= chars else node["name"][: chars - 2] + ".."
            out.append(f'<text x="{12 + x * scale:.1f}" y="{y + row - 5}">{html.escape(text)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
