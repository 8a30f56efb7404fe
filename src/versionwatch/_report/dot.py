"""Graphviz pictures of a report: root -> ... -> saving node -> stale tensor <- events."""

from __future__ import annotations

from versionwatch._report.model import Report, register_renderer


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def report_to_dot(report: Report) -> str:
    lines = [
        "digraph versionwatch {",
        "  rankdir=TB;",
        '  node [shape=box, fontname="Helvetica", fontsize=10];',
    ]
    edges: set[tuple[str, str]] = set()
    declared: set[str] = set()

    def node(ident: str, attrs: str) -> None:
        if ident not in declared:
            declared.add(ident)
            lines.append(f"  {_q(ident)} [{attrs}];")

    def edge(a: str, b: str, attrs: str = "") -> None:
        if (a, b) not in edges:
            edges.add((a, b))
            lines.append(f"  {_q(a)} -> {_q(b)}{' [' + attrs + ']' if attrs else ''};")

    node("backward", 'label="backward()", shape=oval')
    for k, h in enumerate(report.hazards):
        prev = "backward"
        path = h.path or [h.node]
        for depth, name in enumerate(path):
            ident = f"{name}@{depth}"
            last = depth == len(path) - 1
            color = ', color=red, fontcolor=red, penwidth=2' if last else ""
            node(ident, f"label={_q(name)}{color}")
            edge(prev, ident)
            prev = ident
        versions = ""
        if h.saved_version is not None:
            versions = f"\\nsaved at version {h.saved_version}, now {h.current_version}"
        tensor = f"tensor{k}"
        label = f"{h.tensor or h.describe_tensor()}{versions}\\n({h.kind})"
        node(tensor, f'label={_q(label).replace(chr(92) * 2 + "n", chr(92) + "n")}, '
                     'shape=note, color=red')
        edge(prev, tensor, f"label={_q(h.slot)}, style=dashed")
        for j, m in enumerate(h.modified_by):
            ev = f"event{k}.{j}"
            node(ev, f"label={_q(str(m))}, shape=cds, color=orange")
            edge(ev, tensor, 'label="modified", color=orange')
    lines.append("}")
    return "\n".join(lines) + "\n"


register_renderer("dot", report_to_dot)
