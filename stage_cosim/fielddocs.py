"""The attribute docstrings of a dataclass's fields (the string right below each field, as
Megatron-Core's TransformerConfig documents its fields): one text per field that the command
line's help, the docs and the code share, so they cannot drift."""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """``{field name: its docstring}``, each docstring on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body       # the class statement's body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs
