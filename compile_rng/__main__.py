"""``python -m compile_rng``: the demo, and explain/dump for a user's function.

    python -m compile_rng demo [--world 4]
    python -m compile_rng explain TARGET [--mode tracker|invariant]
    python -m compile_rng dump TARGET --out DIR

TARGET is ``path/to/file.py:name`` or ``package.module:name``. If ``name()`` returns
``(fn, args)`` or ``(fn, args, kwargs)`` that call is explained/dumped; otherwise
``name`` itself is called with no arguments.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any


def _load(target: str) -> tuple[Any, tuple, dict]:
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise SystemExit(f"compile_rng: TARGET must look like file.py:name or module:name, got {target!r}")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(where).resolve().parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    obj = getattr(module, name)
    made = obj() if callable(obj) else obj
    if isinstance(made, tuple) and made and callable(made[0]):
        fn, args, kwargs = (*made, {})[:3]
        return fn, tuple(args), dict(kwargs)
    return obj, (), {}


def _progress(message: str) -> float:
    print(f"[compile_rng] {message}", file=sys.stderr, flush=True)
    return time.perf_counter()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m compile_rng", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the multi-rank demo")
    demo.add_argument("--world", type=int, default=4)
    explain = sub.add_parser("explain", help="report every random op of TARGET with its offsets per rank")
    explain.add_argument("target")
    explain.add_argument("--mode", default="tracker", choices=["tracker", "invariant"])
    dump = sub.add_parser("dump", help="compile TARGET with backend='compile_rng' under depyf and write the dumps")
    dump.add_argument("target")
    dump.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import compile_rng

    if args.command == "demo":
        from compile_rng.demo import main as demo_main

        demo_main(["--world", str(args.world)])
        return
    start = _progress(f"loading {args.target}")
    fn, fargs, fkwargs = _load(args.target)
    if args.command == "explain":
        _progress("tracing and compiling (AOTAutograd + the compile_rng pass)...")
        report = compile_rng.explain(fn, *fargs, mode=args.mode, **fkwargs)
        print(report)
    else:
        import torch

        _progress(f"compiling under depyf into {args.out} ...")
        with compile_rng.dump(args.out) as folder:
            torch.compile(fn, backend="compile_rng")(*fargs, **fkwargs)
        written = sorted(p.name for p in folder.iterdir())
        print(f"wrote {len(written)} files to {folder}:")
        for name in written:
            print(f"  {name}")
    _progress(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
