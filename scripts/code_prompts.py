#!/usr/bin/env python3
"""Writes bench/code-heldout.jsonl: coding prompts from a source none of our training data comes from.

The draft heads and exit predictors are trained on HumanEval stubs, man pages, pydoc text of the standard library
and hand-written questions (scripts/draft_data.py). These prompts are built from the source code of the installed
`pip` package (its own `pip/_internal` modules, not the standard library): 16 functions of 8-30 lines, picked by a
stable hash of their qualified names, each with one of four tasks whose answers repeat or transform the code
(add type hints, add a docstring, refactor, write tests): the case where speculation should pay most.

Usage: python3 scripts/code_prompts.py [OUT]   (default bench/code-heldout.jsonl; pip's version is recorded)
"""
import ast
import hashlib
import json
import os
import sys

import pip

TASKS = [
    "Add type hints to this Python function and return the whole function:",
    "Write a docstring for this Python function and return the whole function with it:",
    "Refactor this Python function to be easier to read, keeping its behaviour:",
    "Write pytest unit tests for this Python function:",
]


def functions(root):
    for dirpath, _, files in sorted(os.walk(root)):
        if "_vendor" in dirpath:
            continue
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            text = open(path, encoding="utf-8").read()
            lines = text.splitlines()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
                    n = node.end_lineno - node.lineno + 1
                    if 8 <= n <= 30 and ast.get_docstring(node) is None:
                        start = node.lineno - 1 - len(node.decorator_list)
                        body = lines[start:node.end_lineno]
                        indent = len(body[0]) - len(body[0].lstrip())
                        code = "\n".join(l[indent:] for l in body)
                        rel = os.path.relpath(path, os.path.dirname(root))
                        yield f"{rel}:{node.name}", code


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "bench/code-heldout.jsonl"
    root = os.path.join(os.path.dirname(pip.__file__), "_internal")
    found = sorted(functions(root), key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())[:16]
    with open(out, "w") as f:
        for i, (name, code) in enumerate(found):
            prompt = f"{TASKS[i % 4]}\n\n```python\n{code}\n```"
            rec = {"messages": [{"role": "user", "content": prompt}], "source": f"pip-{pip.__version__}/{name}"}
            f.write(json.dumps(rec) + "\n")
    print(f"{out}: {len(found)} prompts from pip {pip.__version__}")


if __name__ == "__main__":
    main()
