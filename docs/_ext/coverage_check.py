"""Fails the docs build when a public name is missing from the API reference.

For every module in the ``coverage_check_modules`` config value, each name in
its ``__all__`` must be documented as ``<module>.<name>`` by a Python-domain
directive (``autofunction``, ``autoclass``, ``py:function``, ...). The check
runs on ``env-check-consistency``, after all documents are read, so it runs in
every builder (``html`` and ``doctest``); each missing name is logged as a
warning, which ``sphinx -W`` turns into a failed build.
"""

from __future__ import annotations

import importlib

from sphinx.util import logging

logger = logging.getLogger(__name__)


def public_names(module_names: list[str]) -> list[str]:
    """``module.name`` for every name in each module's ``__all__``."""
    names = []
    for module_name in module_names:
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            logger.warning(
                "coverage_check: module %s has no __all__",
                module_name,
                type="coverage_check",
            )
            continue
        names.extend(f"{module_name}.{name}" for name in exported)
    return names


def documented_names(env) -> set[str]:
    """Full names of the objects the Python domain has a description of."""
    return {
        name
        for name, entry in env.get_domain("py").objects.items()
        if not getattr(entry, "aliased", False)
    }


def check_coverage(app, env) -> None:
    modules = list(app.config.coverage_check_modules)
    documented = documented_names(env)
    missing = [n for n in public_names(modules) if n not in documented]
    for name in missing:
        logger.warning(
            "coverage_check: public name %s (in __all__) is not documented "
            "in the API reference",
            name,
            type="coverage_check",
        )
    if not missing:
        logger.info(
            "coverage_check: all %d public names of %s are documented",
            len(public_names(modules)),
            ", ".join(modules),
        )


def setup(app):
    app.add_config_value("coverage_check_modules", [], "env", [list])
    app.connect("env-check-consistency", check_coverage)
    return {
        "version": "1.0",
        "parallel_read_safe": True,
        "parallel_write_safe": True,
    }
