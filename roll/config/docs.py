"""Field documentation: the docstring under a dataclass field is its ``--help`` text."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import lru_cache


@lru_cache(maxsize=None)
def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Map field name -> the string literal right below its annotation in ``cls``'s source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_doc(cls: type, field: dataclasses.Field) -> str:
    """One-line help for ``field``: its docstring, else HF-style ``metadata['help']``."""
    doc = _attribute_docstrings(cls).get(field.name)
    if doc:
        return doc
    return " ".join(str(field.metadata.get("help", "")).split())
