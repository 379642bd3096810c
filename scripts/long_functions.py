#!/usr/bin/env python3
"""Lists C++ functions longer than a threshold, longest first.

Usage: scripts/long_functions.py [--over N] PATH...   (N defaults to 80)

A function's length is counted from the line holding its name to the line
of its closing brace, both included, as a reader scrolling it would. The
parse is a heuristic, not a compiler: comments, strings and character
literals are blanked, then a brace opens a function when the text before it
ends in a parameter list (optionally followed by qualifiers, a trailing
return type or a constructor's initialiser list). Lambdas and nested blocks
count toward the function that holds them.
"""
import argparse
import pathlib
import re
import sys

NOT_FUNCTION = re.compile(
    r"\b(namespace|class|struct|union|enum|if|for|while|switch|catch|do|else)\b")


def blank_comments_and_literals(text):
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # digit separator
                out.append(c)
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def head_names_a_function(head):
    head = head.strip()
    if not head.endswith(")") and not re.search(
            r"\)\s*(const|noexcept|override|final|mutable|&|&&|\s)*"
            r"(->[^{;]*)?(:.*)?$", head, re.S):
        return None
    if NOT_FUNCTION.search(head.split("(")[0]) or head.startswith("#"):
        return None
    if re.search(r"[=\[]\s*[^()]*$", head.split("(")[0]):  # initialisers
        return None
    m = re.search(r"([~\w:<>]+(?:operator\s*\S+)?)\s*\(", head)
    return m.group(1) if m else None


def functions(path):
    text = blank_comments_and_literals(path.read_text())
    line_of = lambda pos: text.count("\n", 0, pos) + 1
    depth, in_function, head_start, found = 0, None, 0, []
    for pos, c in enumerate(text):
        if c == "{":
            if in_function is None:
                head = text[head_start:pos]
                # `member_{value}` in an initialiser list is not a body.
                if not (pos > 0 and (text[pos - 1].isalnum() or text[pos - 1] == "_")
                        and re.search(r"\)\s*:", head)):
                    name = head_names_a_function(head)
                    if name:
                        start = head_start + len(head) - len(head.lstrip())
                        name_pos = text.find(name, start)
                        in_function = (name, line_of(name_pos), depth)
            depth += 1
            if in_function is None:
                head_start = pos + 1
        elif c == "}":
            depth -= 1
            if in_function and depth == in_function[2]:
                name, first, _ = in_function
                found.append((line_of(pos) - first + 1, name, first))
                in_function = None
            if in_function is None:
                head_start = pos + 1
        elif c == ";" and in_function is None:
            head_start = pos + 1
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--over", type=int, default=80)
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    files = []
    for p in map(pathlib.Path, args.paths):
        files += sorted(p.rglob("*")) if p.is_dir() else [p]
    rows = []
    for f in files:
        if f.suffix in (".cc", ".cpp", ".h", ".hpp", ".cu"):
            rows += [(n, name, f"{f}:{line}") for n, name, line in functions(f)]
    for n, name, where in sorted(rows, reverse=True):
        if n > args.over:
            print(f"{n:5d}  {name:40s} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
