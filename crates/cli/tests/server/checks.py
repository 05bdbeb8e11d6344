"""The checks the server's client scripts share: each prints `ok` / `FAIL` per check and exits non-zero at the end
when any failed, so the Rust test that runs the script shows every failure, not only the first."""

import sys

import openai

failures = []


def check(name, ok, detail=""):
    """Record one named check; a failure prints `detail`."""
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"), flush=True)
    if not ok:
        failures.append(name)


def refused(name, call):
    """`call()` must raise the client's 400 (`openai.BadRequestError`); returns it (None when it did not raise)."""
    try:
        call()
        check(f"{name} refused", False, "no error")
    except openai.BadRequestError as e:
        check(f"{name} refused", e.status_code == 400, e)
        return e
    return None


def conclude(what):
    """Exit 1 when any check failed, else print that all `what` checks passed."""
    if failures:
        print(f"{len(failures)} {what} check(s) failed: {failures}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"all {what} checks passed", flush=True)
