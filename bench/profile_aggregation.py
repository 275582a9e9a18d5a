"""One call of the window aggregation on ``bench_tq_poll.py``'s reply shape, for ``valgrind --tool=callgrind``.

Instruction counts do not move with the machine's load, unlike wall times on the shared 2-core build
machine, so bench/README.md's profile of the aggregation comes from this script:

    PYTHONHASHSEED=0 valgrind --tool=callgrind --toggle-collect=_operator_call \\
        .venv/bin/python bench/profile_aggregation.py windows_from --keys 10000 [--baseline REV]
    callgrind_annotate callgrind.out.<pid>

Only what runs inside ``operator.call`` is collected: one call of the chosen function, after a warm-up call
(string hashes cached, as in the bench's repeated calls). The reply is built without Ray: the bench's keys
and tags for ``train`` and ``val``, pickled and read back so that every tag is an object of its own, as in a
``kv_list`` reply. ``--baseline REV`` profiles git revision REV's ``tqmon/composition.py`` instead.
"""

from __future__ import annotations

import argparse
import operator
import pickle
import time
from collections.abc import Callable
from typing import Any

from bench_tq_poll import VAL_KEYS, bare_count, composition_at, key_and_tag, prompt_tag

import tqmon.composition
from tqmon.sources.tq import windows_of
from tqmon.warmup import PARTITIONS


def reply_of(keys: int) -> dict[str, dict[str, Any]]:
    reply = {"train": dict(map(key_and_tag, range(keys))), "val": {key: prompt_tag(0) for key in VAL_KEYS}}
    copy: dict[str, dict[str, Any]] = pickle.loads(pickle.dumps(reply))
    return copy


def calls(module: Any, reply: dict[str, dict[str, Any]]) -> dict[str, Callable[[], object]]:
    """The aggregation and its two passes over ``train`` (whose arguments changed in issue 19), and verl's count."""
    train = reply["train"]
    first = module.classify_keys(train)
    attribution = (train, first[1]) if len(first) == 2 else first[1:]
    return {
        "bare": lambda: bare_count(reply),
        "windows_from": lambda: windows_of(
            {p: module.compose(reply.get(p) or {}) for p in PARTITIONS}, None, time.time()
        ),
        "classify": lambda: module.classify_keys(train),
        "attribute": lambda: module.attribute(*attribution),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("call", choices=["bare", "windows_from", "classify", "attribute"])
    parser.add_argument("--keys", type=int, default=10_000, help="keys in train")
    parser.add_argument("--baseline", metavar="REV", help="profile git revision REV's composition module")
    args = parser.parse_args()
    module = composition_at(args.baseline) if args.baseline else tqmon.composition
    call = calls(module, reply_of(args.keys))[args.call]
    call()
    operator.call(call)


if __name__ == "__main__":
    main()
