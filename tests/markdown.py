"""Reading Markdown pages as the docs tests do: fenced blocks, and the commands of shell blocks."""

from __future__ import annotations

import re

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
SHELL_LANGUAGES = {"sh", "bash", "console", "shell"}


def shell_blocks(text: str) -> list[list[str]]:
    """The commands of each shell block: every line of sh/bash/shell blocks and the `$ ` lines of
    console blocks, with comments (a trailing `# ...` too) dropped and `\\` continuations joined.
    Blocks in any other language, or none, are output or code."""
    blocks = []
    for language, body in FENCE.findall(text):
        if language not in SHELL_LANGUAGES:
            continue
        commands = []
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            line = line.strip()
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
        blocks.append(commands)
    return blocks
