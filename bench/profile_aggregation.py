"""Instruction counts of the window aggregation against verl's bare count, under ``valgrind --tool=callgrind``.

Instructions do not move with the machine's load, unlike wall times on the shared 2-core build machine, so
bench/README.md's profile of the aggregation comes from this script:

    python bench/profile_aggregation.py --keys 10000 [--baseline REV]

It builds ``bench_tq_poll.py``'s reply shape without Ray (pickled and read back, so that every tag is an
object of its own, as in a ``kv_list`` reply), then runs itself once per measured call under callgrind with
``PYTHONHASHSEED=0``, collecting only inside ``operator.call``: one call, after a warm-up call (string hashes
cached, as in the bench's repeated calls). It prints instructions per key of ``train`` and leaves each
``callgrind.out`` in ``--out`` for ``callgrind_annotate``. ``--baseline REV`` adds git revision REV's
``tqmon/composition.py`` beside this tree's.
"""

from __future__ import annotations

import argparse
import operator
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from aggregation import aggregation_of, bare_count, composition_at

import tqmon.composition

CALLS = ("windows_from", "classify", "attribute")


def write_reply(path: Path, keys: int) -> None:
    from bench_tq_poll import VAL_KEYS, key_and_tag, prompt_tag  # Ray and torch: never under valgrind

    reply = {"train": dict(map(key_and_tag, range(keys))), "val": {key: prompt_tag(0) for key in VAL_KEYS}}
    path.write_bytes(pickle.dumps(reply))


def call_of(name: str, module: ModuleType, reply: dict[str, dict[str, Any]]) -> Callable[[], object]:
    """One measured call; the attribution pass's arguments are what that revision's first pass returns
    (issue 19 changed them from the reply to the first pass's prompt map)."""
    train = reply["train"]
    if name == "bare":
        return lambda: bare_count(reply)
    if name == "windows_from":
        aggregation = aggregation_of(module)
        return lambda: aggregation(reply)
    if name == "classify":
        return lambda: module.classify_keys(train)
    first = module.classify_keys(train)
    arguments = (train, first[1]) if len(first) == 2 else first[1:]
    return lambda: module.attribute(*arguments)


def child(name: str, reply_path: Path, revision: str | None) -> None:
    """Under valgrind: the warm-up call, then the collected one."""
    module = composition_at(revision) if revision else tqmon.composition
    call = call_of(name, module, pickle.loads(reply_path.read_bytes()))
    call()
    operator.call(call)


def instructions(name: str, reply_path: Path, revision: str | None, out: Path) -> int:
    command = ["valgrind", "--tool=callgrind", "--toggle-collect=_operator_call", f"--callgrind-out-file={out}"]
    command += [sys.executable, __file__, "--child", name, "--reply", str(reply_path)]
    command += ["--baseline", revision] if revision else []
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from callgrind: {done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--keys", type=int, default=10_000, help="keys in train")
    parser.add_argument("--baseline", metavar="REV", help="also profile git revision REV's composition module")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the callgrind.out files")
    parser.add_argument("--child", choices=("bare", *CALLS), help=argparse.SUPPRESS)
    parser.add_argument("--reply", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.reply, args.baseline)
        return
    runs: list[tuple[str, str, str | None]] = [("bare count (verl)", "bare", None)]
    runs += [(f"{name} (this tree)", name, None) for name in CALLS]
    runs += [(f"{name} ({args.baseline})", name, args.baseline) for name in CALLS if args.baseline]
    with tempfile.TemporaryDirectory(prefix="tqmon-profile-") as tmp:
        reply_path = Path(tmp) / "reply.pkl"
        write_reply(reply_path, args.keys)
        bare = 0.0
        print(f"{'instructions per key of train':40} {'per key':>8} {'/ bare':>7}  ({args.keys:,} keys)", flush=True)
        for label, name, revision in runs:
            out = args.out / f"callgrind.out.{name}.{revision or 'tree'}"
            count = instructions(name, reply_path, revision, out) / args.keys
            bare = bare or count
            print(f"{label:40} {count:8,.0f} {count / bare:6.2f}x  {out}", flush=True)


if __name__ == "__main__":
    main()
