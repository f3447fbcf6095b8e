"""Sphinx configuration for the optaxaccum documentation.

Built offline (no intersphinx, no remote themes or fonts) by ``make docs``:
an HTML build and a doctest build, both with ``-W``. The local extension
``_ext/coverage_check.py`` fails the build when a name in a public
``__all__`` is left out of the API reference.
"""

import os
import sys

sys.path.insert(0, os.path.abspath("_ext"))

import optaxaccum  # noqa: E402

project = "optaxaccum"
author = "the optaxaccum authors"
copyright = "the optaxaccum authors"
release = optaxaccum.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "myst_parser",
    "coverage_check",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "api/generated", "Thumbs.db", ".DS_Store"]

# -- MyST (Markdown pages) ---------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

# -- autodoc / napoleon ------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Returns: A boolean scalar array: true if ..." reads as one sentence.
napoleon_use_rtype = False
# The API page lists its entries itself; nothing is generated into the tree.
autosummary_generate = False

# -- doctest -----------------------------------------------------------------
# The ``>>>`` examples in the library's docstrings are run by pytest
# (``--doctest-modules``); this builder runs the pages' own ``doctest``
# blocks only.
doctest_test_doctest_blocks = ""

# -- coverage_check (docs/_ext/coverage_check.py) ----------------------------
coverage_check_modules = [
    "optaxaccum",
    "optaxaccum.flax",
    "optaxaccum.flax.nnx",
]

# -- HTML ----------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"optaxaccum {release}"
html_static_path = []
html_theme_options = {
    "description": "Gradient accumulation for JAX as composable optax "
    "transformations.",
    "fixed_sidebar": True,
    "show_relbars": True,
}
