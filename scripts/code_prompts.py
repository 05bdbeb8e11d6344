#!/usr/bin/env python3
"""Coding prompts whose answers repeat or transform code: held-out prompts from pip, training prompts from the stdlib.

The draft heads and exit predictors are trained on HumanEval stubs, man pages, pydoc text of the standard library
and hand-written questions (scripts/draft_data.py), plus (for Qwen2.5-Coder) the training prompts this script
writes from the standard library's own source. The held-out prompts are built from the source code of the
installed `pip` package (its own `pip/_internal` modules), a source no training record comes from: 16 functions of
8-30 lines, picked by a stable hash of their qualified names, each with one of four tasks whose answers repeat or
transform the code (add type hints, add a docstring, refactor, write tests): the case where speculation should pay
most.

Usage:
  python3 scripts/code_prompts.py [OUT]
      held-out: writes OUT (default bench/code-heldout.jsonl; pip's version is recorded in each record)
  python3 scripts/code_prompts.py --train N OUT
      training: N prompts from the standard library's source (site-packages and tests left out, so pip never
      appears; nor the codecs of encodings/, which are one function copied a hundred times), with the four
      held-out tasks and four more, picked by a stable hash
  python3 scripts/code_prompts.py --train N --packages NAME[,NAME…] OUT
      training: N prompts from the source of these installed packages (installed by name with pip; their
      versions are recorded in each record; tests and vendored code left out; pip itself is refused)
"""
import argparse
import ast
import hashlib
import json
import os
import sys

TASKS = [
    "Add type hints to this Python function and return the whole function:",
    "Write a docstring for this Python function and return the whole function with it:",
    "Refactor this Python function to be easier to read, keeping its behaviour:",
    "Write pytest unit tests for this Python function:",
]

# Training prompts also ask for these, so the head sees code repeated in more ways than the held-out tasks.
EXTRA_TASKS = [
    "Explain what this Python function does, step by step:",
    "Add a comment to each step of this Python function and return the whole function:",
    "Find possible bugs in this Python function and return a fixed version:",
    "Rewrite this Python function with clearer variable names:",
]


def functions(root, skip):
    # Pruned as it walks (so `skip` holds), in sorted order (so the output is stable).
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                text = open(path, encoding="utf-8").read()
                tree = ast.parse(text)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = text.splitlines()
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
                    n = node.end_lineno - node.lineno + 1
                    if 8 <= n <= 30 and ast.get_docstring(node) is None:
                        start = node.lineno - 1 - len(node.decorator_list)
                        body = lines[start:node.end_lineno]
                        indent = len(body[0]) - len(body[0].lstrip())
                        code = "\n".join(l[indent:] for l in body)
                        rel = os.path.relpath(path, os.path.dirname(root))
                        yield f"{rel}:{node.name}", code


def by_hash(found):
    return sorted(found, key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())


def write(out, records):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def heldout(out):
    import pip

    root = os.path.join(os.path.dirname(pip.__file__), "_internal")
    found = by_hash(functions(root, {"_vendor"}))[:16]
    write(out, [
        {"messages": [{"role": "user", "content": f"{TASKS[i % 4]}\n\n```python\n{code}\n```"}],
         "source": f"pip-{pip.__version__}/{name}"}
        for i, (name, code) in enumerate(found)
    ])
    print(f"{out}: {len(found)} prompts from pip {pip.__version__}")


def train(n, out):
    root = os.path.dirname(os.__file__)
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
    found = by_hash(functions(root, skip))[:n]
    tasks = TASKS + EXTRA_TASKS
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    write(out, [
        {"messages": [{"role": "user", "content": f"{tasks[i % len(tasks)]}\n\n```python\n{code}\n```"}],
         "source": f"python-{version}-stdlib/{name}"}
        for i, (name, code) in enumerate(found)
    ])
    print(f"{out}: {len(found)} prompts from Python {version}'s standard library")


def train_packages(n, names, out):
    import importlib
    import importlib.metadata

    found, versions = [], {}
    for name in names:
        if name == "pip":
            sys.exit("pip is the held-out source: it cannot be a training package")
        mod = importlib.import_module(name)
        root = os.path.dirname(mod.__file__)
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = getattr(mod, "__version__", "unknown")
        skip = {"test", "tests", "testing", "_vendor", "vendor", "__pycache__", "data"}
        found += [(f"{name}-{versions[name]}/{q}", code) for q, code in functions(root, skip)]
    found = by_hash(found)[:n]
    tasks = TASKS + EXTRA_TASKS
    write(out, [
        {"messages": [{"role": "user", "content": f"{tasks[i % len(tasks)]}\n\n```python\n{code}\n```"}],
         "source": name}
        for i, (name, code) in enumerate(found)
    ])
    print(f"{out}: {len(found)} prompts from " + ", ".join(f"{k} {v}" for k, v in versions.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--train", type=int, metavar="N", help="write N training prompts from the standard library")
    ap.add_argument("--packages", metavar="NAMES", help="with --train: from these installed packages instead")
    a = ap.parse_args()
    if a.train is not None:
        if not a.out:
            ap.error("--train needs OUT")
        if a.packages:
            train_packages(a.train, a.packages.split(","), a.out)
        else:
            train(a.train, a.out)
    else:
        heldout(a.out or "bench/code-heldout.jsonl")


if __name__ == "__main__":
    main()
