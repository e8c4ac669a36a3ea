"""Glued tables are numbered as tables.

A ``glue:figure`` of a glued HTML table is a figure to Sphinx, captioned "Fig. N" and counted with the plots.
This extension turns every figure whose body is a table into a ``table_figure``, which Sphinx numbers as a
table: captioned "Table N", counted apart from the figures, and named "Table N" by ``{numref}``.
"""

from docutils import nodes
from sphinx.transforms import SphinxTransform


class table_figure(nodes.figure):
    """A figure whose body is a table."""


def _holds_table(figure: nodes.figure) -> bool:
    for node in figure.findall(lambda n: isinstance(n, (nodes.table, nodes.raw))):
        if isinstance(node, nodes.table) or "<table" in node.astext():
            return True
    return False


class TableFigures(SphinxTransform):
    default_priority = 500

    def apply(self) -> None:
        for figure in list(self.document.findall(nodes.figure)):
            if type(figure) is nodes.figure and _holds_table(figure):
                table = table_figure(figure.rawsource, *figure.children, **figure.attributes)
                figure.replace_self(table)
                for node_id in table["ids"]:  # what a label resolves to
                    self.document.ids[node_id] = table


def _caption(node) -> str:
    return next((child.astext() for child in node.children if isinstance(child, nodes.caption)), "")


def setup(app):
    app.add_enumerable_node(table_figure, "table", _caption,
                            html=(lambda self, node: self.visit_figure(node), lambda self, node: self.depart_figure(node)))
    app.add_transform(TableFigures)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
