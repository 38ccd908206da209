"""The repository's text speaks about Tessera, not about how the repository was made.

History belongs to git: no numbered rounds of work, no remarks on the circumstances of
the work, no notes addressed to those who made it. This test reads
every tracked file of these kinds (``git ls-files``) and fails on the patterns of
``FORBIDDEN`` (case-insensitive), listing each hit as ``path:line``:

- docs: every Markdown file, whole (``README.md``, ``docs/**``, ...);
- code: the comments and docstrings of every ``.py`` file, the comments of every
  ``.cpp``, ``.h`` and ``.proto`` file (``//`` and ``/* */``), and of every ``.yaml``,
  ``.toml``, ``.tpl``, ``.sh`` file and the ``Dockerfile`` (``#``; ``/* */`` in Helm
  templates);
- committed results: ``benchmarks/results/*.json``, whole.

The patterns are narrow on purpose: a library's sessions (pytest's ``scope="session"``,
aiohttp's ``ClientSession``, ``requests.Session``, ``start_new_session``) never match.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

FORBIDDEN = re.compile(
    "|".join(
        (
            r"\bstops?[ -]\d+",
            r"\bturns? \d+",
            r"\bsessions? \d+",
            r"\b(?:this|last|earlier|previous|next|a later|slow|noisy) sessions?\b",
            r"PEERS\.md",
            r"\.\./shared",
            r"closing note",
        )
    ),
    re.IGNORECASE,
)

C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
HASH_COMMENT = re.compile(r"(?:^|(?<=\s))#[^\n]*", re.MULTILINE)

C_LIKE = (".cpp", ".h", ".proto")
HASH_LIKE = (".yaml", ".yml", ".toml", ".tpl", ".sh")


def python_text(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of each comment and docstring of Python ``source``: a string
    that is a statement of its own (a module's, class's or function's docstring, or an
    attribute's), with the strings implicitly joined to it. Source that does not
    tokenize is read whole."""
    at_statement_start = True  # no token of the current logical line yet
    in_docstring = False
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            kind = token.type
            if kind == tokenize.COMMENT:
                yield token.start[0], token.string
                continue
            if kind == tokenize.NL:
                continue
            if kind == tokenize.STRING and (at_statement_start or in_docstring):
                yield token.start[0], token.string
                in_docstring = True
            else:
                in_docstring = False
            at_statement_start = kind in (
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.ENCODING,
            )
    except (tokenize.TokenError, SyntaxError):
        yield 1, source


def _spans(pattern: re.Pattern[str], text: str) -> Iterator[tuple[int, str]]:
    for match in pattern.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match.group()


def texts(path: str, source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of the parts of a file this test reads (see the module's
    docstring); nothing for a kind of file it does not read."""
    name = path.rsplit("/", 1)[-1]
    if name.endswith(".md") or (path.startswith("benchmarks/results/") and name.endswith(".json")):
        yield 1, source
    elif name.endswith(".py"):
        yield from python_text(source)
    elif name.endswith(C_LIKE):
        yield from _spans(C_COMMENT, source)
    elif name.endswith(HASH_LIKE) or name == "Dockerfile":
        yield from _spans(HASH_COMMENT, source)
        yield from _spans(BLOCK_COMMENT, source)


def hits(path: str, source: str) -> list[str]:
    """``path:line: words`` for each forbidden pattern in the parts of ``source`` read."""
    found = []
    for first_line, text in texts(path, source):
        for match in FORBIDDEN.finditer(text):
            line = first_line + text.count("\n", 0, match.start())
            found.append(f"{path}:{line}: {match.group()!r}")
    return found


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [path for path in listed.decode().split("\0") if path]


def test_no_words_about_how_the_repository_was_made() -> None:
    found = []
    for path in tracked_files():
        file = ROOT / path
        if path == THIS_FILE or not file.is_file():  # a file deleted but not yet committed
            continue
        try:
            source = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file (a plot)
            continue
        found += hits(path, source)
    assert not found, "words about how the repository was made:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("a.py", "# measured at stop 12\nx = 1\n"),
        ("a.py", '"""Module."""\n\n\ndef f():\n    """As the previous session found."""\n'),
        ("a.py", 'X = 1\n"""An attribute\'s docstring: turn 3."""\n'),
        ("a.cpp", "int x;  // stops 32-33 measured it\n"),
        ("a.h", "/* a note\n   from session 4 */\n"),
        ("k8s/a.yaml", "kind: Pod  # see ../shared/notes\n"),
        ("Dockerfile", "# see PEERS.md\nFROM python:3.12\n"),
        ("docs/a.md", "In a slow session the figures moved.\n"),
        ("a.py", '"""As earlier sessions measured (a stop-32 build)."""\n'),
        ("README.md", "A closing note.\n"),
        ("benchmarks/results/a.json", '{"note": "stop 42"}\n'),
    ],
)
def test_each_kind_of_file_is_read(path: str, source: str) -> None:
    assert hits(path, source), (path, source)


@pytest.mark.parametrize(
    ("path", "source"),
    [
        (
            "a.py",
            '@pytest.fixture(scope="session")\ndef ray_session():\n    """One Ray per run."""\n',
        ),
        ("a.py", "async with aiohttp.ClientSession() as session:  # one session a run\n    pass\n"),
        ("a.py", "s = requests.Session()\np = Popen(args, start_new_session=True)\n"),
        ("a.py", 'STOP = "stop 1"  # a stop string of the test\n'),
        ("a.py", 'print("the next session 3")\n'),  # code, not a comment or docstring
        ("a.cpp", 'const char* s = "stop 1";\n'),
        ("k8s/a.yaml", "sessionAffinity: None\n"),
        ("docs/a.md", "The scheduler stops workers that are drained; each session of a\n"),
        ("benchmarks/other.json", '{"note": "stop 42"}\n'),
        ("tests/data/a.txt", "stop 42\n"),
    ],
)
def test_what_is_not_about_the_making_passes(path: str, source: str) -> None:
    assert not hits(path, source), hits(path, source)
