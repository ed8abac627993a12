"""FXFUSE_DEBUG_DIR dumps: per compiled graph a JSON + text report, the graph before and after, and a
DOT drawing of the neighbourhood of each unmatched candidate."""
from __future__ import annotations

import os

import torch.fx as fx

from .report import Report


def dump_report(folder: str, stem: str, report: Report, before_code: str, gm: fx.GraphModule) -> None:
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, stem)
    with open(base + ".json", "w") as f:
        f.write(report.to_json())
    with open(base + ".txt", "w") as f:
        f.write(str(report) + "\n")
    with open(base + ".before.py", "w") as f:
        f.write(before_code)
    with open(base + ".after.py", "w") as f:
        f.write(gm.code)
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, site in enumerate(report.unmatched):
        anchor = nodes.get(site.nodes[0]) if site.nodes else None
        if anchor is not None:
            with open(f"{base}.unmatched{i}.dot", "w") as f:
                f.write(neighbourhood_dot(anchor, site.reason))


def neighbourhood_dot(anchor: fx.Node, title: str, depth: int = 6) -> str:
    """DOT drawing of the nodes up to depth hops upstream of anchor, plus each one's outside users."""
    seen, frontier = {anchor}, [anchor]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
    esc = lambda s: str(s).replace('"', "'")  # noqa: E731
    lines = ["digraph candidate {", f'  label="{esc(title)}"; labelloc=t; node [shape=box, fontsize=10];']
    for n in seen:
        style = ', style=filled, fillcolor="#ffd0d0"' if n is anchor else ""
        lines.append(f'  "{n.name}" [label="{n.name}\\n{esc(n.target)}"{style}];')
        for u in n.users:
            if u not in seen:
                lines.append(f'  "{u.name}" [label="{u.name} (outside)", style=dashed];')
            lines.append(f'  "{n.name}" -> "{u.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"
