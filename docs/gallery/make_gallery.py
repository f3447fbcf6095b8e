"""Writes the gallery's pages (``docs/gallery/*.md``) from ``examples/``.

Each page shows an example's description (its docstring), its code (included
from ``examples/`` when the docs are built, so it is always the current
code), what it printed and the plot it saved, as recorded by ``--run``: the
docs build never runs an example (some take minutes), it shows the recorded
output with the command, machine and date that produced it.

Run: ``python docs/gallery/make_gallery.py [--run [NAME ...]]``. Without
``--run`` it rewrites the pages from the recorded outputs (seconds);
``--run`` first reruns the named examples (default: all) and records their
output in ``docs/gallery/outputs/``. It also draws the index's thumbnails
(``docs/gallery/thumbs/``, with matplotlib from the ``examples`` extra):
each example's plot scaled down, or a card with its title drawn large
enough to read in the index's grid.
``tests/repo/test_gallery.py`` fails when a page differs from what this script
writes or a thumbnail is missing.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = os.path.join(ROOT, "examples")
OUTPUTS = os.path.join(HERE, "outputs")
THUMBS = os.path.join(HERE, "thumbs")
WIDTH = 88  # the site's code width (tests/repo/docs_site_check.py)

# (example, arguments it is recorded with): the order of the gallery.
GALLERY = (
    ("quickstart", ()),
    ("flax_trainstate", ()),
    ("nnx_example", ()),
    ("equinox_batchnorm", ()),
    ("token_weighting", ()),
    ("flush_epoch", ()),
    ("fp16_loss_scale", ()),
    ("data_parallel", ()),
    ("fsdp", ()),
    ("adascale", ()),
)


def docstring(name: str) -> str:
    """The module docstring of ``examples/<name>.py``."""
    with open(os.path.join(EXAMPLES, f"{name}.py")) as f:
        return ast.get_docstring(ast.parse(f.read())) or name


def record(name: str, args: tuple[str, ...]) -> None:
    """Runs one example as a user would and records what it printed and
    the figures it saved."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MPLBACKEND="Agg", JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)
        command = ["python", f"examples/{name}.py", *args]
        cpu = os.times()
        proc = subprocess.run(
            [sys.executable, os.path.join(EXAMPLES, f"{name}.py"), *args],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        after = os.times()
        cpu_s = (after.children_user - cpu.children_user) + (
            after.children_system - cpu.children_system
        )
        for png in sorted(f for f in os.listdir(tmp) if f.endswith(".png")):
            shutil.copy(os.path.join(tmp, png), os.path.join(OUTPUTS, png))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    jax_version = importlib.metadata.version("jax")
    header = (
        f"# {' '.join(command)}\n# recorded {when} with jax {jax_version} on "
        f"the CPU of a {os.cpu_count()}-core {platform.machine()} "
        f"{platform.system()} machine ({cpu_s:.0f} CPU seconds)\n"
    )
    with open(os.path.join(OUTPUTS, f"{name}.txt"), "w") as f:
        f.write(header + proc.stdout)


def page(name: str) -> str:
    """The gallery page of one example, from its recorded output."""
    title, _, body = docstring(name).partition("\n\n")
    title = " ".join(title.split())
    with open(os.path.join(OUTPUTS, f"{name}.txt")) as f:
        recorded = f.read()
    command, meta, printed = recorded.split("\n", 2)
    figures = sorted(
        f
        for f in os.listdir(OUTPUTS)
        if f.endswith(".png") and f.startswith(name)
    )
    wrapped = [
        textwrap.fill(
            line, WIDTH, subsequent_indent="    ", break_on_hyphens=False
        )
        if len(line) > WIDTH
        else line
        for line in printed.rstrip().splitlines()
    ]
    note = (
        " (lines longer than the page wrapped, continued with an indent)"
        if wrapped != printed.rstrip().splitlines()
        else ""
    )
    parts = [
        f"# {title.rstrip('.')}",
        "",
        _prose(body),
        "",
        "## The code",
        "",
        f"`examples/{name}.py`{_helpers_note(name)}:",
        "",
        f"```{{literalinclude}} ../../examples/{name}.py",
        ":language: python",
        ":lines: " + _code_start(name),
        "```",
        "",
        "## What it prints",
        "",
        f"`{command.removeprefix('# ')}`, {meta.removeprefix('# ')}{note}:",
        "",
        "```text",
        *wrapped,
        "```",
    ]
    for png in figures:
        # A plot keeps a readable size on a phone, scrolling in its box.
        parts += ["", ":::{container} wide-figure", f"![{png}](outputs/{png})"]
        parts += [":::"]
    return "\n".join(parts) + "\n"


def _prose(body: str) -> str:
    """The docstring's text as Markdown, where it would otherwise run into
    one paragraph: a block of indented lines after a blank line (code, an
    aligned list) is shown as laid out, in a code block; a line followed by
    indented ones (a hanging indent) is a list item."""
    out: list[str] = []
    block: list[str] = []
    for line in body.strip().splitlines() + [""]:
        indented = line.startswith(" ") and line.strip()
        if indented and (block or not out or not out[-1]):
            block.append(line)
            continue
        if indented:  # continues the line above: a list item
            if not out[-1].startswith(("- ", "  ")):
                out[-1] = "- " + out[-1]
            out.append("  " + line.strip())
            continue
        if block:
            width = min(len(b) - len(b.lstrip()) for b in block)
            lines = [b[width:] for b in block]
            out += [f"```{_language(lines)}", *lines, "```"]
            block = []
        if out and out[-1].startswith(("- ", "  ")) and line.strip():
            line = "- " + line if line.startswith("(") else line
        out.append(line)
    return "\n".join(out).strip()


def _language(lines: list[str]) -> str:
    """``python`` for a block of code, ``text`` for an aligned list."""
    try:
        ast.parse("\n".join(lines))
    except SyntaxError:
        return "text"
    return "python"


def thumbnail_source(name: str) -> str | None:
    """The figure an example's thumbnail is made from: the first plot it
    saves (``docs/gallery/outputs/<name>*.png``), else none (the thumbnail
    is then a card with its title)."""
    figures = sorted(
        f
        for f in os.listdir(OUTPUTS)
        if f.endswith(".png") and f.startswith(name)
    )
    return os.path.join(OUTPUTS, figures[0]) if figures else None


# The thumbnail's size, and the narrowest the index's grid shows it
# (docs/_static/custom.css: columns of at least 13rem, 208 px): a card's
# text is drawn at least MIN_TEXT_PX high at that width.
THUMB_PX = (360, 225)
THUMB_DPI = 150
THUMB_SHOWN_PX = 208
MIN_TEXT_PX = 10


def card_text(name: str) -> tuple[str, str]:
    """The headline and the subtitle of an example's card: its title up to
    the first colon, and the rest (empty when the title has none)."""
    title = " ".join(docstring(name).partition("\n\n")[0].split())
    title = title.replace("``", "").rstrip(".")
    head, colon, rest = title.partition(": ")
    return (head, rest) if colon else (title, "")


def _card_pt(px: float) -> float:
    """The font size in points that shows ``px`` high in the grid."""
    return px * 72 / THUMB_DPI * THUMB_PX[0] / THUMB_SHOWN_PX


def make_thumbnail(name: str, source: str | None) -> None:
    """Writes ``docs/gallery/thumbs/<name>.png`` (360 x 225 pixels): the
    figure ``source`` scaled down, or a card with the example's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width, height = (n / THUMB_DPI for n in THUMB_PX)
    fig = plt.figure(figsize=(width, height), dpi=THUMB_DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    if source is not None:
        ax.imshow(plt.imread(source), interpolation="antialiased")
        ax.set_aspect("auto")
    else:
        head, sub = card_text(name)
        ax.add_patch(plt.Rectangle((0, 0.9), 1, 0.1, color="#3b6ea8"))
        kw = {"va": "top", "ha": "left", "transform": ax.transAxes}
        head = textwrap.fill(head, 20, break_long_words=False)
        ax.text(0.06, 0.82, head, fontsize=_card_pt(15), weight="bold", **kw)
        lines = head.count("\n") + 1
        ax.text(
            0.06,
            0.78 - 0.15 * lines,
            textwrap.fill(sub, 30, break_long_words=False),
            fontsize=_card_pt(MIN_TEXT_PX),
            color="#333333",
            **kw,
        )
    os.makedirs(THUMBS, exist_ok=True)
    fig.savefig(
        os.path.join(THUMBS, f"{name}.png"),
        metadata={"Software": None},
        facecolor="#f4f7fb",
    )
    plt.close(fig)


def thumbnails() -> None:
    """Every thumbnail of the gallery's index, from the recorded outputs
    (and the language model's figure)."""
    for name, _ in GALLERY:
        make_thumbnail(name, thumbnail_source(name))
    lm = os.path.join(ROOT, "docs", "figures", "transformer_lm.png")
    make_thumbnail("lm_example", lm)


def _helpers(name: str) -> list[str]:
    """The helper modules of ``examples/`` (``_mesh``, ``_digits``) that
    ``examples/<name>.py`` imports, in the order it imports them."""
    with open(os.path.join(EXAMPLES, f"{name}.py")) as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module or ""]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            local = os.path.join(EXAMPLES, f"{module}.py")
            if module.startswith("_") and os.path.exists(local):
                found.append(module)
    return list(dict.fromkeys(found))


def _helpers_note(name: str) -> str:
    """Where the helpers the example imports live, for a reader who copies
    the code (empty if it imports none)."""
    files = [f"`examples/{m}.py`" for m in _helpers(name)]
    if not files:
        return ""
    listed = files[0] if len(files) == 1 else ", ".join(files[:-1])
    if len(files) > 1:
        listed += f" and {files[-1]}"
    plural = "s" if len(files) > 1 else ""
    return (
        f", which imports the example helper{plural} {listed} that live"
        f"{'' if plural else 's'} beside it (a copy of this code needs "
        f"{'them' if plural else 'it'} too)"
    )


def _code_start(name: str) -> str:
    """The code after the docstring (``"N-"``), which the page shows
    above it as prose."""
    with open(os.path.join(EXAMPLES, f"{name}.py")) as f:
        tree = ast.parse(f.read())
    first = tree.body[0]
    return f"{first.end_lineno + 1}-"


def index() -> str:
    """The gallery's index page: a thumbnail and a link per example (the
    thumbnails are written by ``thumbnails``)."""
    entries = [
        ("../lm_example", "lm_example", "transformer_lm"),
        *((name, name, name) for name, _ in GALLERY),
    ]
    parts = [
        "# Gallery",
        "",
        "The scripts in `examples/`, each with its code, what it printed "
        "and the plot it saves, where it saves one, recorded on CPU. Run one "
        "with `python examples/<name>.py` (the `examples` extra installs what "
        "they need); `--tiny` or `--quick` runs it in seconds. Each picture "
        "is the example's plot, or a card with its title.",
        "",
        ":::{container} gallery-grid",
        "",
    ]
    for page_name, thumb, script in entries:
        parts += [
            f"- [![{script}](thumbs/{thumb}.png)]({page_name}.md)",
            f"  {{doc}}`{page_name}` `examples/{script}.py`",
        ]
    parts += [
        "",
        ":::",
        "",
        "```{toctree}",
        ":hidden:",
        "",
        *[name for name, _ in GALLERY],
        "```",
    ]
    return "\n".join(parts) + "\n"


def pages() -> dict[str, str]:
    """Every page this script writes, by file name."""
    out = {"index.md": index()}
    out.update({f"{name}.md": page(name) for name, _ in GALLERY})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs="*", default=None)
    args = parser.parse_args()
    if args.run is not None:
        os.makedirs(OUTPUTS, exist_ok=True)
        for name, argv in GALLERY:
            if not args.run or name in args.run:
                print("recording", name, flush=True)
                record(name, argv)
    for file, text in pages().items():
        with open(os.path.join(HERE, file), "w") as f:
            f.write(text)
        print("wrote", os.path.join("docs/gallery", file))
    thumbnails()
    print("wrote", os.path.join("docs/gallery/thumbs", "*.png"))


if __name__ == "__main__":
    main()
