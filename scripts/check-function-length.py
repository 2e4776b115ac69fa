#!/usr/bin/env python3
"""Finds C++/CUDA functions in src/ whose definition is longer than a limit (150 lines).

    scripts/check-function-length.py [--max-lines N] [PATH...]   (default: src/ of the repository)

Prints one line per violation, FILE:LINE: NAME is L lines (limit N), and exits with 1 if
there is any. A function's length runs from the line of its name to its closing brace.

The parser is a brace-matching heuristic, not a C++ parser: comments, string and character
literals (raw strings included) and preprocessor lines are blanked first; then every `{` at
namespace or class scope opens a scope (namespace, class, struct, union, enum, extern "C"),
an initializer (`= {...}`, skipped) or a function body, whose lambdas and local classes
count towards it. Constructor initializer lists with braces (`: a_{x} {`) are understood.
"""
import argparse
import pathlib
import re
import sys

EXTENSIONS = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
SCOPE_KEYWORDS = re.compile(r"\b(namespace|class|struct|union|enum)\b")
# Parenthesised decorations that come before a function's name.
DECORATIONS = re.compile(r"(__launch_bounds__|__attribute__|alignas|__declspec|noexcept|decltype|requires)\s*\(")


def blank(text):
    """Returns text with comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    line_start = True

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if line_start and c == "#":  # a preprocessor line, with its continuations
            j = i
            while j < n and not (text[j] == "\n" and text[j - 1] != "\\"):
                j += 1
            wipe(i, j)
            i = j
            continue
        if c == "\n":
            line_start = True
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            wipe(i, j)
            i = j
        elif c == '"' and i > 0 and text[i - 1] == "R" and (i < 2 or not (text[i - 2].isalnum() or text[i - 2] == "_")
                                                            or text[i - 2] in "uUL8"):
            m = re.match(r'"([^()\\\s]{0,16})\(', text[i:])
            if not m:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            wipe(i, j)
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():
                # a digit separator (100'000) if the word before it is a number
                k = i - 1
                while k >= 0 and (text[k].isalnum() or text[k] in "_'."):
                    k -= 1
                if text[k + 1].isdigit():
                    i += 1
                    continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            wipe(i, min(j + 1, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def matching_brace(text, i):
    """Index of the `}` closing the `{` at i."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def depth0(header):
    """header with what is inside its (...) and [...] removed (the brackets stay)."""
    out, depth = [], 0
    for ch in header:
        if ch in "([":
            depth += 1
            if depth == 1:
                out.append(ch)
        elif ch in ")]":
            depth -= 1
            if depth == 0:
                out.append(ch)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def strip_template(header):
    """header without its leading `template <...>` clauses."""
    while True:
        m = re.match(r"\s*template\s*<", header)
        if not m:
            return header
        depth, j = 1, m.end()
        while j < len(header) and depth:
            depth += {"<": 1, ">": -1}.get(header[j], 0)
            j += 1
        header = header[j:]


def classify(header):
    """'scope', 'init' or 'function' for the text between the previous statement and a `{`."""
    h = strip_template(header)
    h = re.sub(r"\b(public|private|protected)\s*:(?!:)", " ", h)
    flat = depth0(h)
    if re.match(r"\s*extern\s*$", flat) or re.match(r"\s*(inline\s+)?namespace\b", flat):
        return "scope"
    if "(" not in h:  # no parameter list: a class, an enum or a braced initializer
        return "scope" if SCOPE_KEYWORDS.search(flat) else "init"
    before_params = h[: h.index("(")]
    if SCOPE_KEYWORDS.search(before_params) and not re.search(r"\boperator\b", before_params):
        return "scope"  # struct alignas(16) X {, class X : Base<f(1)> {
    if re.search(r"(?<![=!<>+\-*/%&|^])=(?!=)", flat) and not re.search(r"\boperator\b", flat):
        return "init"  # int x[] = {...}, auto f = [](...) {...} (a lambda is not a function definition here)
    return "function"


def function_name(header):
    """The name before the parameter list: the last `name(` at parenthesis depth 0 that is not a decoration,
    before a constructor's initializer list or a trailing return type."""
    h = strip_template(header)
    flat = depth0(h)
    cut = re.search(r"\)\s*(noexcept\s*)?:(?!:)|->", flat)
    if cut:
        flat = flat[: cut.start() + 1]
    names = [m for m in re.finditer(r"((?:[A-Za-z_]\w*\s*(?:<[^()]*>)?\s*::\s*)*"
                                    r"(?:operator\s*(?:\(\s*\)|[^\s(]+)|~?[A-Za-z_]\w*))\s*(?:<[^()]*>)?\s*\(", flat)
             if not DECORATIONS.match(m.group(0))]
    return re.sub(r"\s+", "", names[-1].group(1)) if names else "?"


def functions(text):
    """Yields (name, first line, last line) of every function defined in text (blanked)."""
    line_of = []
    line = 1
    for ch in text:
        line_of.append(line)
        if ch == "\n":
            line += 1
    i, n, start = 0, len(text), 0
    while i < n:
        c = text[i]
        if c in ";}":
            start = i + 1
        elif c == "{":
            header = text[start:i]
            kind = classify(header)
            flat = depth0(header)
            init_list = re.search(r"\)\s*(noexcept\s*)?:(?!:)", flat) is not None
            prev = text[start:i].rstrip()
            if kind == "function" and init_list and prev and (prev[-1].isalnum() or prev[-1] in "_>"):
                i = matching_brace(text, i) + 1  # a member's braced initializer: still the header
                continue
            if kind == "scope":
                start = i + 1
            else:
                end = matching_brace(text, i)
                if kind == "function":
                    name = function_name(header)
                    m = re.search(re.escape(name.split("::")[-1].lstrip("~")), header) if name != "?" else None
                    first = line_of[start + m.start()] if m else line_of[i]
                    yield name, first, line_of[end]
                i = end
                start = end + 1
        i += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-lines", type=int, default=150)
    parser.add_argument("paths", nargs="*", type=pathlib.Path)
    args = parser.parse_args()
    root = pathlib.Path(__file__).resolve().parent.parent
    paths = args.paths or [root / "src"]
    files = []
    for p in paths:
        if not p.exists():
            print(f"check-function-length: {p} does not exist", file=sys.stderr)
            return 2
        files += sorted(f for f in p.rglob("*") if f.suffix in EXTENSIONS) if p.is_dir() else [p]
    violations = 0
    for f in files:
        text = blank(f.read_text(encoding="utf-8", errors="replace"))
        for name, first, last in functions(text):
            length = last - first + 1
            if length > args.max_lines:
                shown = f.relative_to(root) if f.is_relative_to(root) else f
                print(f"{shown}:{first}: {name} is {length} lines (limit {args.max_lines})")
                violations += 1
    print(f"check-function-length: {len(files)} files, {violations} function(s) over {args.max_lines} lines")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
