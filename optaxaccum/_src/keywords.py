"""Extra keyword arguments: which ones a transformation declares, near-misses
of them, and signatures that declare them.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "check_extra_args",
    "declared_extra_args",
    "keywords",
    "with_signature",
]


def keywords(fn: Any, skip: int = 3) -> frozenset[str]:
    """The keyword parameters of ``fn`` (or of a transformation's
    ``update``) after the first ``skip``, ``**`` catch-alls and
    ``_``-prefixed names excluded."""
    fn = getattr(fn, "update", fn)
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins or callables without one
        return frozenset()
    return frozenset(
        p.name
        for p in list(parameters)[skip:]
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and not p.name.startswith("_")
    )


def declared_extra_args(fn: Any, skip: int = 3) -> frozenset[str]:
    """The extra keyword arguments a function declares by name.

    Args:
      fn: an ``update``-like function, or an optax transformation (its
        ``update`` is read).
      skip: how many leading parameters are not extra arguments
        (``updates, state, params``).

    Returns:
      The names of its keyword parameters after the first ``skip``
      (``accum_weight``, ``value``, ...); ``**extra_args`` catch-alls,
      and private (``_``-prefixed) names excluded.
    """
    return keywords(fn, skip)


def check_extra_args(
    extra_args: Iterable[str],
    declared: Iterable[str],
    where: str = "no element of the chain takes it",
) -> None:
    """Raises ``TypeError`` for a keyword that is not declared but is a
    near-miss of one that is (``acum_weight`` for ``accum_weight``, or its
    last word: ``weight``).

    Args:
      extra_args: the keywords given.
      declared: the keywords the receivers declare.
      where: why the keyword is unexpected, for the message.
    """
    declared = sorted(declared)
    for key in extra_args:
        if key in declared or key.startswith("_"):
            continue
        # A misspelling, or a declared name's last word (``weight`` for
        # ``accum_weight``).
        close = difflib.get_close_matches(key, declared, n=1, cutoff=0.75)
        close = close or [d for d in declared if d.endswith(f"_{key}")]
        if close:
            raise TypeError(
                f"unexpected keyword argument {key!r}: {where}; "
                f"did you mean {close[0]!r}?"
            )


def with_signature(
    fn: Callable, names: Iterable[str], gate: bool = False
) -> Callable:
    """Gives an ``update(updates, state, params=None, **extra_args)`` function
    (with ``gate``: a ``gate_update(updates, state, params, ctx,
    **extra_args)``) a signature that declares ``names`` as keyword-only
    arguments, so that :func:`declared_extra_args` (and ``inspect``) see
    them."""
    p = inspect.Parameter
    leading = [
        p("updates", p.POSITIONAL_OR_KEYWORD),
        p("state", p.POSITIONAL_OR_KEYWORD),
        p("params", p.POSITIONAL_OR_KEYWORD, default=None),
    ]
    if gate:
        leading[2] = p("params", p.POSITIONAL_OR_KEYWORD)
        leading.append(p("ctx", p.POSITIONAL_OR_KEYWORD))
    names = set(names) | keywords(fn, len(leading))  # and its own keywords
    params = [
        *leading,
        *(p(n, p.KEYWORD_ONLY, default=None) for n in sorted(names)),
        p("extra_args", p.VAR_KEYWORD),
    ]
    fn.__dict__["__signature__"] = inspect.Signature(params)
    return fn
