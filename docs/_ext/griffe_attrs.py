"""Griffe extensions for the API reference: attrs signatures and Sphinx roles.

``AttrsInit``: static analysis sees ``@attrs.frozen class Elastic: min: int = ...`` but not
the ``__init__`` attrs generates at import time, so the reference would show
``tangram.Elastic`` without a signature and warn about every ``:param x:`` of an attrs
class. Griffe rebuilds ``__init__`` for dataclasses; this does the same for attrs, by
importing the class and reading the signature attrs gave it (defaults, keyword-only
fields and private-name aliases included) rather than re-deriving attrs' rules.

``SphinxRoles``: the docstrings cross-reference with Sphinx roles (``:class:`Lease```),
which mkdocstrings prints verbatim. They become code spans, with a leading ``~`` dropping
the module path as Sphinx does.
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

import attrs
from griffe import (
    Class,
    Extension,
    Function,
    Inspector,
    Object,
    ObjectNode,
    Parameter,
    ParameterKind,
    Parameters,
    Visitor,
    dynamic_import,
)

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: ParameterKind.var_keyword,
}
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj):`(~?)([^`]+)`")


def _default(value: Any, field: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    default = getattr(field, "default", value)
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return "<computed>"
        return f"{getattr(default.factory, '__name__', 'factory')}()"
    return repr(value)


def _annotation(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    return value if isinstance(value, str) else inspect.formatannotation(value)


class AttrsInit(Extension):
    """Add the generated ``__init__`` to every attrs class that does not define one."""

    def on_class_members(
        self,
        *,
        node: ast.AST | ObjectNode,
        cls: Class,
        agent: Visitor | Inspector,
        **kwargs: Any,
    ) -> None:
        if "__init__" in cls.members:
            return
        try:
            runtime = dynamic_import(cls.path)
        except ImportError:
            return
        if not (inspect.isclass(runtime) and attrs.has(runtime)):
            return
        fields = {field.alias: field for field in attrs.fields(runtime)}
        signature = inspect.signature(runtime.__init__)
        parameters = [
            Parameter(
                name,
                annotation=_annotation(param.annotation),
                kind=_KINDS[param.kind],
                default=_default(param.default, fields.get(name)),
            )
            for name, param in signature.parameters.items()
        ]
        init = Function("__init__", lineno=0, endlineno=0, parent=cls, returns="None")
        init.parameters = Parameters(*parameters)
        cls.set_member("__init__", init)


class SphinxRoles(Extension):
    """Turn ``:class:`x``` and friends into code spans."""

    def on_instance(
        self,
        *,
        node: ast.AST | ObjectNode,
        obj: Object,
        agent: Visitor | Inspector,
        **kwargs: Any,
    ) -> None:
        docstring = obj.docstring
        if docstring is not None and ":`" in docstring.value:
            docstring.value = _ROLE.sub(_code, docstring.value)


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"
