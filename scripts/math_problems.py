#!/usr/bin/env python3
"""Math word problems with known numeric answers, for reasoning (SpecExit/DEER, issue #30): train and held-out
sets split by template, so that no held-out problem shares a template with any training problem.

Five kinds (arithmetic, rates, ages, unit conversions, multi-step), each with templates of its own; every template
belongs to exactly one split (`HELDOUT` names the held-out ones). Numbers are drawn from a seeded generator and
chosen so that every answer is a whole number. Each line: {"question": ..., "answer": N, "template": ..., "kind": ...}.

Usage: python3 scripts/math_problems.py --split heldout --n 60 [--seed 1] OUT.jsonl
       python3 scripts/math_problems.py --split train --n 600 [--seed 2] OUT.jsonl
(bench/reasoning-heldout.jsonl is `--split heldout --n 60 --seed 1`.)
"""
import argparse
import json
import os
import random

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "stamps", "shells", "coins"]


def two_names(r):
    a, b = r.sample(NAMES, 2)
    return a, b


# --- arithmetic ---------------------------------------------------------------------------------------------
def arith_buy_give(r):
    n, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(10, 60), r.randint(5, 40), r.randint(1, 9)
    return f"{n} has {a} {item}. {n} buys {b} more and then gives away {c}. How many {item} does {n} have now?", a + b - c


def arith_boxes(r):
    item = r.choice(ITEMS)
    boxes, per, extra = r.randint(3, 12), r.randint(4, 25), r.randint(1, 15)
    return (f"A shop has {boxes} boxes with {per} {item} in each box, and {extra} loose {item}. "
            f"How many {item} does the shop have in total?", boxes * per + extra)


def arith_share(r):  # held-out
    item = r.choice(ITEMS)
    people, each, left = r.randint(3, 9), r.randint(3, 15), r.randint(1, 2)
    total = people * each + left
    return (f"{total} {item} are shared equally among {people} children, and {left} are left over. "
            f"How many {item} does each child get?", each)


# --- rates --------------------------------------------------------------------------------------------------
def rate_speed(r):
    speed, hours = r.randint(30, 90), r.randint(2, 8)
    return f"A train travels at {speed} kilometres per hour for {hours} hours. How many kilometres does it travel?", speed * hours


def rate_work(r):
    n = r.choice(NAMES)
    per_hour, hours, days = r.randint(5, 30), r.randint(2, 8), r.randint(2, 6)
    return (f"{n} types {per_hour} pages an hour and works {hours} hours a day. "
            f"How many pages does {n} type in {days} days?", per_hour * hours * days)


def rate_fill(r):  # held-out
    rate, minutes, drain = r.randint(8, 30), r.randint(5, 20), r.randint(1, 7)
    return (f"A tank is filled at {rate} litres per minute while it leaks {drain} litres per minute. "
            f"How many litres are in the tank after {minutes} minutes if it started empty?", (rate - drain) * minutes)


# --- ages ---------------------------------------------------------------------------------------------------
def age_older(r):
    a, b = two_names(r)
    age, diff, years = r.randint(5, 30), r.randint(2, 20), r.randint(2, 15)
    return f"{a} is {age} years old. {b} is {diff} years older than {a}. How old will {b} be in {years} years?", age + diff + years


def age_times(r):
    a, b = two_names(r)
    child, k = r.randint(4, 15), r.randint(2, 4)
    return f"{b} is {child} years old and {a} is {k} times as old as {b}. How old is {a}?", child * k


def age_sum(r):  # held-out
    a, b = two_names(r)
    young, diff = r.randint(5, 25), r.randint(1, 15)
    return (f"The ages of {a} and {b} add up to {2 * young + diff}. {a} is {diff} years older than {b}. "
            f"How old is {b}?", young)


# --- unit conversions ---------------------------------------------------------------------------------------
def unit_minutes(r):
    h, m = r.randint(1, 9), r.randint(1, 59)
    return f"How many minutes are there in {h} hours and {m} minutes?", 60 * h + m


def unit_grams(r):
    kg, g = r.randint(1, 12), r.randint(10, 990)
    return f"A parcel weighs {kg} kilograms and {g} grams. How many grams does it weigh?", 1000 * kg + g


def unit_centimetres(r):  # held-out
    m, pieces = r.randint(2, 9), r.choice([4, 5, 8, 10, 20, 25])
    return (f"A rope {m} metres long is cut into {pieces} equal pieces. How many centimetres long is each piece?",
            m * 100 // pieces if (m * 100) % pieces == 0 else None)


# --- multi-step ---------------------------------------------------------------------------------------------
def multi_shopping(r):
    n = r.choice(NAMES)
    price, qty, paid_extra = r.randint(2, 15), r.randint(2, 9), r.randint(1, 30)
    paid = price * qty + paid_extra
    return (f"{n} buys {qty} notebooks at {price} dollars each and pays with {paid} dollars. "
            f"How much change does {n} get?", paid_extra)


def multi_savings(r):
    n = r.choice(NAMES)
    weekly, weeks, spent = r.randint(5, 40), r.randint(3, 12), r.randint(1, 30)
    return (f"{n} saves {weekly} dollars every week for {weeks} weeks, then spends {spent} dollars on a gift. "
            f"How many dollars does {n} have left?", weekly * weeks - spent)


def multi_garden(r):  # held-out
    rows, per_row, eaten, picked = r.randint(3, 10), r.randint(4, 12), r.randint(1, 9), r.randint(2, 5)
    total = rows * per_row * picked
    return (f"A garden has {rows} rows of {per_row} tomato plants. Each plant gives {picked} tomatoes, and birds "
            f"eat {eaten} of them. How many tomatoes are left?", total - eaten)


def multi_trip(r):  # held-out
    speed, hours, stops, stop_km = r.randint(40, 80), r.randint(2, 5), r.randint(1, 4), r.randint(5, 20)
    return (f"A bus drives {hours} hours at {speed} kilometres per hour and then {stops} more short legs of "
            f"{stop_km} kilometres each. How many kilometres does it drive in total?", speed * hours + stops * stop_km)


TEMPLATES = {
    "arithmetic": [arith_buy_give, arith_boxes, arith_share],
    "rates": [rate_speed, rate_work, rate_fill],
    "ages": [age_older, age_times, age_sum],
    "units": [unit_minutes, unit_grams, unit_centimetres],
    "multi-step": [multi_shopping, multi_savings, multi_garden, multi_trip],
}
HELDOUT = {"arith_share", "rate_fill", "age_sum", "unit_centimetres", "multi_garden", "multi_trip"}


def problems(split, n, seed):
    r = random.Random(seed)
    chosen = [(kind, t) for kind, ts in TEMPLATES.items() for t in ts if (t.__name__ in HELDOUT) == (split == "heldout")]
    seen, out = set(), []
    while len(out) < n:
        kind, t = chosen[len(out) % len(chosen)]
        q, a = t(r)
        if a is None or a < 0 or q in seen:
            continue
        seen.add(q)
        out.append({"question": q, "answer": a, "template": t.__name__, "kind": kind})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--split", choices=["train", "heldout"], required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rows = problems(a.split, a.n, a.seed)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{a.out}: {len(rows)} {a.split} problems from {len({r['template'] for r in rows})} templates")


if __name__ == "__main__":
    main()
