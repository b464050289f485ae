#!/usr/bin/env python3
"""Every command of zero's programs in the README's and docs/'s shell blocks
names flags the program has: each `--flag` of `build/bin/PROG [SUB]` appears
in `PROG [SUB] --help` (issue 53). A page that outlives a renamed flag fails
here. Runs nothing but --help.

usage: shell_snippets_test.py SOURCE_DIR BUILD_DIR
"""
import pathlib
import re
import shlex
import subprocess
import sys

# The subcommands of each program, as their --help is asked.
SUBCOMMANDS = {
    "zero": {"config": ["check"], "checkpoint": ["consolidate", "export", "verify", "info", "export-deepspeed",
                            "import-deepspeed"],
             "memcheck": ["record", "check"], "trace": ["merge"],
             "bench": ["engine", "overlap", "stage3", "aio", "offload", "adam", "transfer", "checkpoint",
                       "checkpoint-io"],
             "launch": [], "tune": [], "estimate": [], "nvme-tune": []},
    "llama": {"train": [], "logits": []},
    "moe": {"train": []},
    "mingpt": {},
}


def commands(text):
    """Each shell line of a ```sh block, continuations joined, comments dropped."""
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                yield line


def invocations(tokens):
    """(program, subcommand words, flags) of each zero program in `tokens`;
    what follows a lone `--` is a program of its own."""
    i = 0
    while i < len(tokens):
        prog = pathlib.PurePath(tokens[i]).name
        if not (tokens[i].endswith("bin/" + prog) and prog in SUBCOMMANDS):
            i += 1
            continue
        words, flags, j = [], [], i + 1
        level = SUBCOMMANDS[prog]
        while j < len(tokens) and tokens[j] != "--":
            t = tokens[j].strip("[]")
            if t.startswith("--"):
                flags.append(t.split("=")[0])
            elif not flags and isinstance(level, dict) and t in level:
                words.append(t)
                level = level[t]
            elif not flags and isinstance(level, list) and t in level:
                words.append(t)
                level = None
            j += 1
        yield prog, words, flags
        i = j + 1


def main():
    source, build = map(pathlib.Path, sys.argv[1:3])
    pages = [source / "README.md"] + sorted((source / "docs").glob("*.md"))
    helps, problems, checked = {}, [], 0
    for page in pages:
        for line in commands(page.read_text()):
            for part in re.split(r"&&|\|\||;|\|", line):
                try:
                    tokens = shlex.split(part)
                except ValueError:
                    continue
                for prog, words, flags in invocations(tokens):
                    key = (prog, tuple(words))
                    if key not in helps:
                        r = subprocess.run([str(build / "bin" / prog), *words, "--help"], capture_output=True,
                                           text=True, timeout=60)
                        helps[key] = r.stdout + r.stderr if r.returncode == 0 else None
                    if helps[key] is None:
                        problems.append(f"{page.relative_to(source)}: `{prog} {' '.join(words)} --help` fails")
                        continue
                    for flag in flags:
                        checked += 1
                        if not re.search(re.escape(flag) + r"(?![A-Za-z0-9_-])", helps[key]):
                            problems.append(f"{page.relative_to(source)}: `{prog} {' '.join(words)}` has no {flag} "
                                            f"(not in its --help): {line[:100]}")
    for p in problems:
        print(p)
    print(f"{checked} flags of {len(helps)} commands in {len(pages)} pages" + ("" if not problems else ": problems above"))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
