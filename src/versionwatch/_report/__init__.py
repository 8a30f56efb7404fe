"""The report as data, and every rendering of it: the lowest layer, importing nothing else of ours.

It owns the result of a prediction (``Hazard``, ``Report``, ``Site``, ...), its JSON
document (schema ``versionwatch.report/1``), its text and Graphviz renderings, the
fix written as advice, the user's source lines a report quotes, and the exceptions
and warnings that carry a report. Loading the folder registers the renderers and
the JSON builders with the model, so a report made or unpickled anywhere renders.
"""

from versionwatch._report import document as document
from versionwatch._report import text as text
