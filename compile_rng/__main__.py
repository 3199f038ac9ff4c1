"""``python -m compile_rng``: the demo, and explain/dump for a user's function.

Run it with the Python that has compile_rng installed (``.venv/bin/python -m
compile_rng`` from a checkout set up with ``make``). Nothing here imports torch before
the command line is parsed, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
import time
from pathlib import Path
from typing import Any

DESCRIPTION = """\
compile_rng: functional, SPMD-correct random numbers for torch.compile.

  demo                  the multi-rank demo (CPU, gloo ranks)
  explain TARGET        every random op of TARGET: op, placements, counter offsets per rank
  dump TARGET --out D   depyf dumps of TARGET compiled with backend="compile_rng"
"""

TARGET_HELP = """\
TARGET is path/to/file.py:NAME or package.module:NAME. NAME is either a function that
takes no arguments, or a function that takes none and returns (fn, args) or
(fn, args, kwargs) - the call to explain or dump. Example, from a checkout:
  python -m compile_rng explain compile_rng.demo:explain_target
"""


def _fail(message: str) -> SystemExit:
    return SystemExit(f"compile_rng: {message}")


def _load_module(where: str):
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise _fail(f"no file {where!r} (TARGET is path/to/file.py:NAME or package.module:NAME)")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise _fail(f"no module {where!r} (TARGET is path/to/file.py:NAME or package.module:NAME)") from None
        raise


def _load(target: str) -> tuple[Any, tuple, dict]:
    """The call ``TARGET`` names: ``(fn, args, kwargs)``."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise _fail(f"TARGET must look like path/to/file.py:NAME or package.module:NAME, got {target!r}")
    module = _load_module(where)
    if not hasattr(module, name):
        public = sorted(
            n for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise _fail(f"{where} has no {name!r}; its functions: {', '.join(public) or '(none)'}")
    obj = getattr(module, name)
    if not callable(obj):
        raise _fail(f"{target} is not callable")
    try:
        inspect.signature(obj).bind()
    except TypeError:
        raise _fail(
            f"{target} needs arguments {inspect.signature(obj)}; give it defaults, or name a function "
            "that takes none and returns (fn, args) or (fn, args, kwargs)"
        ) from None
    except ValueError:  # no signature (a builtin): call it and see
        pass
    made = obj()
    if isinstance(made, tuple) and made and callable(made[0]):
        fn, args, kwargs = (*made, {})[:3]
        return fn, tuple(args), dict(kwargs)
    return obj, (), {}


def _progress(message: str) -> float:
    print(f"[compile_rng] {message}", file=sys.stderr, flush=True)
    return time.perf_counter()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m compile_rng", description=DESCRIPTION, epilog=TARGET_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,explain,dump}")
    demo = sub.add_parser("demo", help="run the multi-rank demo")
    demo.add_argument("--world", type=int, default=4, help="number of CPU (gloo) ranks, dividing 64 (default 4)")
    for name, help_text in (
        ("explain", "report every random op of TARGET with its offsets per rank"),
        ("dump", "compile TARGET with backend='compile_rng' under depyf and write the dumps"),
    ):
        command = sub.add_parser(
            name, help=help_text, description=help_text, epilog=TARGET_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument("target", metavar="TARGET", help="path/to/file.py:NAME or package.module:NAME")
        if name == "explain":
            command.add_argument(
                "--layout", "--mode", dest="layout", default="tracker", choices=["tracker", "invariant"],
                help="counter layout: 'tracker' (eager DTensor's; the default) or 'invariant' "
                "(values independent of the sharding); --mode is the old spelling",
            )
        else:
            command.add_argument("--out", required=True, metavar="DIR", help="folder for the dumps (created)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    start = _progress("importing torch and compile_rng ...")
    import compile_rng

    compile_rng.install()  # deferred while the package was imported for -m (see __init__)
    if args.command == "demo":
        from compile_rng.demo import main as demo_main

        demo_main(["--world", str(args.world)])
        return
    _progress(f"loading {args.target}")
    fn, fargs, fkwargs = _load(args.target)
    if args.command == "explain":
        _progress("tracing and compiling (AOTAutograd + the compile_rng pass) ...")
        report = compile_rng.explain(fn, *fargs, layout=args.layout, **fkwargs)
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
