"""matplotlib to inline SVG, shared by the HTML report (:mod:`gpuguard.reports.charts`)
and the HTML job page (:mod:`gpuguard.epilog.jobpage_html`).

matplotlib is imported on first use with the Agg backend (no display on nodes or login
hosts). :func:`style` puts text into the SVG as ``<text>`` elements (``svg.fonttype =
none``), escaped by matplotlib's XML writer, with mathtext off (``text.parse_math =
False``) so a ``$`` in a user's account or job name is drawn as it is; a fixed hash salt
and no ``<metadata>`` date make the same data give the same file.
"""

from __future__ import annotations

import io
import re
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style() -> Any:
    """The rc context every gpuguard chart is drawn in (a context manager)."""
    import matplotlib

    return matplotlib.rc_context({"svg.fonttype": "none", "text.parse_math": False, "svg.hashsalt": "gpuguard",
                                  "font.size": 9})


def render_svg(fig: Any) -> str:
    """``fig`` as an ``<svg>`` element (no XML prolog, no metadata block); closes ``fig``."""
    plt = pyplot()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)  # matplotlib's RDF block: not needed
    return text[text.index("<svg"):]
