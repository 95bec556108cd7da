"""The README's and docs/'s code blocks and links, read as data for tests/test_docs.py (and the
SGLang suite's launch-command test): fenced blocks with their labels and lines, shell commands
split into words, markdown links, headings' anchors."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # every block here runs in a test
LINKED_FILES = DOC_FILES + sorted((ROOT / "design_notes").glob("*.md"))  # every link here resolves
LABELS = ("python", "bash", "text")  # text: program output, layouts and synopses, never run


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    label: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list:
    out, start, label, body = [], None, "", []
    for i, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("```"):
            if start is None:
                start, label, body = i, line[3:].strip(), []
            else:
                out.append(Block(path, start, label, "\n".join(body) + "\n"))
                start = None
        elif start is not None:
            body.append(line)
    assert start is None, f"{path.relative_to(ROOT)}:{start}: a code fence is never closed"
    return out


def all_blocks(label: str | None = None) -> list:
    return [b for p in DOC_FILES for b in blocks(p) if label is None or b.label == label]


def shell_commands(block: Block) -> list:
    """The commands of a bash block, each as its words (continuations joined, comments and
    leading VAR=value assignments dropped): [(words, env), ...]."""
    joined = block.code.replace("\\\n", " ")
    out = []
    for line in joined.split("\n"):
        words = shlex.split(line, comments=True)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            k, _, v = words.pop(0).partition("=")
            env[k] = v
        if words:
            out.append((words, env))
    return out


LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def links(path: Path) -> list:
    """(line, target) of every markdown link outside code blocks."""
    out, fenced = [], False
    for i, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(i, m.group(2)) for m in LINK.finditer(line)]
    return out


def anchors(path: Path) -> set:
    """GitHub's anchors of a markdown file's headings (lower case, punctuation dropped, spaces
    to '-', repeats numbered)."""
    seen, out, fenced = {}, set(), False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_NUMBERS = re.compile(r"-?\d+(?:\.\d+)?(?:\s+-?\d+(?:\.\d+)?)*")


def output_skeleton(line: str) -> str:
    """A line of program output with its numbers (a run of space-separated numbers as one) made
    '#': what stays the same from run to run, the fields and their order."""
    return _NUMBERS.sub("#", line.strip())
