"""Argument cases for the fuzzer (see ``tests/fuzzing.py``): a valid trace, hostile option values.

Every command gets random options drawn from a pool of values a user might type by mistake or on
purpose: zero, negatives, huge integers, ``nan``/``inf``, empty strings, backwards ranges, unknown
policies, plots with unknown extensions or in missing folders, an option given twice, an output
that is the input trace. Refusing is fine; what is judged
is how: one line, exit 2, no traceback, no hang, bounded memory.
"""

from __future__ import annotations

import random

from fuzzing import Case, random_trace, trace_members, zip_bytes

NUMBERS = ["0", "1", "2", "3", "-1", "0.5", "1e309", "nan", "inf", "-inf", "", "abc", "1_000",
           "99999999999999999999", "4611686018427387904", "9" * 5000, "0x10", " 4 "]
SPECS = ["3:2", "1:8", "2,3,4", "1:100:0", "0:4", "2:4611686018427387904:1000000000000000", "1:2000000",
         "4,4,4", ",", ":", "1:2:3:4"]
LAYERS = ["all", "0-3", "5-2", "0,0", "-1", "9999999999-99999999999", "0-4095", "1,2,x", ""]
POLICIES = ["lru", "belady", "foresight:4", "foresight:99999999999999", "decayed:0.5", "decayed:nan", "random:3",
            "random:99999999999999999999", "nope", "", "lfu:1", "mean-interval", "static", "static:3",
            "router-logit", "learned:{root}/missing.npz", "learned:{root}/t.npz", "learned:{root}/good.json"]
BYTES = ["12GB", "0.5GB", "1GiB", "17.5MB", "4096", "0", "-1GB", "1e30GB", "nanGB", "GB", "12XB", "", "1" * 400]
BYTE_RANGES = ["1MB:64MB:x2", "1MB:64MB", "1MB:4MB:+1MB", "1MB,2MB", "64MB:1MB", "1MB:2MB:x1", "1MB:2MB:x0.5",
               "1B:1TB:+1B", "1MB:2MB:+0", ":", ",", "1MB:2MB:3:4"]
DURATIONS = ["0.51ms", "510us", "0.00051s", "0", "-1ms", "nanms", "1e400ms", "5tok/s", "0tok/s", "12", "ms", "1 h"]

COMMANDS = {
    "replay": [("-c", NUMBERS), ("-p", POLICIES), ("--pool", ["layer", "global", "x"]), ("--reset", ["none", "x"]),
               ("--layers", LAYERS), ("--warm", NUMBERS), ("--expert-mb", NUMBERS), ("--tau", DURATIONS),
               ("--c", DURATIONS), ("--tokens-per-s", NUMBERS), ("--budget", BYTES),
               ("--admission", ["all", "second", "x"]), ("--unit", ["token", "iteration", "x"]),
               ("--jobs", ["1", "0", "-3", "x", "99999999999999999999"]),
               ("--ray", ["nowhere", "ray://", "host:0", "host:99999", "", ":6379", "h:x"]),
               ("--profile", ["{path}", "{root}/missing.npz", "{root}/good.json", "{root}"]),
               ("--model-config", ["{root}/missing.json", "{root}/t.npz", "{root}/deep.json", "{root}/bigint.json",
                                   "{root}/huge.json", "{root}/good.json", "{root}/bad.json", "{root}"])],
    "sweep": [("--capacities", SPECS + NUMBERS[:4]), ("-p", POLICIES), ("--target-hit-rate", NUMBERS),
              ("--target-copies", NUMBERS), ("--plot", ["{root}/m.png", "{root}/m.jpg", "{root}/no/m.svg", "{root}"]),
              ("--pool", ["global"]), ("--layers", LAYERS), ("--budgets", BYTE_RANGES), ("--expert-mb", NUMBERS),
              ("--warm", NUMBERS), ("--admission", ["second", "x"]), ("--unit", ["iteration", "x"]),
              ("--jobs", ["1", "0", "x"]), ("--ray", ["nowhere", "host:0", ""])],
    "batch": [("--out", ["{root}/u.npz", "{root}/no/u.npz", "{root}", "{path}"]),
              ("{path}", None), ("{root}/missing.npz", None), ("{root}/good.json", None)],
    "foresight": [("-c", NUMBERS), ("--horizons", ["1,2", "0", "-1", "99999999999999999", "x", ""]), ("-p", POLICIES)],
    "compare-pools": [("--capacities", SPECS), ("-c", NUMBERS), ("-p", POLICIES), ("--warm", NUMBERS)],
    "bounds": [("-c", NUMBERS), ("--exact", None), ("--max-states", NUMBERS), ("--order", ["router", "x"]),
               ("--layers", LAYERS)],
    "stats": [("--top", NUMBERS), ("--windows", ["1,8", "0", "99999999999999999999", "x", "4611686018427387904"]),
              ("--summary", None)],
    "export": [("--order", ["router", "ascending", "x"]), ("--format", ["csv", "oracle", "x"]), ("--layers", LAYERS),
               ("--out", ["{root}/x.csv", "{root}/no/x.csv", "{root}", "{path}"])],
    "choose": [("--tolerance", NUMBERS), ("--tau", DURATIONS), ("--overlap", None), ("--validate", None),
               ("--add-replay", ["{path}", "{root}/missing.npz", "{root}/good.jsonl", "{root}"]),
               ("--replay-policy", POLICIES), ("--layers", LAYERS),
               ("--plot", ["{root}/f.png", "{root}/f.jpg", "{root}/no/f.svg", "{root}"])],
}
NEEDS = {"replay": ["-c"], "batch": ["--out"], "foresight": ["-c"], "bounds": ["-c"], "export": ["--out"], "choose": ["--tolerance"]}


def args_case(rng: random.Random) -> Case:
    arrays, meta = random_trace(rng)
    command = rng.choice(sorted(COMMANDS))
    argv = ["export", "libcachesim"] if command == "export" else [command]
    argv.append("{root}/" + rng.choice(sorted(RUNS)) if command == "choose" else "{path}")
    options = COMMANDS[command]
    chosen = rng.sample(options, rng.randint(1, min(4, len(options))))
    for name in NEEDS.get(command, []):
        if name not in [c[0] for c in chosen] and rng.random() < 0.9:
            chosen.append(next(o for o in options if o[0] == name))
    if rng.random() < 0.15:  # an option given twice: refused, whatever the values
        chosen.append(rng.choice(chosen))
    for name, pool in chosen:
        argv.append(name)
        if pool is not None:
            argv.append(rng.choice(pool))
    if rng.random() < 0.5:
        argv.append("--json")
    files = {"t.npz": zip_bytes(trace_members(arrays, meta)), **CONFIGS, **RUNS}
    return Case("args", " ".join(argv), "any", files, argv=argv)


CONFIGS = {  # model configs for --model-config: hostile and valid
    "deep.json": b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    "bigint.json": b'{"hidden_size": 1' + b"0" * 5000 + b', "intermediate_size": 2, "torch_dtype": "bfloat16"}',
    "huge.json": b'{"hidden_size": 99999999999999999999, "intermediate_size": 99999999999, "torch_dtype": "float32"}',
    "good.json": b'{"hidden_size": 2048, "intermediate_size": 1024, "torch_dtype": "bfloat16"}',
    "bad.json": b'\xff\xfe{"hidden_size": true}',
}


_RUN = '{"policy": "%s", "c_ms": %s, "rho": %s, "dnll": %s, "tau_ms": 0.5, "ms_per_token": 30, "slow_copies": %s, "capacity": 4}'
RUNS = {  # runs files for choose: valid, slowed, and hostile
    "good.jsonl": "\n".join(_RUN % (p, c, r, d, 1) for p, c, r, d in
                            [("lru", 20, 9, 0), ("decayed", 21, 8, 0.001), ("dwell:16:128", 20, 2, 0.07)]).encode(),
    "slowed.jsonl": "\n".join(_RUN % (p, c, r, d, n) for n in (1, 10) for p, c, r, d in
                              [("lru", 20, 9, 0), ("dwell:4", 20, 2, 0.03)]).encode(),
    "nan.jsonl": (_RUN % ("lru", "NaN", 1, 0, 1)).encode(),
    "huge.jsonl": (_RUN % ("lru", "1e999", "9" * 4000, 0, "99999999999999999999")).encode(),
    "neg.jsonl": (_RUN % ("lru", -1, -2, 0, 0)).encode(),
    "dup.jsonl": ((_RUN % ("lru", 1, 1, 0, 1)) + "\n" + (_RUN % ("lru", 2, 1, 0, 1))).encode(),
    "deep.jsonl": b"[" * 100_000 + b"]" * 100_000,
    "types.jsonl": b'{"policy": 7, "c_ms": "20", "rho": true, "dnll": null}',
    "empty.jsonl": b"",
    "binary.jsonl": b"\xff\xfe\x00\x01" * 1000,
    "list.json": b'[{"policy": "lru", "c_ms": 1, "rho": 1, "dnll": 0}, 3]',
}
